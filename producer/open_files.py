"""A bounded cache of open cache-file descriptors, one per producer process.

Role: spare the producer an ``open``/``fstat``/``close`` of every ``.npy`` file of every batch (about
14 us a file, 64 files a batch). ``CacheReader`` asks ``acquire`` for a file's descriptor and its
identity, reads it with ``preadv`` (no file position is shared), and calls ``release``.

Invariants:
- At most ``capacity`` descriptors stay open; the least recently used one is closed first. Capacity 0
  keeps nothing open between reads (every ``release`` closes). The capacity is also held below half
  of this process's soft ``RLIMIT_NOFILE``, so the cache never starves sockets of descriptors; if an
  open still fails for lack of descriptors, half the cache is closed and the open tried once more.
- Every descriptor was opened by ``melfeed.shared.cache.filekind.open_regular``: a regular file, opened
  without blocking. Its identity (device, inode, size, mtime) is the ``fstat`` of that open.
- Staleness is bounded in time: an entry last checked more than ``revalidate_s`` ago is checked by
  path (``os.stat``) before use; a file replaced on disk (a rename over it: another inode) or rewritten
  (another size or mtime) is closed and opened again, so its new identity makes the reader check its
  size, header and values again. Within ``revalidate_s`` a file replaced by a rename is still read
  from the inode that was checked (its old, checked content); a rewrite in place is read as it now is
  (the header is compared on every read, and a short read fails).
- A descriptor whose read failed is closed at once (``release(ok=False)``): a bad file is opened,
  checked and refused afresh every time, so every producer refuses the same rows.
- Not thread-safe: one cache per reader, one reader per thread.
Shutdown: ``close()`` closes every descriptor; idempotent; the cache stays usable (it reopens).
"""

from __future__ import annotations

import errno
import os
import resource
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from melfeed.shared.cache.filekind import open_regular

__all__ = ["OpenFile", "OpenFiles", "descriptor_budget"]

Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def descriptor_budget(wanted: int) -> int:
    """``wanted``, held to half of the soft ``RLIMIT_NOFILE`` (the other half for sockets and libraries)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max(0, wanted)
    return max(0, min(wanted, soft // 2))


@dataclass(slots=True)
class OpenFile:
    """One open cache file: its descriptor, its identity at open, when that was last confirmed."""

    fd: int
    identity: Identity
    checked_s: float
    cached: bool

    @property
    def size(self) -> int:
        return self.identity[2]


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class OpenFiles:
    """LRU cache of open regular files keyed by the caller's key (e.g. ``(index, is_mel)``).

    Args:
        capacity: most descriptors kept open (held to ``descriptor_budget``); 0 = none.
        revalidate_s: how long an entry is trusted before its path is checked again.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, capacity: int, revalidate_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = descriptor_budget(capacity)
        self._revalidate_s = revalidate_s
        self._clock = clock
        self._files: OrderedDict[Hashable, OpenFile] = OrderedDict()
        self.opens = 0  # opens done (hits = acquires - opens): the cache's effect, for tests and profiles

    def __len__(self) -> int:
        return len(self._files)

    def acquire(self, key: Hashable, path: str) -> OpenFile:
        """The open file for ``key`` (``path``), from the cache or freshly opened.

        Raises:
            CacheError: missing, or not a regular file (as ``open_regular``).
            OSError: any other open failure (permission, out of descriptors), for the caller to judge.
        """
        now = self._clock()
        f = self._files.get(key)
        if f is not None:
            if now - f.checked_s < self._revalidate_s:
                self._files.move_to_end(key)
                return f
            if self._unchanged(path, f):
                f.checked_s = now
                self._files.move_to_end(key)
                return f
            self._drop(key)
        fd, st = self._open(path)
        self.opens += 1
        f = OpenFile(fd, _identity(st), now, self.capacity > 0)
        if f.cached:
            self._files[key] = f
            while len(self._files) > self.capacity:
                self._close(self._files.popitem(last=False)[1])
        return f

    def release(self, key: Hashable, f: OpenFile, ok: bool = True) -> None:
        """Done reading ``f``: keep it (cached and ``ok``) or close it."""
        if not f.cached:
            self._close(f)
        elif not ok:
            self._drop(key)

    def close(self) -> None:
        """Close every descriptor. Idempotent."""
        while self._files:
            self._close(self._files.popitem()[1])

    def _open(self, path: str) -> tuple[int, os.stat_result]:
        try:
            return open_regular(path)
        except OSError as err:
            if err.errno not in _OUT_OF_FDS or not self._files:
                raise
        for _ in range((len(self._files) + 1) // 2):  # out of descriptors: give half of ours back, once
            self._close(self._files.popitem(last=False)[1])
        return open_regular(path)

    def _unchanged(self, path: str, f: OpenFile) -> bool:
        try:
            return _identity(os.stat(path)) == f.identity
        except OSError:
            return False  # gone or unreadable now: reopen, and let the open say what is wrong

    def _drop(self, key: Hashable) -> None:
        f = self._files.pop(key, None)
        if f is not None:
            self._close(f)

    @staticmethod
    def _close(f: OpenFile) -> None:
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1
