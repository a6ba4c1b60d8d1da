"""Read a cache's extra arrays (``CACHE/extras/<name>/<id>.npy``) straight into batch rows.

Role: the producer's only reader of ``extras/``; ``producer/batcher.py`` calls it once per extra
per row, with ``dst`` a view of the row in the send buffer or the consumer's shared-memory slot,
so an extra costs the same copies as the mel: one ``preadv`` from page cache into its place.
What a row holds (cut and zero padding by kind) is ``shared.wire.schema.pad_row``'s rule.

Invariants:
- A read either fills ``dst`` by that rule or raises ``CacheError`` naming the file (missing, not
  a regular file, size or header other than the manifest recorded, ends early, NaN/Inf in a float
  extra); reasons outside the file raise ``TransientReadError``, never a quarantine decision.
- The header is parsed once per file per process, then compared byte for byte (like the mel reader).
- Not thread-safe (scratch header buffer): one reader per thread.
Shutdown: descriptors are kept only in the ``OpenFiles`` cache given at construction (its owner, the
``CacheReader``, closes them); without one every fd is closed after its read.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

from producer.open_files import OpenFiles
from producer.reader import _open_error, _pread_exact
from shared.cache.extras import EXTRAS_DIR
from shared.cache.manifest import Manifest
from shared.cache.npyfile import parse_npy_header
from shared.errors import CacheError
from shared.wire.schema import ExtraSpec

__all__ = ["ExtraReader"]


class ExtraReader:
    """Reads one manifest's extra arrays into caller-owned batch rows."""

    def __init__(self, manifest: Manifest, files: OpenFiles | None = None) -> None:
        """Bind to ``manifest``; opens nothing until a read. ``files``: the producer's open-file cache
        (``CacheReader.open_files``, shared with the mels and tokens); None = open and close per read."""
        self.manifest = manifest
        self._files = files if files is not None else OpenFiles(0)
        self._columns = {c.spec.name: c for c in manifest.extras}
        # Plain Python per-row tuples and dtypes made once: numpy indexing per read costs more than the read.
        self._rows = {name: [tuple(r) for r in c.rows.tolist()] for name, c in self._columns.items()}
        self._dtypes = {name: np.dtype(c.spec.dtype) for name, c in self._columns.items()}
        self._head = bytearray(128)   # header bytes of the file being read, grown on demand
        ids = [u.id for u in manifest.utterances]
        self._paths = {name: [os.path.join(manifest.cache_dir, EXTRAS_DIR, name, f"{uid}.npy") for uid in ids]
                       for name in self._columns}
        self._checked_heads: dict[tuple[str, int], bytes] = {}   # bounded: extras x N x ~128 bytes

    @property
    def specs(self) -> tuple[ExtraSpec, ...]:
        return tuple(c.spec for c in self._columns.values())

    def read_into(self, name: str, index: int, dst: npt.NDArray[Any]) -> int:
        """Read utterance ``index``'s ``name`` into its batch row ``dst`` (``row_shape`` of the bucket).

        Returns:
            Elements kept along the first axis (``min(length, dst.shape[0])``; 1 for an utterance extra).

        Raises:
            CacheError: see the module invariants. ValueError: ``dst`` has the wrong dtype or shape.
        """
        spec = self._columns[name].spec
        length, offset, file_bytes = self._rows[name][index]
        trailing = dst.shape[1:] if spec.has_length else dst.shape
        if dst.dtype != self._dtypes[name] or trailing != spec.shape or not dst.flags.c_contiguous:
            raise ValueError(f"dst for extra {name!r} must be C-contiguous {spec.dtype} [..., {spec.shape}], "
                             f"got {dst.dtype} {dst.shape}")
        n = min(length, int(dst.shape[0])) if spec.has_length else 1
        rows = dst[:n] if spec.has_length else dst
        path = self._paths[name][index]
        if len(self._head) < offset:
            self._head = bytearray(offset)
        head = memoryview(self._head)[:offset]
        self._pread((EXTRAS_DIR, name, index), path, file_bytes, head, rows)
        self._check_head(spec, index, path, head, length, offset)
        if rows.dtype.kind == "f" and not np.isfinite(rows).all():
            raise CacheError(path, f"non-finite values (NaN/Inf) in extra {name!r}; run verify-cache")
        if spec.has_length:
            dst[n:] = 0
        return n

    def _pread(self, key: tuple[str, str, int], path: str, file_bytes: int, head: memoryview,
               rows: npt.NDArray[Any]) -> None:
        """One ``preadv`` of the header and the first rows' data, straight into ``rows``."""
        data = rows.data.cast("B") if rows.size else memoryview(bytearray())
        try:
            f = self._files.acquire(key, path)   # a FIFO, device or directory is a bad file, never a blocked read
        except OSError as err:
            raise _open_error(path, err, "cannot open") from err
        try:
            if f.size != file_bytes:
                raise CacheError(path, f"file changed since index (size {f.size}, manifest says "
                                       f"{file_bytes}); re-run index")
            _pread_exact(path, f.fd, head, data)
        except BaseException:
            self._files.release(key, f, ok=False)     # a failed read never keeps its descriptor
            raise
        self._files.release(key, f)

    def _check_head(self, spec: ExtraSpec, index: int, path: str, head: memoryview, length: int, offset: int) -> None:
        key = (spec.name, index)
        if self._checked_heads.get(key) == head:
            return
        try:
            header = parse_npy_header(bytes(head), path)
        except CacheError as err:
            raise CacheError(path, f"file changed since index ({err.reason}); re-run index") from err
        want = (spec.file_shape(length), np.dtype(spec.dtype).newbyteorder("<"), offset)
        if (header.shape, header.dtype, header.data_offset) != want:
            raise CacheError(path, f"file changed since index (header says shape {header.shape} dtype "
                                   f"{header.dtype.str}, manifest says {want[0]} {want[1].str}); re-run index")
        self._checked_heads[key] = bytes(head)
