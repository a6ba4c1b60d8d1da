"""Ring slot memory in shared-memory files, so a same-host producer builds straight into a slot.

Each slot is its own file ``melfeed-<consumer pid>-<run id>-s<slot>-g<generation>`` in ``shm_dir`` (both
rules in ``shared/wire/same_host.py``: a producer derives and checks them itself, docs/security.md
"Which consumer a producer trusts"),
sized to the slot, its pages reserved with ``posix_fallocate`` (a full tmpfs fails here, never with
a SIGBUS later) and mapped ``MAP_SHARED`` (page-aligned, so 64-byte aligned for DLPack).
Invariants: one owner -- this object creates every file and ``close()`` unlinks every file it
still owns; ``retire(slot)`` (receiver thread only, on a LEASED slot whose batch was not accepted)
unlinks the slot's file and maps a fresh one with generation + 1, so a zombie producer that wakes
up writes into orphaned memory. Mappings are never ``close()``d: numpy views (a step's DLPack
tensor, a user's ``Batch``) may still point into them; dropping our reference lets them go.
Pinning: with a CUDA device, every slot mapping is page-locked (``cudaHostRegister``,
consumer/transport/pinning.py) when it is made and unregistered before our reference goes (``retire``,
``close``), so a host->device copy from a slot is a direct DMA; without one nothing is pinned (one INFO line).
Crash safety: ``clean_stale`` removes files of consumers that are no longer alive (every consumer at start;
bench and doctor for a trial or probe they ran, once it is gone).
Shutdown: ``close()`` is idempotent.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

from melfeed.consumer.transport.pinning import HostPinner, host_pinner
from melfeed.shared.config import TransportConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.same_host import SLOT_NAME_RE, is_tmpfs, resolve_shm_dir

__all__ = ["ShmSlots", "clean_stale", "open_ring_files", "open_shm_slots", "resolve_shm_dir", "is_tmpfs"]

log = logging.getLogger(__name__)

_MARGIN_BYTES = 1 << 20  # statvfs rounding and the files' own metadata


def _is_live_python(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process: not ours to judge
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"python" in cmdline.split(b"\0")[0].rsplit(b"/", 1)[-1]


def clean_stale(directory: Path, pid: int | None = None) -> tuple[int, int]:
    """Unlink slot files whose consumer is dead (or a recycled pid); returns (files, bytes).

    ``pid``: only that consumer's (a parent cleaning up after its child, which it has reaped).
    """
    files = n_bytes = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0, 0
    for name in names:
        m = SLOT_NAME_RE.fullmatch(name)
        if m is None or (pid is not None and int(m.group(1)) != pid) or _is_live_python(int(m.group(1))):
            continue
        path = directory / name
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError as err:
            log.debug("cannot remove stale %s: %s", path, err)
            continue
        files += 1
        n_bytes += size
    if files:
        log.info("removed %d stale shared-memory slot files (%.1f MB) from %s", files, n_bytes / 1e6, directory)
    return files, n_bytes


class ShmSlots:
    """``n_slots`` slot files of ``slot_nbytes`` each in ``directory``.

    Raises:
        OSError: a file could not be created or its pages reserved (files made so far are removed).
    """

    def __init__(
        self, directory: Path, n_slots: int, slot_nbytes: int, run_id: int, pinner: HostPinner | None = None
    ) -> None:
        self.directory = directory
        self.pinner = pinner if pinner is not None else host_pinner()
        self.slot_nbytes = slot_nbytes
        self.n_slots = n_slots
        self._prefix = f"melfeed-{os.getpid()}-{run_id}"
        self._gens = [0] * n_slots
        self._buffers: list[npt.NDArray[np.uint8] | None] = [None] * n_slots
        self._private: set[int] = set()  # slots whose new file could not be made (see retire)
        self._closed = False
        self.retired = 0
        try:
            for slot in range(n_slots):
                self._buffers[slot] = self._create(slot)
        except OSError:
            self.close()
            raise

    @property
    def total_nbytes(self) -> int:
        return self.n_slots * self.slot_nbytes

    def name(self, slot: int) -> str:
        return f"{self._prefix}-s{slot}-g{self._gens[slot]}"

    def generation(self, slot: int) -> int:
        return self._gens[slot]

    def is_shared(self, slot: int) -> bool:
        """False for a slot that fell back to private memory: lease it as a payload slot."""
        return slot not in self._private

    def buffer(self, slot: int) -> npt.NDArray[np.uint8]:
        buf = self._buffers[slot]
        if buf is None:
            raise ValueError(f"slot {slot} has no memory (closed)")
        return buf

    def retire(self, slot: int) -> None:
        """Orphan the slot's file (a producer may still write into it) and map a new generation."""
        self._unlink(slot)
        self._unpin(slot)  # a LEASED slot: no copy reads it
        self._gens[slot] += 1
        self._buffers[slot] = None  # views elsewhere keep the old mapping alive; never close it
        self.retired += 1
        try:
            self._buffers[slot] = self._create(slot)
            self._private.discard(slot)
        except OSError as err:
            # Orphaned pages still count against tmpfs until the zombie dies; keep the slot usable.
            log.warning(
                "cannot create %s in %s (%s); slot %d uses private memory from now on",
                self.name(slot),
                self.directory,
                os.strerror(err.errno or 0),
                slot,
            )
            self._buffers[slot] = np.frombuffer(mmap.mmap(-1, self.slot_nbytes), dtype=np.uint8)
            self._private.add(slot)

    def close(self) -> None:
        """Unlink every file this object still owns. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot in range(self.n_slots):
            self._unlink(slot)
            self._unpin(slot)

    def _unpin(self, slot: int) -> None:
        buf = self._buffers[slot]
        if buf is not None and slot not in self._private:
            self.pinner.unpin(buf)

    def _create(self, slot: int) -> npt.NDArray[np.uint8]:
        path = self.directory / self.name(slot)
        # 0600 whatever the umask: producers map it read-write as the same service user (deploy/units
        # set one User= for both), so neither the group nor anyone else needs access.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.slot_nbytes)
            mem = mmap.mmap(fd, self.slot_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        buf = np.frombuffer(mem, dtype=np.uint8)
        self.pinner.pin(buf)
        return buf

    def _unlink(self, slot: int) -> None:
        try:
            os.unlink(self.directory / self.name(slot))
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("cannot remove %s: %s", self.directory / self.name(slot), err)


def open_shm_slots(
    directory: Path, n_slots: int, slot_nbytes: int, run_id: int, *, required: bool = False
) -> ShmSlots | None:
    """Clean stale files, check room, create the slot files; ``None`` (one WARNING) means use payload frames.

    Raises:
        ConfigError: ``required`` (``transport.mode: shm``) and the slot files cannot be made: the user
            asked for shared memory, so nothing falls back behind their back.
    """
    clean_stale(directory)
    need = n_slots * slot_nbytes + _MARGIN_BYTES
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
    except OSError as err:
        return _give_up(directory, f"unusable ({err.strerror})", required)
    if free < need:
        return _give_up(directory, f"too small: need {need} bytes, {free} free", required)
    try:
        return ShmSlots(directory, n_slots, slot_nbytes, run_id)
    except OSError as err:
        why = "no space" if err.errno == errno.ENOSPC else (err.strerror or str(err))
        return _give_up(directory, f"cannot reserve {need} bytes ({why}, {free} free)", required)


def _give_up(directory: Path, reason: str, required: bool) -> ShmSlots | None:
    if required:
        raise ConfigError(
            f"shared-memory dir {directory} {reason}; transport.mode is shm (auto would use payload frames instead)",
            path=("transport", "shm_dir"),
        )
    log.warning("shared-memory dir %s %s; using the ZeroMQ payload path for this run", directory, reason)
    return None


def open_ring_files(
    transport: TransportConfig, endpoint: str, n_slots: int, slot_nbytes: int, run_id: int
) -> ShmSlots | None:
    """Slot files for the shared-memory path, or ``None`` for payload frames (mode zmq, tcp, no room)."""
    if transport.mode == "zmq" or not endpoint.startswith("ipc://"):
        return None
    return open_shm_slots(
        resolve_shm_dir(transport.shm_dir, endpoint), n_slots, slot_nbytes, run_id, required=transport.mode == "shm"
    )
