"""Tests for melfeed.producer.reader.CacheReader: exact rows, truncation, zeroed tail, changed files."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from melfeed.producer.reader import CacheReader
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.errors import CacheError

N_MELS = 6


def _save_odd_header(path: Path, arr: np.ndarray, header_bytes: int) -> None:
    """Save ``arr`` (v1.0) with a header of exactly ``header_bytes``, not numpy's usual 118."""
    text = f"{{'descr': '{arr.dtype.str}', 'fortran_order': False, 'shape': {arr.shape}, }}"
    body = text.encode() + b" " * (header_bytes - len(text) - 1) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + arr.tobytes())


@pytest.fixture
def manifest(tmp_path: Path) -> Manifest:
    rng = np.random.default_rng(0)
    (tmp_path / "mels").mkdir()
    (tmp_path / "tokens").mkdir()
    specs = {"a": (9, 4, "<f4"), "b": (5, 7, "<f2"), "c": (12, 3, "<f4"), "d": (7, 5, "<f4")}
    for uid, (frames, tokens, dtype) in specs.items():
        mel = rng.normal(size=(frames, N_MELS)).astype(dtype)
        tok = rng.integers(1, 50, size=tokens, dtype=np.int32)
        if uid == "d":  # headers of unusual length must be honoured, not assumed to be 128
            _save_odd_header(tmp_path / "mels" / "d.npy", mel, 203)
            _save_odd_header(tmp_path / "tokens" / "d.npy", tok, 77)
        else:
            np.save(tmp_path / "mels" / f"{uid}.npy", mel)
            np.save(tmp_path / "tokens" / f"{uid}.npy", tok)
    built, problems = build_manifest(tmp_path, N_MELS)
    assert problems == []
    return built


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_reads_equal_np_load_with_zeroed_tail(manifest: Manifest, index: int) -> None:
    reader = CacheReader(manifest)
    batch = np.full((2, 16, N_MELS), np.nan, dtype=np.float32)
    tokens = np.full((2, 10), -1, dtype=np.int32)
    n = reader.read_mel_into(index, batch[1])
    k = reader.read_tokens_into(index, tokens[1])
    expected_mel = np.load(manifest.mel_path(index)).astype(np.float32)
    expected_tok = np.load(manifest.tokens_path(index))
    assert n == len(expected_mel) and k == len(expected_tok)
    np.testing.assert_array_equal(batch[1, :n], expected_mel)
    assert not batch[1, n:].any()  # zeros, and no NaN left
    np.testing.assert_array_equal(tokens[1, :k], expected_tok)
    assert not tokens[1, k:].any()
    assert np.isnan(batch[0]).all() and (tokens[0] == -1).all()  # other rows untouched


@pytest.mark.parametrize("index", [0, 1])  # float32 and float16
def test_truncates_to_row_length(manifest: Manifest, index: int) -> None:
    reader = CacheReader(manifest)
    row = np.full((3, N_MELS), np.nan, dtype=np.float32)
    tok = np.full(2, -1, dtype=np.int32)
    assert reader.read_mel_into(index, row) == 3
    assert reader.read_tokens_into(index, tok) == 2
    np.testing.assert_array_equal(row, np.load(manifest.mel_path(index))[:3].astype(np.float32))
    np.testing.assert_array_equal(tok, np.load(manifest.tokens_path(index))[:2])


def test_float16_scratch_is_reused_across_sizes(manifest: Manifest) -> None:
    reader = CacheReader(manifest)
    small = np.empty((2, N_MELS), dtype=np.float32)
    big = np.empty((16, N_MELS), dtype=np.float32)
    reader.read_mel_into(1, small)
    assert reader.read_mel_into(1, big) == 5
    np.testing.assert_array_equal(big[:5], np.load(manifest.mel_path(1)).astype(np.float32))


def test_paths_agree_with_manifest(manifest: Manifest) -> None:
    reader = CacheReader(manifest)
    for i in range(len(manifest)):
        assert reader._mel_paths[i] == str(manifest.mel_path(i))
        assert reader._tok_paths[i] == str(manifest.tokens_path(i))


def test_file_changed_since_index_is_refused(manifest: Manifest) -> None:
    path = manifest.mel_path(2)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x00" * 4)
    with pytest.raises(CacheError) as info:
        CacheReader(manifest).read_mel_into(2, np.empty((16, N_MELS), np.float32))
    assert str(info.value) == (
        f"{path}: file changed since index (size {size + 4}, manifest says {size}); re-run index"
    )


def test_missing_file(manifest: Manifest) -> None:
    manifest.tokens_path(0).unlink()
    with pytest.raises(CacheError) as info:
        CacheReader(manifest).read_tokens_into(0, np.empty(8, np.int32))
    assert str(info.value) == f"{manifest.tokens_path(0)}: missing"


def _not_a_file(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "character device":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink loop":  # a -> b -> a
        path.with_name("b").symlink_to(path.name)
        path.symlink_to("b")
    else:
        path.symlink_to(path.with_name("gone"))


@pytest.mark.timeout(20)  # a blocking open of the FIFO (or reading /dev/zero) fails here instead of hanging
@pytest.mark.parametrize("kind", ["fifo", "character device", "directory", "symlink loop", "dangling symlink"])
def test_an_entry_that_is_not_a_regular_file_is_a_bad_file_never_a_blocked_read(manifest: Manifest, kind: str) -> None:
    reader = CacheReader(manifest)
    _not_a_file(manifest.mel_path(2), kind)
    _not_a_file(manifest.tokens_path(1), kind)
    with pytest.raises(CacheError) as info:
        reader.read_mel_into(2, np.empty((16, N_MELS), np.float32))
    assert type(info.value) is CacheError  # a bad file (quarantined), never TransientReadError
    assert str(info.value).startswith(f"{manifest.mel_path(2)}: not a regular file ({kind}")
    with pytest.raises(CacheError, match=re.escape(f": not a regular file ({kind}")):
        reader.read_tokens_into(1, np.empty(8, np.int32))
    assert reader.read_mel_into(0, np.empty((16, N_MELS), np.float32)) == 9  # the others still read


def test_short_read(manifest: Manifest) -> None:
    """A manifest claiming more frames than the file holds (same size) fails loudly."""
    utt = manifest.utterances[0]
    lying = Manifest(manifest.cache_dir, N_MELS, (utt._replace(frames=utt.frames + 3),))
    with pytest.raises(CacheError, match="short read") as info:
        CacheReader(lying).read_mel_into(0, np.empty((16, N_MELS), np.float32))
    assert info.value.path == str(manifest.mel_path(0))


@pytest.mark.parametrize(
    "dst",
    [
        np.empty((16, N_MELS), np.float64),
        np.empty((16, N_MELS + 1), np.float32),
        np.empty((N_MELS, 16), np.float32).T,
        np.empty(16, np.float32),
    ],
)
def test_rejects_wrong_destination(manifest: Manifest, dst: np.ndarray) -> None:
    with pytest.raises(ValueError):
        CacheReader(manifest).read_mel_into(0, dst)


def test_rejects_read_only_token_row(manifest: Manifest) -> None:
    dst = np.zeros(8, np.int32)
    dst.setflags(write=False)
    with pytest.raises(ValueError):
        CacheReader(manifest).read_tokens_into(0, dst)


def test_zero_length_rows_read_nothing(manifest: Manifest) -> None:
    reader = CacheReader(manifest)
    assert reader.read_mel_into(0, np.empty((0, N_MELS), np.float32)) == 0
    assert reader.read_tokens_into(0, np.empty(0, np.int32)) == 0


def _poke(path: Path, frame: int, col: int, value: float) -> None:
    """Overwrite one mel value in place: same size and header, so the manifest still matches."""
    mel = np.load(path)
    mel[frame, col] = value
    np.save(path, mel)


@pytest.mark.parametrize("index", [0, 1])  # float32 read in place, float16 widened from scratch
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_naming_the_file_and_first_frame(
    manifest: Manifest, index: int, value: float
) -> None:
    path = manifest.mel_path(index)
    _poke(path, 3, 2, value)
    _poke(path, 4, 0, value)
    with pytest.raises(CacheError) as info:
        CacheReader(manifest).read_mel_into(index, np.empty((16, N_MELS), np.float32))
    assert info.value.path == str(path)
    assert info.value.reason.startswith("2 non-finite values (NaN/Inf) in the first ")
    assert "first at frame 3;" in info.value.reason


def test_non_finite_values_past_the_row_length_are_never_read(manifest: Manifest) -> None:
    """The decision depends only on the bytes a row takes: the same for every producer."""
    _poke(manifest.mel_path(0), 8, 1, np.nan)  # utterance 0 has 9 frames
    reader = CacheReader(manifest)
    row = np.empty((8, N_MELS), np.float32)
    assert reader.read_mel_into(0, row) == 8
    assert np.isfinite(row).all()
    with pytest.raises(CacheError, match="first at frame 8;"):
        reader.read_mel_into(0, np.empty((16, N_MELS), np.float32))


def test_running_out_of_fds_is_transient_not_a_bad_file(manifest: Manifest, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from melfeed.producer.reader import TransientReadError

    def no_fds(*args: object) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "open", no_fds)
    with pytest.raises(TransientReadError, match="cannot open"):
        CacheReader(manifest).read_tokens_into(0, np.empty(8, np.int32))


@pytest.mark.parametrize(
    "rewrite, says",
    [
        (np.asfortranarray, "Fortran order not supported"),
        (lambda m: m[:, :, None], f"header says shape (9, {N_MELS}, 1) dtype <f4, manifest says (9, {N_MELS}) <f4"),
        (lambda m: m.view("<i4"), "dtype <i4, manifest says"),
        (lambda m: m.astype(">f4"), "dtype >f4, manifest says"),
    ],
)
def test_same_size_rewrites_are_caught_by_the_header(
    manifest: Manifest, rewrite: Callable[[np.ndarray], np.ndarray], says: str
) -> None:
    """Size unchanged, so only the header shows the data cannot be read as indexed."""
    path = manifest.mel_path(0)
    size = path.stat().st_size
    reader = CacheReader(manifest)
    reader.read_mel_into(0, np.empty((16, N_MELS), np.float32))  # the checked header is remembered
    np.save(path, rewrite(np.load(path)))
    assert path.stat().st_size == size
    with pytest.raises(CacheError, match="re-run index") as info:
        reader.read_mel_into(0, np.empty((16, N_MELS), np.float32))
    assert info.value.path == str(path) and says in info.value.reason
    assert info.value.reason.startswith("file changed since index (")


@pytest.mark.parametrize("capacity", [16, 4])  # every file fits / long files cut
def test_the_row_fast_path_writes_what_read_into_writes(manifest: Manifest, capacity: int) -> None:
    from melfeed.producer.batch_rows import zero_bytes

    reader = CacheReader(manifest)
    zeros = zero_bytes(capacity * N_MELS * 4)
    fast_mel = np.full((6, capacity, N_MELS), np.nan, dtype=np.float32)  # stale bytes everywhere
    fast_tok = np.full((6, capacity), -1, dtype=np.int32)
    mel_rows, tok_rows = reader.mel_rows(fast_mel, zeros), reader.token_rows(fast_tok, zeros)
    for row, index in enumerate([0, 1, 2, 3]):  # float16 "b" goes through the cast
        want_mel, want_tok = np.zeros((capacity, N_MELS), np.float32), np.zeros(capacity, np.int32)
        assert reader.read_mel_row(index, mel_rows, row + 1) == reader.read_mel_into(index, want_mel)
        assert reader.read_tokens_row(index, tok_rows, row + 1) == reader.read_tokens_into(index, want_tok)
        assert fast_mel[row + 1].tobytes() == want_mel.tobytes() and fast_tok[row + 1].tobytes() == want_tok.tobytes()
    assert np.isnan(fast_mel[[0, 5]]).all() and (fast_tok[[0, 5]] == -1).all()  # other rows untouched


def test_row_views_refuse_arrays_the_reader_cannot_fill(manifest: Manifest) -> None:
    from melfeed.producer.batch_rows import zero_bytes

    reader, zeros = CacheReader(manifest), zero_bytes(1024)
    with pytest.raises(ValueError, match="mel must be"):
        reader.mel_rows(np.zeros((2, 4, N_MELS + 1), np.float32), zeros)
    with pytest.raises(ValueError, match="mel must be"):
        reader.mel_rows(np.zeros((2, 4, N_MELS), np.float64), zeros)
    with pytest.raises(ValueError, match="tokens must be"):
        reader.token_rows(np.zeros((2, 4), np.int64), zeros)
    with pytest.raises(ValueError, match="C-contiguous"):
        reader.token_rows(np.zeros((4, 2), np.int32).T, zeros)


def test_token_ids_rewritten_beyond_the_recorded_range_are_refused_naming_the_file(manifest: Manifest) -> None:
    """Same size and header: only the ids tell; the consumer's start checked model.vocab_size against the range."""
    assert manifest.token_range is not None
    path = manifest.tokens_path(0)
    np.save(path, np.load(path) * 0 + manifest.token_range[1] + 1)
    with pytest.raises(CacheError, match="outside the .* the manifest records") as info:
        CacheReader(manifest).read_tokens_into(0, np.empty(16, np.int32))
    assert info.value.path == str(path)
    assert CacheReader(manifest).read_tokens_into(2, np.empty(16, np.int32)) == 3  # an unchanged file reads
