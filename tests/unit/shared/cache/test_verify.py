"""Tests for melfeed.shared.cache.verify and ``melfeed verify-cache``: every bad-cache case, both modes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import melfeed.shared.cache.verify
from melfeed.shared.cache.demo_data import demo_utterance_id, write_demo_cache
from melfeed.shared.cache.manifest import MANIFEST_NAME
from melfeed.shared.cache.verify import VerifyProblem, verify_cache
from melfeed.shared.errors import CacheError

REPO = Path(__file__).resolve().parents[4]
N = 20


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "cache"
    write_demo_cache(path, n_utterances=N)
    return path


@pytest.fixture
def cache(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "cache"))


def _mel(root: Path, i: int) -> Path:
    return root / "mels" / f"{demo_utterance_id(i)}.npy"


def _tok(root: Path, i: int) -> Path:
    return root / "tokens" / f"{demo_utterance_id(i)}.npy"


def _edit(path: Path, change: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    arr = change(np.load(path))
    np.save(path, arr)
    return arr


def _with_values(frame_values: dict[tuple[int, int], float]) -> Callable[[np.ndarray], np.ndarray]:
    def change(mel: np.ndarray) -> np.ndarray:
        for (frame, col), value in frame_values.items():
            mel[frame, col] = value
        return mel

    return change


def _corrupt(root: Path) -> dict[str, tuple[str, str]]:
    """One bad file per case. Returns ``{path: (reason with a manifest, reason without one)}``."""
    _mel(root, 0).unlink()
    tok = _tok(root, 1)
    tok_bytes = tok.read_bytes()
    tok.write_bytes(tok_bytes[:-8])
    _edit(_mel(root, 2), lambda m: m.astype(np.float64))
    rank3 = _edit(_mel(root, 3), lambda m: m[:, :, None])
    bins40 = _edit(_mel(root, 4), lambda m: m[:, :40])
    _edit(_mel(root, 5), np.asfortranarray)
    _edit(_mel(root, 6), _with_values({(7, 0): np.nan, (9, 79): np.nan}))
    _edit(_mel(root, 7), _with_values({(11, 3): np.inf, (12, 3): -np.inf, (300, 0): np.nan}))
    with open(_mel(root, 8), "ab") as f:  # a valid header, but not the file that was indexed
        f.write(b"\0" * 320)
    grown = _mel(root, 8).stat().st_size
    np.save(root / "mels" / "extra.npy", np.zeros((3, 80), np.float32))
    np.save(root / "tokens" / "odd.npy", np.zeros(3, np.float32))
    have = len(tok_bytes) - 8 - 128  # demo files have numpy's usual 128-byte header
    return {
        str(_mel(root, 0)): ("missing (listed in the manifest)", ""),
        str(_tok(root, 0)): ("", f"no matching mels/{demo_utterance_id(0)}.npy"),
        str(tok): (f"truncated: {have} data bytes, expected {have + 8}",) * 2,
        str(_mel(root, 2)): ("mel dtype <f8 not allowed (little-endian float32 or float16)",) * 2,
        str(_mel(root, 3)): (f"expected rank 2 [frames, n_mels], got shape {rank3.shape}",) * 2,
        str(_mel(root, 4)): (f"expected n_mels=80 in shape [frames, n_mels], got shape {bins40.shape}",) * 2,
        str(_mel(root, 5)): ("Fortran order not supported",) * 2,
        str(_mel(root, 6)): ("2 non-finite values (NaN/Inf): 2 NaN, 0 Inf; first at frame 7",) * 2,
        str(_mel(root, 7)): ("3 non-finite values (NaN/Inf): 1 NaN, 2 Inf; first at frame 11",) * 2,
        str(_mel(root, 8)): (f"changed since index: {grown} bytes, manifest says {grown - 320}; re-run index", ""),
        str(root / "mels" / "extra.npy"): (
            "not in the manifest (training ignores it); also bad: no matching tokens/extra.npy",
            "no matching tokens/extra.npy",
        ),
        str(root / "tokens" / "odd.npy"): (
            "not in the manifest (training ignores it); also bad: no matching mels/odd.npy",
            "no matching mels/odd.npy",
        ),
    }


def _expected(table: dict[str, tuple[str, str]], with_manifest: bool) -> list[VerifyProblem]:
    out = []
    for path, reasons in sorted(table.items()):
        reason = reasons[0 if with_manifest else 1]
        if reason:
            unlisted = with_manifest and reason.startswith("not in the manifest")
            out.append(VerifyProblem(path, reason, fatal=not unlisted))
    return out


def test_clean_cache_has_no_problems(cache: Path) -> None:
    report = verify_cache(cache, 80)
    assert report.problems == () and report.has_manifest
    assert (report.utterances, report.files) == (N, 2 * N)


@pytest.mark.parametrize("with_manifest", [True, False])
def test_every_bad_file_is_reported_once_with_its_reason_sorted_by_path(cache: Path, with_manifest: bool) -> None:
    table = _corrupt(cache)
    if not with_manifest:
        (cache / MANIFEST_NAME).unlink()
    report = verify_cache(cache, 80)
    assert list(report.problems) == _expected(table, with_manifest)
    assert report.has_manifest is with_manifest
    if with_manifest:  # 20 listed utterances x 2 files, plus the 2 unlisted
        assert (report.utterances, report.files, len(report.bad), len(report.warnings)) == (N, 2 * N + 2, 9, 2)
    else:  # ids: 20 + extra + odd; files on disk: 40 - 1 + 2
        assert (report.utterances, report.files, len(report.bad)) == (N + 2, 2 * N + 1, 10)


def test_non_finite_values_are_found_across_chunk_boundaries(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        melfeed.shared.cache.verify, "_CHUNK_BYTES", 4000
    )  # 12.5 frames a chunk: the value is in chunk 8
    frames = np.load(_mel(cache, 6)).shape[0]
    _edit(_mel(cache, 6), _with_values({(99, 5): np.inf, (frames - 1, 79): np.nan}))
    [problem] = verify_cache(cache, 80).problems
    assert problem == VerifyProblem(
        str(_mel(cache, 6)), "2 non-finite values (NaN/Inf): 1 NaN, 1 Inf; first at frame 99"
    )


def test_float16_mels_are_scanned_too(cache: Path) -> None:
    (cache / MANIFEST_NAME).unlink()
    _edit(_mel(cache, 4), lambda m: _with_values({(2, 2): np.inf})(m.astype(np.float16)))
    assert [p.reason for p in verify_cache(cache, 80).problems] == [
        "1 non-finite values (NaN/Inf): 0 NaN, 1 Inf; first at frame 2"
    ]


def test_a_manifest_that_does_not_load_is_bad_and_files_are_checked_by_header(cache: Path) -> None:
    doc = json.loads((cache / MANIFEST_NAME).read_text())
    doc["fingerprint"] = "0" * 16
    (cache / MANIFEST_NAME).write_text(json.dumps(doc))
    _edit(_mel(cache, 3), np.asfortranarray)
    report = verify_cache(cache, 80)
    assert not report.has_manifest
    assert [(p.path, p.reason) for p in report.problems] == [
        (str(cache / MANIFEST_NAME), "fingerprint mismatch (manifest edited?)"),
        (str(_mel(cache, 3)), "Fortran order not supported"),
    ]


def test_missing_or_empty_cache_dir_is_a_cache_error(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="no such cache directory"):
        verify_cache(tmp_path / "nope", 80)
    with pytest.raises(CacheError, match="empty cache"):
        verify_cache(tmp_path, 80)


def _cli(*args: str, progress_s: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "melfeed", "verify-cache", "--cache-dir", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MELFEED_PROGRESS_S": progress_s},
    )


def test_cli_progress_lines_go_to_stderr_at_the_interval(cache: Path) -> None:
    proc = _cli(str(cache), progress_s="0")  # not a terminal: one plain line per utterance, then the final one
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("verify-cache: ")]  # logs share stderr
    assert [line.split(" ")[1] for line in lines] == [f"{d}/{N}" for d in range(1, N + 1)] + [f"{N}/{N}"]
    assert all(" utterances/s, eta " in line for line in lines)
    assert "\r" not in proc.stderr
    assert proc.stdout == f"verified {N} utterances ({2 * N} files): 0 bad\n"
    quiet = _cli(str(cache))  # default 5 s: a small cache gets only the final line
    quiet_lines = [line for line in quiet.stderr.splitlines() if line.startswith("verify-cache: ")]
    assert len(quiet_lines) == 1 and quiet_lines[0].startswith(f"verify-cache: {N}/{N} (100%) "), quiet.stderr


def test_cli_exit_codes_and_output(cache: Path, tmp_path: Path) -> None:
    clean = _cli(str(cache))
    assert (clean.returncode, clean.stdout) == (0, f"verified {N} utterances ({2 * N} files): 0 bad\n")
    table = _corrupt(cache)
    bad = _cli(str(cache))
    assert bad.returncode == 1
    lines = [f"{'bad' if p.fatal else 'warning'}: {p.path}: {p.reason}" for p in _expected(table, True)]
    summary = f"verified {N} utterances ({2 * N + 2} files): 9 bad, 2 not in the manifest"
    assert bad.stdout.splitlines() == lines + [summary]
    missing = _cli(str(tmp_path / "nope"))
    assert missing.returncode == 78
    assert missing.stderr.strip().splitlines() == [
        f"melfeed verify-cache: {tmp_path / 'nope'}: no such cache directory"
    ]


def test_unlisted_pairs_are_warnings_saying_whether_index_could_use_them(cache: Path) -> None:
    for uid, tokens in (("new", np.ones(2, np.int32)), ("wrong", np.ones(2, np.float32))):
        np.save(cache / "mels" / f"{uid}.npy", np.zeros((4, 80), np.float32))
        np.save(cache / "tokens" / f"{uid}.npy", tokens)
    report = verify_cache(cache, 80)
    assert report.bad == () and (report.utterances, report.files) == (N, 2 * N + 4)
    fine = "not in the manifest (training ignores it); re-run index to use it"
    assert [(p.path, p.reason) for p in report.warnings] == [
        (str(cache / "mels" / "new.npy"), fine),
        (str(cache / "mels" / "wrong.npy"), fine),
        (str(cache / "tokens" / "new.npy"), fine),
        (
            str(cache / "tokens" / "wrong.npy"),
            "not in the manifest (training ignores it); also bad: token dtype <f4 not allowed (little-endian int32)",
        ),
    ]


def test_a_same_size_rewrite_that_index_would_accept_is_still_a_changed_file(cache: Path) -> None:
    """Twice the frames as float16: same bytes, a valid mel, but not what the manifest's row describes."""
    mel = np.load(_mel(cache, 5))
    np.save(_mel(cache, 5), np.concatenate([mel, mel]).astype(np.float16))
    [problem] = verify_cache(cache, 80).problems
    frames = mel.shape[0]
    assert problem == VerifyProblem(
        str(_mel(cache, 5)),
        (
            f"changed since index: header says shape/dtype/offset (({2 * frames}, 80), 'float16', 128), "
            f"manifest (({frames}, 80), 'float32', 128); re-run index"
        ),
    )


def test_token_ids_negative_outside_the_indexed_range_or_beyond_vocab_size_are_bad(cache: Path) -> None:
    from melfeed.shared.cache.manifest import load_manifest

    lo, hi = load_manifest(cache).token_range or (0, 0)
    _edit(_tok(cache, 3), lambda t: np.where(np.arange(t.size) == 2, -5, t).astype(np.int32))
    _edit(_tok(cache, 4), lambda t: np.where(np.arange(t.size) == 0, hi + 1, t).astype(np.int32))  # same size
    assert [(p.path, p.reason) for p in verify_cache(cache, 80).problems] == [
        (str(_tok(cache, 3)), "token id -5 at position 2: ids must be >= 0"),
        (
            str(_tok(cache, 4)),
            f"changed since index: token ids {lo}..{hi + 1}, outside the {lo}..{hi} the manifest records; re-run index",
        ),
    ]
    (cache / MANIFEST_NAME).unlink()  # by header: a negative id is still bad, the range unknown
    assert [p.path for p in verify_cache(cache, 80).problems] == [str(_tok(cache, 3))]
    holding = sorted(str(_tok(cache, i)) for i in range(N) if i != 3 and np.load(_tok(cache, i)).max() >= hi)
    flagged = [(p.path, p.reason) for p in verify_cache(cache, 80, vocab_size=hi).problems]
    assert holding and [f for f in flagged if f[0] != str(_tok(cache, 3))] == [
        (path, f"token id {int(np.load(path).max())} >= --vocab-size {hi}") for path in holding
    ]


def test_the_vocab_size_flag_is_parsed_and_bounded_as_the_configs() -> None:
    import argparse

    from melfeed.shared.cache.commands import main_verify_cache
    from melfeed.shared.errors import ConfigError
    from melfeed.shared.service.cli import build_parser

    assert build_parser().parse_args(["verify-cache", "--cache-dir", "c", "--vocab-size", "64"]).vocab_size == 64
    with pytest.raises(ConfigError) as info:
        main_verify_cache(argparse.Namespace(cache_dir="c", n_mels=80, vocab_size=1))
    assert str(info.value) == (
        "--vocab-size: must be in 2..2147483647 (token ids below it, as the config's model.vocab_size), got 1"
    )
