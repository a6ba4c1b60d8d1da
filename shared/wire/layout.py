"""Byte layout of one batch inside a buffer: every array 64-byte aligned (DLPack requirement).

Role: the one definition of what a batch is in bytes -- its base array keys in wire order, their
dtypes, the alignment of each array -- shared so a producer fills exactly the layout a consumer
slot uses (same-host paths) and both sides check the same dtypes on the wire.
Invariants: arrays follow ``Bucket.shapes()`` order: ``ARRAY_KEYS``, then the cache's extras in
declaration order (``shared/wire/schema.py``); each starts at a multiple of ``ALIGN_BYTES``, so a
slot's views can go to TensorFlow through DLPack without a copy.
Shutdown: nothing to release; buffers go with their last view.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # buckets.py imports the dtypes below; a runtime import back would be a cycle
    from melfeed.shared.wire.buckets import Bucket

__all__ = [
    "ALIGN_BYTES",
    "ARRAY_KEYS",
    "ARRAY_DTYPES",
    "MEL_WIRE_DTYPES",
    "PAYLOAD_COPIES",
    "batch_layout",
    "layout_nbytes",
    "aligned_buffer",
    "layout_views",
    "round_up",
    "slot_nbytes_for",
]

ALIGN_BYTES = 64  # DLPack into TensorFlow aborts on anything less (docs/design.md)
ARRAY_KEYS = ("mel", "mel_len", "tokens", "tok_len")  # every batch's first arrays, in wire (payload frame) order
ARRAY_DTYPES: dict[str, str] = {"mel": "float32", "mel_len": "int32", "tokens": "int32", "tok_len": "int32"}
# transport.mel_dtype: the mel's dtype on the wire and in a slot (``Bucket.mel_dtype``); "float16" halves the
# bytes of every path and the step casts (docs/design.md "Batch schema"). The default is ARRAY_DTYPES'.
MEL_WIRE_DTYPES = ("float32", "float16")
PAYLOAD_COPIES = 4  # payload path: page cache -> producer buffer -> kernel socket -> libzmq -> ring slot
_PAGE_BYTES = 4096


def round_up(n: int, k: int) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return (n + k - 1) // k * k


def batch_layout(bucket: Bucket) -> list[tuple[str, int, tuple[int, ...], np.dtype]]:
    """(key, byte offset, shape, dtype) of each array of a ``bucket`` batch, in wire order."""
    out = []
    offset = 0
    dtypes = bucket.dtypes()
    for key, shape in bucket.shapes().items():  # ARRAY_KEYS first, then the extras
        dtype = np.dtype(dtypes[key])
        out.append((key, offset, shape, dtype))
        offset = round_up(offset + int(np.prod(shape)) * dtype.itemsize, ALIGN_BYTES)
    return out


def layout_nbytes(bucket: Bucket) -> int:
    """Bytes one batch of ``bucket`` occupies, padding between arrays included."""
    _, offset, shape, dtype = batch_layout(bucket)[-1]
    return offset + int(np.prod(shape)) * dtype.itemsize


def slot_nbytes_for(buckets: tuple[Bucket, ...]) -> int:
    """Bytes of one ring slot (and of a shared-memory slot file): the largest bucket's layout, in whole pages."""
    return round_up(max(layout_nbytes(b) for b in buckets), _PAGE_BYTES)


def aligned_buffer(nbytes: int) -> npt.NDArray[np.uint8]:
    """A uint8 buffer of ``nbytes`` whose first byte is 64-byte aligned."""
    raw = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN_BYTES
    return raw[start : start + nbytes]


def layout_views(
    memory: npt.NDArray[np.uint8], base: int, layout: list[tuple[str, int, tuple[int, ...], np.dtype]]
) -> dict[str, npt.NDArray[np.generic]]:
    """Typed views of one batch laid out at byte ``base`` of ``memory``."""
    out = {}
    for key, offset, shape, dtype in layout:
        n = int(np.prod(shape)) * dtype.itemsize
        out[key] = memory[base + offset : base + offset + n].view(dtype).reshape(shape)
    return out
