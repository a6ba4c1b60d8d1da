"""One batch array seen as bytes, so a reader fills a row with a memoryview slice, not numpy indexing.

Role: the per-row cost of the producer's build. A row read as numpy work -- a row view, a slice,
a byte cast, a dtype check, a ``dst[n:] = 0`` -- costs about 2 us per file, more than the
``preadv`` of a small file (about 1.8 us on the 2-core development machine). ``RowBytes`` does the
checks and the byte cast once per array per build; a row is then a slice of one flat memoryview,
and its padding tail is zeroed by copying from a shared zero buffer (docs/performance.md
"Producer build"). ``HeadViews`` is the header buffer both readers read a file's
``.npy`` header into, ahead of its data.

Invariants:
- Built only over a C-contiguous, writable array whose first axis is the batch row; row ``r`` is
  ``data[r * row_nbytes:(r + 1) * row_nbytes]`` and holds ``capacity`` elements of ``item_nbytes``
  along the second axis (1 element for a rank-1 array: the whole row).
- ``zeros`` is at least ``row_nbytes`` long and only ever read (a ``bytes`` object).
Shutdown: nothing to release; the views go with the batch.
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

__all__ = ["RowBytes", "zero_bytes", "HeadViews"]


def zero_bytes(nbytes: int) -> memoryview:
    """A read-only zero buffer of ``nbytes`` (the longest row of any array the assembler fills)."""
    return memoryview(bytes(nbytes))


class RowBytes:
    """A batch array as one flat byte view plus the geometry of its rows.

    Args:
        array: the batch array [B, ...] (a send buffer's or a slot's view).
        zeros: a zero buffer at least one row long (``zero_bytes``).
        dtype_name: the caller's name for the array's dtype (the manifest's ``mel_dtype`` spelling), kept
            for per-row comparisons; numpy's ``dtype.name`` is computed in Python (about 5 us a call).

    Raises:
        ValueError: ``array`` is not C-contiguous and writable, or ``zeros`` is shorter than a row.
    """

    __slots__ = ("array", "dtype_name", "data", "row_nbytes", "item_nbytes", "capacity", "zeros")

    def __init__(self, array: npt.NDArray[Any], zeros: memoryview, dtype_name: str = "") -> None:
        flags = array.flags
        if not flags.c_contiguous or not flags.writeable or array.ndim < 1:
            raise ValueError(
                f"batch array must be writable, C-contiguous and of rank >= 1, got shape {array.shape} "
                f"contiguous={flags.c_contiguous} writeable={flags.writeable}"
            )
        self.array = array
        self.dtype_name = dtype_name
        self.data = array.data.cast("B") if array.size else memoryview(bytearray())
        rows = int(array.shape[0])
        self.row_nbytes = array.nbytes // rows if rows else 0
        self.capacity = int(array.shape[1]) if array.ndim > 1 else 1
        self.item_nbytes = self.row_nbytes // self.capacity if self.capacity else 0
        if zeros.nbytes < self.row_nbytes:
            raise ValueError(f"zero buffer of {zeros.nbytes} bytes is shorter than a row ({self.row_nbytes})")
        self.zeros = zeros

    def head(self, row: int, n: int) -> memoryview:
        """The bytes of row ``row``'s first ``n`` elements (where a file's first ``n`` go)."""
        start = row * self.row_nbytes
        return self.data[start : start + n * self.item_nbytes]

    def zero_tail(self, row: int, n: int) -> None:
        """Zero row ``row`` from element ``n`` on (its padding tail)."""
        start = row * self.row_nbytes + n * self.item_nbytes
        end = (row + 1) * self.row_nbytes
        if end > start:
            self.data[start:end] = self.zeros[: end - start]


class HeadViews:
    """The reused buffer a cache file's ``.npy`` header is read into, ahead of the row's data.

    One view per data offset (a cache has a few header sizes); the buffer grows on demand, and then the
    views are made again over the new one. Shared by the mel/token reader and the extra reader.
    """

    def __init__(self) -> None:
        self._buf = bytearray(128)
        self._views: dict[int, memoryview] = {}

    def get(self, offset: int) -> memoryview:
        """The first ``offset`` bytes of the buffer."""
        view = self._views.get(offset)
        if view is None:
            if len(self._buf) < offset:
                self._buf = bytearray(offset)
                self._views.clear()
            view = self._views[offset] = memoryview(self._buf)[:offset]
        return view
