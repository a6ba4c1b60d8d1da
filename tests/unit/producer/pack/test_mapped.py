"""A mapped pack's bus error kills one producer once: its fault record makes the next start read with ``preadv``.

Real processes and real signals (``producer/pack/mapped.py``): a child reads the packed cache through
its mapping with a fault record in a private directory; a pack cut in place under a mapped read is a
real SIGBUS (the once-per-batch size check stubbed out, as in the half millisecond it cannot cover);
a SIGBUS delivered to a child whose pack is intact stands for a disk block that cannot be read. The
next ``open_pack_reader`` of the same pack reads it with ``preadv`` and says why; a new pack, a
SIGKILL's record and a clean close each leave no record behind.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from melfeed.producer.pack.reader import PackReader, open_pack_reader
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.cache.pack_format import DATA_OFFSET, pack_path
from melfeed.shared.cache.pack_write import write_pack

N_MELS = 8
_WAIT_S = 120.0
_REPO = Path(__file__).resolve().parents[4]

# The child: map the pack with a fault record in argv[2], say "ready", then either wait (to be
# signalled) or cut the pack in place and build a batch through the mapping ("cut").
_CHILD = """
import sys
from melfeed.producer.batcher import BatchAssembler
from melfeed.producer.pack.reader import open_pack_reader
from melfeed.producer.reader import CacheReader
from melfeed.shared.cache.manifest import load_manifest
from melfeed.shared.wire.buckets import build_buckets
from melfeed.shared.config import BucketConfig
from pathlib import Path
manifest = load_manifest(sys.argv[1])
pack = open_pack_reader(manifest, "auto", "float32", fault_dir=Path(sys.argv[2]))
assert pack is not None and pack.mode == "mapped", pack
buckets = build_buckets(manifest.frames, manifest.token_counts, manifest.n_mels, BucketConfig(num_buckets=1,
                        batch_size=4), manifest.schema)
assembler = BatchAssembler(CacheReader(manifest), buckets, pack=pack)
assembler.build(0, 0, [0, 1, 2, 3])
print("ready", flush=True)
if sys.argv[3] == "cut":
    pack.check_intact = lambda: None
    import os
    os.truncate(pack.path, int(sys.argv[4]))
    assembler.build(1, 0, [3, 2, 1, 0])
    print("no bus error", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def cache(tmp_path: Path) -> Manifest:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6, n_mels=N_MELS)
    assert write_pack(manifest, "float32").bad == {}
    return manifest


def _child(cache: Manifest, fault_dir: Path, *how: str) -> subprocess.Popen[str]:
    """A child that mapped the pack and built one batch (its "ready" line read within a bounded wait)."""
    env = {**os.environ, "PYTHONPATH": str(_REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(cache.cache_dir), str(fault_dir), *how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], _WAIT_S)
    line = proc.stdout.readline() if ready else ""
    if line != "ready\n":
        proc.kill()
        pytest.fail(f"child not ready: {line!r} {proc.communicate(timeout=_WAIT_S)[1][-2000:]}")
    return proc


def _record_of(fault_dir: Path, pid: int) -> str:
    return (fault_dir / f"pack-fault-{pid}.log").read_text(encoding="utf-8", errors="replace")


def test_a_pack_cut_under_a_mapped_read_is_a_real_sigbus_recorded_and_a_new_pack_clears_the_record(
    cache: Manifest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fault_dir = tmp_path / "run"
    fault_dir.mkdir(mode=0o700)
    proc = _child(cache, fault_dir, "cut", str(DATA_OFFSET + 16))
    out, err = proc.communicate(timeout=_WAIT_S)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, out, err[-2000:])
    record = _record_of(fault_dir, proc.pid)
    assert "Fatal Python error: Bus error" in record and "reader.py" in record, record
    assert str(pack_path(cache.cache_dir, "float32")) in record.splitlines()[0]
    with caplog.at_level(logging.WARNING, logger="melfeed.producer.pack.reader"):
        assert open_pack_reader(cache, "auto", "float32", fault_dir=fault_dir) is None  # cut: refused
    assert "damaged" in caplog.text
    write_pack(cache, "float32")  # a new pack: another inode
    reader = open_pack_reader(cache, "auto", "float32", fault_dir=fault_dir)
    assert isinstance(reader, PackReader) and reader.mode == "mapped"
    assert sorted(os.listdir(fault_dir)) == [f"pack-fault-{os.getpid()}.log"]  # the old record swept, ours
    reader.close()
    assert os.listdir(fault_dir) == []


def test_a_bus_error_on_an_intact_pack_makes_later_starts_read_it_with_preadv_and_say_why(
    cache: Manifest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fault_dir = tmp_path / "run"
    fault_dir.mkdir(mode=0o700)
    killed = _child(cache, fault_dir, "wait")  # a SIGKILL leaves a record with no bus error
    killed.kill()
    killed.communicate(timeout=_WAIT_S)
    assert "Bus error" not in _record_of(fault_dir, killed.pid)
    bus = _child(cache, fault_dir, "wait")  # its start swept the SIGKILL's record
    assert not (fault_dir / f"pack-fault-{killed.pid}.log").exists()
    segv = _child(cache, fault_dir, "wait")  # another fatal signal: reported once, then swept
    segv.send_signal(signal.SIGSEGV)
    segv.communicate(timeout=_WAIT_S)
    assert "Fatal Python error: Segmentation fault" in _record_of(fault_dir, segv.pid)
    bus.send_signal(signal.SIGBUS)  # as a disk block that cannot be read would
    bus.communicate(timeout=_WAIT_S)
    assert bus.returncode == -signal.SIGBUS
    for start in range(2):  # every later start, not only the next
        with caplog.at_level(logging.INFO, logger="melfeed.producer.pack.reader"):
            reader = open_pack_reader(cache, "auto", "float32", fault_dir=fault_dir)
        assert isinstance(reader, PackReader) and reader.mode == "preadv"
        warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if start == 0:  # the SIGSEGV's report, once
            assert warning[0] == f"producer pid {segv.pid} died: Fatal Python error: Segmentation fault", warning
            warning = warning[1:]
        assert len(warning) == 1 and "died of a bus error" in warning[0], warning
        assert f"pack-fault-{bus.pid}.log" in warning[0]
        assert sorted(os.listdir(fault_dir)) == [f"pack-fault-{bus.pid}.log"]  # the SIGSEGV's swept
        reader.close()
        caplog.clear()
    mapped = open_pack_reader(cache, "auto", "float32")  # no fault dir (a probe): mapped, no record
    assert isinstance(mapped, PackReader) and mapped.mode == "mapped"
    mapped.close()


def test_a_clean_close_removes_the_record_and_gives_faulthandler_back(cache: Manifest, tmp_path: Path) -> None:
    was_enabled = faulthandler.is_enabled()
    fault_dir = tmp_path / "run"
    fault_dir.mkdir(mode=0o700)
    reader = open_pack_reader(cache, "auto", "float32", fault_dir=fault_dir)
    assert isinstance(reader, PackReader) and reader.mode == "mapped"
    assert os.listdir(fault_dir) == [f"pack-fault-{os.getpid()}.log"] and faulthandler.is_enabled()
    reader.close()
    reader.close()  # idempotent
    assert os.listdir(fault_dir) == [] and faulthandler.is_enabled() == was_enabled


def test_a_fault_record_that_cannot_be_written_means_preadv_not_an_unrecorded_mapping(
    cache: Manifest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no-such-dir"
    with caplog.at_level(logging.WARNING, logger="melfeed.producer.pack.reader"):
        reader = open_pack_reader(cache, "auto", "float32", fault_dir=missing)
    assert isinstance(reader, PackReader) and reader.mode == "preadv"
    assert "cannot write the fault record" in caplog.text and str(missing) in caplog.text
    reader.close()


def _resident_kb(address: int) -> int:
    """Rss of the mapping that starts at ``address``, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            return next(int(x.split()[1]) for x in lines[i + 1 :] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:x}")


def test_a_pack_that_fits_in_memory_is_populated_in_the_background_and_a_large_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    from melfeed.producer.pack import mapped as mapped_module

    path = tmp_path / "p.pack"
    path.write_bytes(os.urandom(4 << 20))  # in the page cache: just written
    fd = os.open(path, os.O_RDONLY)
    try:
        lazy = mapped_module.MappedPack(fd, 4 << 20)
        monkeypatch.setattr(mapped_module, "_mem_available_bytes", lambda: (8 << 20) - 1)  # under twice its size
        assert not lazy.populate_in_background() and lazy.populating is None
        assert _resident_kb(np.frombuffer(lazy.view, np.uint8).ctypes.data) == 0  # nothing touched yet
        lazy.close()
        full = mapped_module.MappedPack(fd, 4 << 20)
        monkeypatch.setattr(mapped_module, "_mem_available_bytes", lambda: 8 << 20)
        assert full.populate_in_background() and full.populating is not None
        full.populating.join(_WAIT_S)
        assert _resident_kb(np.frombuffer(full.view, np.uint8).ctypes.data) == 4 << 10
        full.close()
        full.close()
    finally:
        os.close(fd)
