"""Tests for melfeed.shared.cache.manifest: building from headers, problems, fingerprint, atomic write, load."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import (
    MANIFEST_NAME,
    CacheProblem,
    Manifest,
    Utterance,
    load_manifest,
    write_manifest,
)
from melfeed.shared.errors import CacheError

N_MELS = 8


def _put(root: Path, uid: str, mel: np.ndarray | None, tokens: np.ndarray | None) -> None:
    for sub, arr in (("mels", mel), ("tokens", tokens)):
        (root / sub).mkdir(parents=True, exist_ok=True)
        if arr is not None:
            np.save(root / sub / f"{uid}.npy", arr)


def _good(root: Path, uid: str, frames: int, tokens: int, dtype: str = "<f4") -> None:
    mel = np.full((frames, N_MELS), frames, dtype=dtype)
    _put(root, uid, mel, np.arange(1, tokens + 1, dtype="<i4"))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    _good(root, "b", 12, 3)
    _good(root, "a", 7, 2)
    _good(root, "c", 5, 4, dtype="<f2")
    return root


def test_build_lists_good_utterances_sorted_with_offsets(cache: Path) -> None:
    manifest, problems = build_manifest(cache, N_MELS)
    assert problems == []
    assert [u.id for u in manifest.utterances] == ["a", "b", "c"]
    assert manifest.frames.tolist() == [7, 12, 5]
    assert manifest.token_counts.tolist() == [2, 3, 4]
    assert manifest.frames.dtype == np.int64 and not manifest.frames.flags.writeable
    b = manifest.utterances[1]
    assert b == Utterance("b", 12, 3, "float32", 128, 128 + 12 * N_MELS * 4, 128, 128 + 12)
    assert manifest.utterances[2].mel_dtype == "float16"
    assert manifest.mel_path(1) == cache / "mels" / "b.npy"
    assert manifest.tokens_path(0) == cache / "tokens" / "a.npy"
    assert len(manifest) == 3


def test_build_records_header_length_other_than_128(cache: Path) -> None:
    with open(cache / "tokens" / "b.npy", "wb") as f:
        np.lib.format.write_array(f, np.arange(3, dtype="<i4"), version=(2, 0))
    mel = cache / "mels" / "b.npy"
    data = np.load(mel).tobytes()
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': (12, 8), }"
    body = text.encode() + b" " * 150 + b"\n"
    mel.write_bytes(b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + data)
    manifest, problems = build_manifest(cache, N_MELS)
    assert problems == []
    assert manifest.utterances[1].mel_offset == 10 + len(body)
    assert manifest.utterances[1].mel_file_bytes == 10 + len(body) + len(data)


_F4 = np.zeros((4, N_MELS), dtype="<f4")
_I4 = np.arange(1, 4, dtype="<i4")


@pytest.mark.parametrize(
    ("mel", "tokens", "bad_file", "match"),
    [
        (_F4, None, "mels/x.npy", r"no matching tokens/x\.npy"),
        (None, _I4, "tokens/x.npy", r"no matching mels/x\.npy"),
        (np.zeros(4, "<f4"), _I4, "mels/x.npy", r"expected rank 2 \[frames, n_mels\], got shape \(4,\)"),
        (np.zeros((4, 5), "<f4"), _I4, "mels/x.npy", r"expected n_mels=8 .* got shape \(4, 5\)"),
        (_F4.astype("<f8"), _I4, "mels/x.npy", "mel dtype <f8 not allowed"),
        (_F4.astype(">f4"), _I4, "mels/x.npy", "mel dtype >f4 not allowed"),
        (np.zeros((0, N_MELS), "<f4"), _I4, "mels/x.npy", "zero frames"),
        (_F4, _I4.reshape(1, 3), "tokens/x.npy", r"expected rank 1 \[tokens\], got shape \(1, 3\)"),
        (_F4, _I4.astype("<i8"), "tokens/x.npy", "token dtype <i8 not allowed"),
        (_F4, np.zeros(0, "<i4"), "tokens/x.npy", "zero tokens"),
        (_F4, np.array([3, 0, -7, 5], "<i4"), "tokens/x.npy", r"^token id -7 at position 2: ids must be >= 0$"),
    ],
)
def test_bad_files_become_problems_and_are_left_out(
    cache: Path, mel: np.ndarray | None, tokens: np.ndarray | None, bad_file: str, match: str
) -> None:
    _put(cache, "x", mel, tokens)
    manifest, problems = build_manifest(cache, N_MELS)
    assert [u.id for u in manifest.utterances] == ["a", "b", "c"]
    assert len(problems) == 1
    assert problems[0].path == str(cache / bad_file)
    assert str(problems[0]) == f"{cache / bad_file}: {problems[0].reason}"
    assert re.search(match, problems[0].reason), problems[0].reason


def test_bad_header_and_truncated_data_are_problems(cache: Path) -> None:
    (cache / "mels" / "a.npy").write_bytes(b"not numpy at all")
    tok_b = cache / "tokens" / "b.npy"
    tok_b.write_bytes(tok_b.read_bytes()[:-2])
    manifest, problems = build_manifest(cache, N_MELS)
    assert [u.id for u in manifest.utterances] == ["c"]
    assert problems == [
        CacheProblem(str(cache / "mels" / "a.npy"), "not a .npy file (bad magic)"),
        CacheProblem(str(tok_b), "truncated: 10 data bytes, expected 12"),
    ]


def test_both_files_of_one_utterance_reported(cache: Path) -> None:
    _put(cache, "x", np.zeros(3, "<f4"), np.zeros(0, "<i4"))
    _, problems = build_manifest(cache, N_MELS)
    assert [Path(p.path).parent.name for p in problems] == ["mels", "tokens"]


@pytest.mark.parametrize("missing", ["mels", "tokens"])
def test_missing_directory_raises_naming_it(cache: Path, missing: str) -> None:
    shutil.rmtree(cache / missing)
    with pytest.raises(CacheError, match="missing directory") as info:
        build_manifest(cache, N_MELS)
    assert info.value.path == str(cache / missing)


def test_empty_cache_raises(tmp_path: Path) -> None:
    (tmp_path / "mels").mkdir()
    (tmp_path / "tokens").mkdir()
    (tmp_path / "mels" / "readme.txt").write_text("not an utterance")
    with pytest.raises(CacheError, match="empty cache") as info:
        build_manifest(tmp_path, N_MELS)
    assert info.value.path == str(tmp_path)


def test_progress_reports_every_id(cache: Path) -> None:
    _put(cache, "z", _F4, None)
    calls: list[tuple[int, int]] = []
    build_manifest(cache, N_MELS, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_fingerprint_survives_copy_and_changes_with_a_file(cache: Path, tmp_path: Path) -> None:
    original, _ = build_manifest(cache, N_MELS)
    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    copied, _ = build_manifest(copy, N_MELS)
    assert copied.fingerprint == original.fingerprint
    assert copied.cache_dir == copy
    _good(copy, "b", 13, 3)  # one more frame in one file
    changed, _ = build_manifest(copy, N_MELS)
    assert changed.fingerprint != original.fingerprint
    assert len(original.fingerprint) == 16 and int(original.fingerprint, 16) >= 0


def test_write_then_load_round_trips(cache: Path) -> None:
    manifest, _ = build_manifest(cache, N_MELS)
    path = write_manifest(manifest)
    assert path == cache / MANIFEST_NAME
    assert [p.name for p in cache.iterdir() if p.is_file()] == [MANIFEST_NAME]  # no temp left
    doc = json.loads(path.read_text())
    assert doc["columns"][0] == "id" and doc["utterances"][0][0] == "a"
    assert load_manifest(cache, N_MELS) == manifest


def test_index_records_the_smallest_and_largest_token_id_of_the_kept_utterances(cache: Path) -> None:
    manifest, _ = build_manifest(cache, N_MELS)
    assert manifest.token_range == (1, 4)  # a: 1..2, b: 1..3, c: 1..4
    _put(cache, "d", _F4, np.array([0, 700, 2], "<i4"))
    _put(cache, "e", np.zeros(3, "<f4"), np.array([9000], "<i4"))  # a bad mel: its ids are left out too
    manifest, problems = build_manifest(cache, N_MELS)
    assert manifest.token_range == (0, 700) and [p.path for p in problems] == [str(cache / "mels" / "e.npy")]
    write_manifest(manifest)
    assert json.loads((cache / MANIFEST_NAME).read_text())["token_range"] == [0, 700]
    assert load_manifest(cache).token_range == (0, 700)


def test_a_manifest_without_token_range_keeps_the_fingerprint_it_had_and_loads_unchecked(cache: Path) -> None:
    rows = (
        Utterance("LJ001-0001", 120, 30, "float32", 128, 128 + 120 * 80 * 4, 128, 128 + 120),
        Utterance("LJ001-0002", 7, 2, "float16", 128, 128 + 7 * 80 * 2, 128, 136),
    )
    assert Manifest(cache, 80, rows).fingerprint == "7bfabcf7e5f8adf0"  # the rows alone, no token_range
    ranged = {Manifest(cache, 80, rows, token_range=r).fingerprint for r in ((1, 40), (0, 40), (1, 41))}
    assert len(ranged) == 3 and "7bfabcf7e5f8adf0" not in ranged
    old = build_manifest(cache, N_MELS)[0]
    old = Manifest(old.cache_dir, old.n_mels, old.utterances)  # a manifest without token_range
    write_manifest(old)
    assert "token_range" not in json.loads((cache / MANIFEST_NAME).read_text())
    loaded = load_manifest(cache, N_MELS)
    assert loaded.token_range is None and loaded.fingerprint == old.fingerprint


def test_load_from_copied_cache_resolves_paths_there(cache: Path, tmp_path: Path) -> None:
    write_manifest(build_manifest(cache, N_MELS)[0])
    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    assert load_manifest(copy).mel_path(0) == copy / "mels" / "a.npy"


def _edit(cache: Path, change: Callable[[dict[str, Any]], object]) -> None:
    path = cache / MANIFEST_NAME
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _set_row(doc: dict[str, Any], col: int, value: object) -> None:
    doc["utterances"][0][col] = value


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: _set_row(d, 1, 6), r"fingerprint mismatch \(manifest edited\?\)"),
        (lambda d: _set_row(d, 1, True), "column frames must hold only int"),
        (lambda d: _set_row(d, 4, 128.0), "column mel_offset must hold only int"),
        (lambda d: _set_row(d, 6, 2**70), "integer out of range"),
        (lambda d: d["utterances"][1].pop(), "each utterance must be a list of 8"),
        (lambda d: d["utterances"].append({"id": "z"}), "each utterance must be a list of 8"),
        (lambda d: _set_row(d, 1, 0), "malformed manifest row"),
        (lambda d: _set_row(d, 3, "float64"), "mel_dtype must be float32 or float16"),
        (lambda d: _set_row(d, 2, -1), "malformed manifest row"),
        (lambda d: _set_row(d, 5, 10), r"malformed manifest row \['a', 7"),
        (lambda d: _set_row(d, 0, ""), "bad utterance id ''"),
        (lambda d: _set_row(d, 0, "../../etc/x"), "bad utterance id"),
        (lambda d: d["utterances"].reverse(), "malformed manifest: utterances must be sorted"),
        (lambda d: d.pop("fingerprint"), "missing utterances or fingerprint"),
        (lambda d: d.__setitem__("columns", ["id"]), "unexpected columns"),
        (lambda d: d.__setitem__("format", 99), "unsupported manifest format 99"),
        (lambda d: d.__setitem__("n_mels", "8"), "malformed manifest: n_mels='8'"),
        (lambda d: d.__setitem__("token_range", [1, 9]), r"fingerprint mismatch \(manifest edited\?\)"),
        (lambda d: d.pop("token_range"), r"fingerprint mismatch \(manifest edited\?\)"),
        *(
            (lambda d, v=v: d.__setitem__("token_range", v), r"token_range must be \[smallest, largest\], two int32")
            for v in ([1, True], [1.0, 4], [4, 1], [0, 2**31], [-(2**31) - 1, 4], [1], [1, 2, 3], "1,4", {"min": 1})
        ),
    ],
)
def test_load_rejects_edited_manifest(cache: Path, change: Callable[[dict[str, Any]], object], match: str) -> None:
    write_manifest(build_manifest(cache, N_MELS)[0])
    _edit(cache, change)
    with pytest.raises(CacheError, match=match) as info:
        load_manifest(cache)
    assert info.value.path == str(cache / MANIFEST_NAME)


def test_load_missing_manifest_says_how_to_fix(cache: Path) -> None:
    with pytest.raises(CacheError) as info:
        load_manifest(cache)
    assert str(info.value) == (f"{cache / MANIFEST_NAME}: no manifest; run `melfeed index --cache-dir DIR` first")


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_load_malformed_json(cache: Path, content: bytes) -> None:
    (cache / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(CacheError, match="malformed manifest|unsupported manifest format") as info:
        load_manifest(cache)
    assert "\n" not in str(info.value)


_DEEP = "[" * 100_000 + "]" * 100_000  # past the parser's recursion limit: a RecursionError traceback before


def test_a_manifest_or_feature_record_nested_too_deeply_is_malformed_not_a_recursion_error(cache: Path) -> None:
    (cache / MANIFEST_NAME).write_text(_DEEP)
    with pytest.raises(CacheError, match=r"manifest\.json: malformed manifest: nested too deeply$"):
        load_manifest(cache)
    (cache / MANIFEST_NAME).write_text('{"format": 1, "extras": ' + _DEEP + "}")
    manifest, _ = build_manifest(cache, N_MELS)  # index only peeks at the old manifest: it is rewritten
    assert load_manifest(write_manifest(manifest).parent) == manifest
    (cache / "features.json").write_text(_DEEP)
    with pytest.raises(CacheError, match=r"features\.json: malformed feature record: nested too deeply$"):
        build_manifest(cache, N_MELS)


def test_a_directory_named_manifest_json_is_one_cache_error_and_leaves_no_temp_file(cache: Path) -> None:
    (cache / MANIFEST_NAME).mkdir()
    with pytest.raises(CacheError, match=r"manifest\.json: cannot write \(Is a directory\)$"):
        write_manifest(build_manifest(cache, N_MELS)[0])
    assert sorted(p.name for p in cache.iterdir()) == ["manifest.json", "mels", "tokens"]


def test_a_cache_dir_that_is_not_a_directory_cannot_be_read(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match=r"file/manifest\.json: cannot read \(Not a directory\)$"):
        load_manifest(tmp_path / "file")


def test_load_checks_n_mels(cache: Path) -> None:
    write_manifest(build_manifest(cache, N_MELS)[0])
    with pytest.raises(CacheError, match="manifest has n_mels=8, config says 80"):
        load_manifest(cache, 80)


def test_manifest_requires_sorted_unique_ids(tmp_path: Path) -> None:
    u = Utterance("a", 1, 1, "float32", 128, 160, 128, 132)
    with pytest.raises(ValueError, match="sorted"):
        Manifest(tmp_path, N_MELS, (u, u))
