"""The consumer's shared-memory slot files, mapped into this producer (same-host path).

A lease on the shared-memory path names a slot file in the WELCOME's ``shm_dir``; the producer maps
it once (``MAP_SHARED``, read-write) and the assembler builds the batch straight into typed views of
that mapping, laid out exactly as the consumer's slot (``shared/wire/layout.py``).
Trust (docs/security.md "Which consumer a producer trusts"): whoever answers at the endpoint names the directory and the
file, so nothing is opened on its word. A file is mapped only when the WELCOME's directory is, resolved,
the one this producer derives from its own config (``melfeed.shared.wire.same_host.resolve_shm_dir``), the name
is a slot name of the lease's slot and generation, and the file, opened with ``O_NOFOLLOW``, is (``fstat``
on that descriptor, so nothing can change between check and use) a regular file of our effective uid
with one link, no group or other permission bits and exactly one slot's size. Anything else raises
``OSError(EPERM)`` naming the reason before a byte is written.
Invariant: at most ``max_mappings`` files stay mapped: the least recently leased mapping goes
first (the consumer retires a slot's file by giving the slot a new generation, so old names stop
coming). Mappings are dropped, never ``close()``d: numpy views of a batch may still exist; the
mapping goes with its last reference. The consumer owns and unlinks the files; we never unlink.
Shutdown: ``clear()`` drops every mapping; idempotent.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from melfeed.shared.wire.buckets import Bucket, BucketSet, apply_rows
from melfeed.shared.wire.layout import batch_layout, layout_nbytes, layout_views, slot_nbytes_for
from melfeed.shared.wire.protocol import ShmSlot
from melfeed.shared.wire.same_host import SLOT_NAME_RE, resolve_shm_dir, user_name

__all__ = ["SlotMappings"]


class SlotMappings:
    """Bounded cache of mapped slot files, keyed by file name.

    Args:
        bucket_set: the shapes a slot is laid out for (a slot file holds ``slot_nbytes_for`` them); ``None``: none
            until ``use_buckets`` (a producer that learns its plan in the handshake).
        max_mappings: most files kept mapped (about twice the consumer's ring slots).
        shm_dir: ``transport.shm_dir`` of this producer's config (``None``: derived from ``endpoint``).
        endpoint: the consumer's endpoint as this producer resolved it.
    """

    def __init__(self, bucket_set: BucketSet | None, max_mappings: int, *, shm_dir: str | None, endpoint: str) -> None:
        self._shape(bucket_set.buckets if bucket_set is not None else ())
        self._max = max(1, max_mappings)
        self._shm_dir = shm_dir
        self._endpoint = endpoint
        self._maps: OrderedDict[str, npt.NDArray[np.uint8]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._maps)

    def views(self, directory: str, slot: ShmSlot, bucket: int) -> dict[str, npt.NDArray[np.generic]]:
        """Typed views of ``bucket``'s layout in the slot file ``slot.name`` of the WELCOME's ``directory``.

        Raises:
            OSError: the file is refused (``EPERM``, the reason as ``strerror``), cannot be opened or
                mapped, or is smaller than the batch (errno set).
        """
        memory = self._maps.get(slot.name)
        if memory is None:
            memory = self._map(self._checked_path(directory, slot))
            self._maps[slot.name] = memory
            while len(self._maps) > self._max:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(slot.name)
        if memory.nbytes < self._nbytes[bucket]:
            raise OSError(22, f"slot file holds {memory.nbytes} bytes, bucket {bucket} needs {self._nbytes[bucket]}")
        return layout_views(memory, 0, self._layouts[bucket])

    def clear(self) -> None:
        self._maps.clear()

    def use_buckets(self, buckets: tuple[Bucket, ...]) -> None:
        """Lay slots out for these shapes from now on (a plan learned in the handshake: the consumer's slot files are
        sized by its shapes). Every mapping is dropped: the files of another plan are another size."""
        self._shape(buckets)
        self.clear()

    def use_rows(self, rows: list[int]) -> None:
        """Lay slots out for ``rows`` rows per bucket from now on (learned in the handshake): ``use_buckets`` of the
        same shapes with those rows."""
        self.use_buckets(apply_rows(self._buckets, rows))

    def _shape(self, buckets: tuple[Bucket, ...]) -> None:
        self._buckets = buckets
        self._layouts = {b.index: batch_layout(b) for b in buckets}
        self._nbytes = {b.index: layout_nbytes(b) for b in buckets}
        self._file_nbytes = slot_nbytes_for(buckets) if buckets else 0  # no plan yet: every file is refused

    def _checked_path(self, directory: str, slot: ShmSlot) -> str:
        """The slot file's path in our own shm directory, once the name and the WELCOME's directory pass."""
        m = SLOT_NAME_RE.fullmatch(slot.name)
        if m is None or (int(m.group(3)), int(m.group(4))) != (slot.slot, slot.generation):
            raise _refused(
                f"name {slot.name!r} is not the slot file of slot {slot.slot} generation "
                f"{slot.generation} (melfeed-PID-EPOCH-sSLOT-gGEN)"
            )
        ours = os.path.realpath(resolve_shm_dir(self._shm_dir, self._endpoint))
        theirs = os.path.realpath(directory)
        if theirs != ours:
            raise _refused(
                f"directory {theirs} is not this producer's shared-memory directory {ours} "
                "(transport.shm_dir, else the ipc socket's directory on tmpfs, else /dev/shm)"
            )
        return os.path.join(ours, slot.name)

    def _map(self, path: str) -> npt.NDArray[np.uint8]:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise _refused("is a symbolic link") from None
            raise
        try:
            self._check_opened(os.fstat(fd))
            mem = mmap.mmap(fd, self._file_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return np.frombuffer(mem, dtype=np.uint8)

    def _check_opened(self, st: os.stat_result) -> None:
        """What the consumer's slot file is (``consumer/transport/shm_slots.py``): anything else is refused."""
        euid = os.geteuid()
        if not stat.S_ISREG(st.st_mode):
            raise _refused("is not a regular file")
        if st.st_uid != euid:
            raise _refused(f"is owned by uid {st.st_uid} ({user_name(st.st_uid)}), not by this producer's uid {euid}")
        if st.st_nlink != 1:
            raise _refused(f"has {st.st_nlink} hard links, a slot file has 1")
        if st.st_mode & 0o077:
            raise _refused(f"has mode {stat.S_IMODE(st.st_mode):04o}, a slot file gives the group and others nothing")
        if st.st_size != self._file_nbytes:
            raise _refused(f"holds {st.st_size} bytes, a slot file of these buckets {self._file_nbytes}")


def _refused(reason: str) -> OSError:
    return OSError(errno.EPERM, f"refused: {reason}")
