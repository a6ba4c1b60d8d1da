"""Tests for producer.open_files.OpenFiles and the reader's use of it: bound, staleness, close, finite once."""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import melfeed.producer.open_files as open_files_mod
from melfeed.producer.open_files import OpenFiles, descriptor_budget
from melfeed.producer.reader import CacheReader
from melfeed.shared.cache.filekind import open_regular
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.errors import CacheError

N_MELS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    paths = []
    for i in range(4):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(bytes([i]) * 16)
        paths.append(str(p))
    return paths


def test_at_most_capacity_descriptors_stay_open_least_recently_used_closes_first(files: list[str]) -> None:
    cache = OpenFiles(2)
    a = cache.acquire("a", files[0])
    b = cache.acquire("b", files[1])
    assert cache.acquire("a", files[0]) is a  # a hit: no second open, a is now the newest
    c = cache.acquire("c", files[2])
    assert len(cache) == 2 and cache.opens == 3
    assert not _is_open(b.fd) and _is_open(a.fd) and _is_open(c.fd)  # b was the least recently used
    cache.acquire("b", files[1])
    assert cache.opens == 4
    cache.close()
    cache.close()  # idempotent
    assert len(cache) == 0 and not _is_open(a.fd)


def test_capacity_zero_closes_every_file_after_its_read(files: list[str]) -> None:
    cache = OpenFiles(0)
    f = cache.acquire("a", files[0])
    assert _is_open(f.fd)
    fd = f.fd
    cache.release("a", f)
    assert len(cache) == 0 and f.fd == -1 and not _is_open(fd)


def test_a_failed_read_gives_its_descriptor_back(files: list[str]) -> None:
    cache = OpenFiles(8)
    f = cache.acquire("a", files[0])
    fd = f.fd
    cache.release("a", f, ok=False)
    assert len(cache) == 0 and not _is_open(fd)


def test_a_file_replaced_on_disk_is_reopened_once_revalidate_s_passed(files: list[str]) -> None:
    clock = Clock()
    cache = OpenFiles(8, revalidate_s=5.0, clock=clock)
    old = cache.acquire("a", files[0])
    tmp = files[0] + ".new"
    Path(tmp).write_bytes(b"\xff" * 16)
    os.replace(tmp, files[0])  # a new inode under the same name
    clock.now += 4.9
    assert cache.acquire("a", files[0]) is old  # within the window: the checked old inode
    assert os.pread(old.fd, 1, 0) == b"\x00"
    clock.now += 0.2
    new = cache.acquire("a", files[0])
    assert new is not old and os.pread(new.fd, 1, 0) == b"\xff" and cache.opens == 2
    clock.now += 10.0
    assert cache.acquire("a", files[0]) is new  # unchanged: confirmed by stat, kept
    assert cache.opens == 2


def test_a_file_removed_is_reopened_and_reported_missing(files: list[str]) -> None:
    clock = Clock()
    cache = OpenFiles(8, revalidate_s=1.0, clock=clock)
    cache.acquire("a", files[0])
    os.unlink(files[0])
    clock.now += 2.0
    with pytest.raises(CacheError, match="missing"):
        cache.acquire("a", files[0])
    assert len(cache) == 0


def test_out_of_descriptors_gives_half_the_cache_back_and_tries_once_more(
    files: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = OpenFiles(8)
    kept = [cache.acquire(k, p) for k, p in zip("abc", files)]
    real = open_regular
    calls = []

    def emfile_once(path: str) -> tuple[int, os.stat_result]:
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(path)

    monkeypatch.setattr(open_files_mod, "open_regular", emfile_once)
    d = cache.acquire("d", files[3])
    assert len(calls) == 2 and _is_open(d.fd)
    assert [_is_open(f.fd) for f in kept] == [False, False, True]  # the two oldest went
    cache.close()


def test_the_budget_is_held_to_half_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert descriptor_budget(4096) == 512
    assert descriptor_budget(100) == 100
    assert OpenFiles(4096).capacity == 512


@pytest.fixture
def manifest(tmp_path: Path) -> Manifest:
    rng = np.random.default_rng(1)
    (tmp_path / "mels").mkdir()
    (tmp_path / "tokens").mkdir()
    for uid, frames in (("a", 6), ("b", 9)):
        np.save(tmp_path / "mels" / f"{uid}.npy", rng.normal(size=(frames, N_MELS)).astype("<f4"))
        np.save(tmp_path / "tokens" / f"{uid}.npy", rng.integers(1, 9, size=3, dtype=np.int32))
    built, problems = build_manifest(tmp_path, N_MELS)
    assert problems == []
    return built


def test_the_reader_keeps_files_open_and_checks_values_once_per_file(
    manifest: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = CacheReader(manifest)
    checks: list[str] = []
    real = reader._check_finite

    def counted(path: str, rows: Any) -> None:
        checks.append(path)
        real(path, rows)

    monkeypatch.setattr(reader, "_check_finite", counted)
    for _ in range(3):
        for i in (0, 1):
            reader.read_mel_into(i, np.empty((12, N_MELS), np.float32))
            reader.read_tokens_into(i, np.empty(4, np.int32))
    assert reader._files.opens == 4 and len(reader._files) == 4
    assert checks == [str(manifest.mel_path(0)), str(manifest.mel_path(1))]
    reader.read_mel_into(1, np.empty((4, N_MELS), np.float32))  # fewer frames: already checked
    assert len(checks) == 2
    reader.close()
    assert len(reader._files) == 0
    assert reader.read_mel_into(0, np.empty((12, N_MELS), np.float32)) == 6  # usable after close


def test_a_mel_replaced_with_nan_is_refused_once_its_identity_is_checked_again(manifest: Manifest) -> None:
    reader = CacheReader(manifest, revalidate_s=0.0)
    reader.read_mel_into(0, np.empty((12, N_MELS), np.float32))
    path = manifest.mel_path(0)
    bad = np.load(path)
    bad[2, 1] = np.nan
    np.save(path.with_name("new.npy"), bad)  # same size and header, a new inode
    os.replace(path.with_name("new.npy"), path)
    with pytest.raises(CacheError, match="non-finite values .* first at frame 2;"):
        reader.read_mel_into(0, np.empty((12, N_MELS), np.float32))
    with pytest.raises(CacheError, match="non-finite"):  # and on every read after: deterministic
        reader.read_mel_into(0, np.empty((12, N_MELS), np.float32))


def test_open_files_zero_reads_the_same_rows_and_keeps_nothing_open(manifest: Manifest) -> None:
    kept, fresh = CacheReader(manifest), CacheReader(manifest, open_files=0)
    for i in (0, 1):
        a, b = np.full((12, N_MELS), 7, np.float32), np.full((12, N_MELS), 9, np.float32)
        assert kept.read_mel_into(i, a) == fresh.read_mel_into(i, b)
        np.testing.assert_array_equal(a, b)
    assert len(fresh._files) == 0 and fresh._files.opens == 2


def test_a_read_that_fails_drops_its_descriptor_so_the_next_read_opens_and_checks_again(manifest: Manifest) -> None:
    reader = CacheReader(manifest)
    reader.read_tokens_into(0, np.empty(4, np.int32))
    assert len(reader._files) == 1
    path = manifest.tokens_path(0)
    np.save(path, np.load(path).view("<f4"))  # rewritten in place: same size, other dtype
    for _ in range(2):
        with pytest.raises(CacheError, match="re-run index"):
            reader.read_tokens_into(0, np.empty(4, np.int32))
        assert len(reader._files) == 0
    assert reader._files.opens == 2  # the failed kept one, then a fresh open
