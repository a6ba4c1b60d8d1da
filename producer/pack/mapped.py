"""The packed cache mapped read-only into a producer, and the record that makes a bus error happen once.

Role: copying a row out of a mapping of the pack costs less than half of reading it with ``preadv``:
on the 2-core development machine 0.41-0.44 ms against 0.92-1.07 ms for a 9 MB batch from the page
cache (the kernel's copy to user memory is the difference; docs/performance.md "Producer build"). Pages
are mapped lazily: a producer's first touch of a record faults it in (about the cost of a ``preadv``),
later epochs copy at memory speed. A pack that fits in half the memory available is also populated by
one background thread (``MADV_POPULATE_READ``, the GIL released; an error is only logged), so the first
epoch is fast too (38 ms for the 713 MB demo pack from the page cache).

The price of a mapping is SIGBUS: touching a page that the file no longer has (the pack truncated in
place) or that the disk cannot read kills the process, where ``preadv`` returns an error. So:
- ``PackReader.check_intact`` compares the pack's size once per batch: a pack cut between batches is a
  ``TransientReadError`` (the producer restarts; ``open_pack`` then refuses the damaged pack and the
  ``.npy`` files are read). Only a cut during one batch's copy (about half a millisecond) is a SIGBUS.
- ``FaultRecord``: while a producer reads a mapped pack, the private runtime directory holds
  ``pack-fault-<pid>.log``: the pack's identity (device, inode, size, mtime) on its first line, and,
  if the process dies of a fatal signal, ``faulthandler``'s report after it. A clean close removes
  the file. ``earlier_bus_error`` at the next producer start (systemd's restart or the supervisor's)
  finds a dead producer's record that says "Bus error" for the same pack, and that producer reads with
  ``preadv`` instead: a bad disk block costs one restart and then the row's quarantine, never a loop.
  A record of another pack (re-packed: a new inode) or without a bus error (a SIGKILL) is removed; one
  that holds another fatal signal's report (a segfault) is first logged as a WARNING.

Invariants: records are regular files of our uid in the private runtime directory, never followed
through a link; a record whose pid is alive is never touched (a reused pid keeps it: the safe side).
Shutdown: ``MappedPack.close()`` and ``FaultRecord.close()`` are idempotent.
"""

from __future__ import annotations

import faulthandler
import logging
import mmap
import os
import re
import stat
import sys
import threading
from pathlib import Path
from typing import IO

from melfeed.shared.service.leftovers import is_pid_alive

__all__ = ["MappedPack", "FaultRecord", "pack_identity", "earlier_bus_error"]

log = logging.getLogger(__name__)

_RECORD = re.compile(r"^pack-fault-(\d{1,10})\.log$")
_FATAL = b"Fatal Python error: "
_BUS_ERROR = _FATAL + b"Bus error"
_RECORD_READ_BYTES = 1 << 16
_MADV_POPULATE_READ = 22  # Linux 5.14+; EINVAL before: lazy faults only


class MappedPack:
    """A read-only shared mapping of the whole pack file (descriptor ``fd`` of ``nbytes``).

    Raises:
        OSError: the file cannot be mapped (the caller reads with ``preadv`` instead).
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        self.view = memoryview(self._map)
        self.nbytes = nbytes
        self.populating: threading.Thread | None = None

    def populate_in_background(self) -> bool:
        """Fault the whole pack in from a daemon thread when it fits in half of MemAvailable; True if started."""
        available = _mem_available_bytes()
        if self._map is None or available is None or 2 * self.nbytes > available:
            return False
        self.populating = threading.Thread(target=_populate, args=(self._map,), name="pack-populate", daemon=True)
        self.populating.start()
        return True

    def close(self) -> None:
        """Release the view and unmap; a slice still held elsewhere keeps the mapping until it goes."""
        if self._map is None:
            return
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # an exported slice: the mapping goes with its last reference
        self._map = None


def _populate(mapping: mmap.mmap) -> None:
    try:
        mapping.madvise(_MADV_POPULATE_READ)
    except (OSError, ValueError) as err:  # an old kernel, a read error (the copy will see it), or closed
        log.debug("pack populate stopped: %s", err)


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pack_identity(fd: int) -> str:
    """What a record ties a bus error to: the open pack's device, inode, size and mtime."""
    st = os.fstat(fd)
    return f"dev={st.st_dev} ino={st.st_ino} size={st.st_size} mtime_ns={st.st_mtime_ns}"


class FaultRecord:
    """This process's ``pack-fault-<pid>.log`` in ``directory`` while it reads a mapped pack.

    Raises:
        OSError: the record cannot be written (the caller then does not map).
    """

    def __init__(self, directory: Path, identity: str, pack: Path) -> None:
        self.path = directory / f"pack-fault-{os.getpid()}.log"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self._file: IO[str] | None = os.fdopen(fd, "w", encoding="utf-8")
        try:
            self._file.write(f"{identity}\t{pack}\n")
            self._file.flush()
        except OSError:
            self._file.close()
            self.path.unlink(missing_ok=True)
            raise
        self._was_enabled = faulthandler.is_enabled()
        faulthandler.enable(self._file, all_threads=True)  # a fatal signal's report lands in the record

    def close(self) -> None:
        if self._file is None:
            return
        faulthandler.disable()
        if self._was_enabled and sys.__stderr__ is not None:
            faulthandler.enable(sys.__stderr__)  # where ``python -X faulthandler`` reports
        self._file.close()
        self._file = None
        self.path.unlink(missing_ok=True)


def earlier_bus_error(directory: Path, identity: str) -> Path | None:
    """A dead producer's record of a bus error while it read the pack ``identity`` names, or None.

    Sweeps dead producers' records that hold no bus error or name another pack; keeps the one found.
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    found = None
    for name in names:
        match = _RECORD.match(name)
        if match is None or is_pid_alive(int(match.group(1))):
            continue
        path = directory / name
        text = _read_own_record(path)
        if text is None:
            continue
        first, _, rest = text.partition(b"\n")
        if _BUS_ERROR in rest and first.split(b"\t", 1)[0].decode(errors="replace") == identity:
            found = found or path
            continue
        fatal = rest.find(_FATAL)
        if fatal >= 0:  # another fatal signal (or a pack since replaced): say so once, then drop
            log.warning(
                "producer pid %s died: %s", match.group(1), rest[fatal:].split(b"\n", 1)[0].decode(errors="replace")
            )
        path.unlink(missing_ok=True)  # a SIGKILL's leftover, or a bus error of a pack since replaced
    return found


def _read_own_record(path: Path) -> bytes | None:
    """The start of ``path`` if it is a regular file of ours (opened without following a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        return os.pread(fd, _RECORD_READ_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
