"""The consumer's shared-memory slot files, mapped into this producer (same-host path).

A lease on the shared-memory path names a slot file in the WELCOME's ``shm_dir``; the producer maps
it once (``MAP_SHARED``, read-write) and the assembler builds the batch straight into typed views of
that mapping, laid out exactly as the consumer's slot (``shared/wire/layout.py``).
Invariant: at most ``max_mappings`` files stay mapped: the least recently leased mapping goes
first (the consumer retires a slot's file by giving the slot a new generation, so old names stop
coming). Mappings are dropped, never ``close()``d: numpy views of a batch may still exist; the
mapping goes with its last reference. The consumer owns and unlinks the files; we never unlink.
Shutdown: ``clear()`` drops every mapping; idempotent.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import numpy.typing as npt

from shared.wire.buckets import BucketSet
from shared.wire.layout import batch_layout, layout_nbytes, layout_views
from shared.wire.protocol import ShmSlot

__all__ = ["SlotMappings"]


class SlotMappings:
    """Bounded cache of mapped slot files, keyed by file name.

    Args:
        bucket_set: the shapes a slot is laid out for.
        max_mappings: most files kept mapped (about twice the consumer's ring slots).
    """

    def __init__(self, bucket_set: BucketSet, max_mappings: int) -> None:
        self._layouts = {b.index: batch_layout(b) for b in bucket_set.buckets}
        self._nbytes = {b.index: layout_nbytes(b) for b in bucket_set.buckets}
        self._max = max(1, max_mappings)
        self._maps: OrderedDict[str, npt.NDArray[np.uint8]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._maps)

    def views(self, directory: str, slot: ShmSlot, bucket: int) -> dict[str, npt.NDArray[np.generic]]:
        """Typed views of ``bucket``'s layout in the slot file ``slot.name``.

        Raises:
            OSError: the file cannot be opened or mapped, or is smaller than the batch (errno set).
        """
        memory = self._maps.get(slot.name)
        if memory is None:
            memory = self._map(Path(directory) / slot.name)
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

    @staticmethod
    def _map(path: Path) -> npt.NDArray[np.uint8]:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise OSError(22, "slot file is empty")
            mem = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return np.frombuffer(mem, dtype=np.uint8)
