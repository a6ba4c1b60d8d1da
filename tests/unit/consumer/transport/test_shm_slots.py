"""Shared-memory slot files: create, retire (fencing), unlink on close, stale cleanup, fallback."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from melfeed.consumer.flow.ring import BatchRing, slot_nbytes_for
from melfeed.consumer.transport.shm_slots import ShmSlots, clean_stale, is_tmpfs, open_shm_slots, resolve_shm_dir
from melfeed.shared.wire.buckets import Bucket

BUCKETS = (Bucket(0, 4, 16, 5, 80), Bucket(1, 2, 40, 9, 80))
EPOCH = 77


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_every_slot_is_its_own_reserved_file_and_ring_views_are_aligned(tmp_path: Path) -> None:
    nbytes = slot_nbytes_for(BUCKETS)
    shm = ShmSlots(tmp_path, 3, nbytes, EPOCH)
    pid = os.getpid()
    assert _files(tmp_path) == [f"melfeed-{pid}-{EPOCH}-s{i}-g0" for i in range(3)]
    for i in range(3):
        st = (tmp_path / shm.name(i)).stat()
        assert st.st_size == nbytes and st.st_blocks * 512 >= nbytes  # pages reserved, not sparse
        assert shm.buffer(i).ctypes.data % 4096 == 0
    ring = BatchRing(3, BUCKETS, memory=shm)
    ring.views(1, 1)["mel"][:] = 2.5
    on_disk = np.fromfile(tmp_path / shm.name(1), dtype=np.uint8)  # MAP_SHARED: the file is the slot
    assert (on_disk[:4].view(np.float32) == 2.5).all()
    assert all(a.ctypes.data % 64 == 0 for a in ring.views(2, 0).values())
    shm.close()


def test_retire_orphans_the_file_and_maps_a_new_generation(tmp_path: Path) -> None:
    shm = ShmSlots(tmp_path, 3, slot_nbytes_for(BUCKETS), EPOCH)
    zombie = np.memmap(tmp_path / shm.name(0), dtype=np.uint8, mode="r+")  # a producer's mapping
    old = shm.name(0)
    shm.retire(0)
    assert shm.generation(0) == 1 and shm.name(0).endswith("-s0-g1") and shm.retired == 1
    assert old not in _files(tmp_path) and shm.name(0) in _files(tmp_path)
    zombie[:] = 0xFF  # the zombie wakes and writes
    assert not shm.buffer(0).any()  # ... into orphaned memory only
    assert shm.is_shared(0)
    shm.close()


def test_close_unlinks_every_file_and_is_idempotent(tmp_path: Path) -> None:
    shm = ShmSlots(tmp_path, 4, slot_nbytes_for(BUCKETS), EPOCH)
    shm.retire(2)
    shm.close()
    shm.close()
    assert _files(tmp_path) == []


def test_stale_files_of_dead_or_non_python_pids_are_removed_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    sleeper = subprocess.Popen(["sleep", "30"])  # alive, but not a python process: a recycled pid
    try:
        for pid in (dead_pid, sleeper.pid):
            (tmp_path / f"melfeed-{pid}-5-s0-g0").write_bytes(b"x" * 100)
        (tmp_path / f"melfeed-{os.getpid()}-5-s0-g0").write_bytes(b"x")  # a live consumer's
        (tmp_path / "melfeed.sock").write_bytes(b"")  # not a slot file
        assert clean_stale(tmp_path) == (2, 200)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _files(tmp_path) == sorted([f"melfeed-{os.getpid()}-5-s0-g0", "melfeed.sock"])


def test_too_little_free_space_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = os.statvfs(tmp_path)
    small = os.statvfs_result((real.f_bsize, 4096, 100, 10, 10, *real[5:]))  # 40 kB free
    monkeypatch.setattr(os, "statvfs", lambda path: small)
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.transport.shm_slots"):
        assert open_shm_slots(tmp_path, 3, slot_nbytes_for(BUCKETS), EPOCH) is None
    [record] = caplog.records
    need = 3 * slot_nbytes_for(BUCKETS) + (1 << 20)
    assert str(tmp_path) in record.message and f"need {need} bytes, 40960 free" in record.message
    assert _files(tmp_path) == []


def test_enospc_while_reserving_falls_back_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the second file does not fit
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.transport.shm_slots"):
        assert open_shm_slots(tmp_path, 3, slot_nbytes_for(BUCKETS), EPOCH) is None
    assert "no space" in caplog.records[-1].message and str(tmp_path) in caplog.records[-1].message
    assert _files(tmp_path) == []


def test_default_dir_is_the_socket_dir_on_tmpfs_else_dev_shm(tmp_path: Path) -> None:
    assert resolve_shm_dir("/x/y", "ipc:///run/m.sock") == Path("/x/y")
    assert resolve_shm_dir(None, f"ipc://{tmp_path}/m.sock") == (tmp_path if is_tmpfs(tmp_path) else Path("/dev/shm"))
    if is_tmpfs(Path("/dev/shm")):
        assert resolve_shm_dir(None, "ipc:///dev/shm/m.sock") == Path("/dev/shm")
    assert not is_tmpfs(tmp_path / "missing")


def test_when_shared_memory_was_asked_for_a_missing_dir_is_refused_not_replaced_by_payload_frames(
    tmp_path: Path,
) -> None:
    from melfeed.shared.errors import ConfigError

    missing = tmp_path / "no-such-dir"
    assert open_shm_slots(missing, 3, slot_nbytes_for(BUCKETS), EPOCH) is None  # mode auto: falls back
    with pytest.raises(
        ConfigError, match=f"transport.shm_dir: shared-memory dir {missing} unusable .*transport.mode is shm"
    ):
        open_shm_slots(missing, 3, slot_nbytes_for(BUCKETS), EPOCH, required=True)


def test_clean_stale_for_one_pid_removes_only_that_dead_consumers_files(tmp_path: Path) -> None:
    pids = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        )
        pids.append(int(proc.stdout))
    for pid in pids:
        (tmp_path / f"melfeed-{pid}-5-s0-g0").write_bytes(b"x" * 10)
    assert clean_stale(tmp_path, pids[0]) == (1, 10)  # a parent cleaning up after its child
    assert _files(tmp_path) == [f"melfeed-{pids[1]}-5-s0-g0"]  # another dead consumer's: the sweep's job
    (tmp_path / f"melfeed-{os.getpid()}-5-s0-g0").write_bytes(b"x")
    assert clean_stale(tmp_path, os.getpid()) == (0, 0)  # never a live consumer's
