"""Read a cache's extra arrays (``CACHE/extras/<name>/<id>.npy``) straight into batch rows.

Role: the producer's only reader of ``extras/``; ``producer/batcher.py`` calls ``read_row`` once per
extra per row, into the row of the send buffer or the consumer's shared-memory slot (seen as bytes:
``producer/batch_rows.py``), so an extra costs the same copies as the mel: one ``preadv`` from page
cache into its place. What a row holds (cut and zero padding by kind) is ``melfeed.shared.wire.schema.pad_row``'s rule.
A matrix extra (``[tokens, ceil(frames / r)]``) is the exception: its rows are narrower than the batch's, so
the file's kept token rows are read into a scratch buffer and copied into the row's top-left corner.

Invariants:
- A read either fills the row by that rule or raises ``CacheError`` naming the file (missing, not
  a regular file, size or header other than the manifest recorded, ends early, NaN/Inf in a float
  extra); reasons outside the file raise ``TransientReadError``, never a quarantine decision.
- The header is parsed once per file per process, then compared byte for byte (like the mel reader).
- A float extra's values are checked for NaN/Inf once per file identity per process (again when a
  read keeps more elements than were checked, or the file's identity changed), like a mel's.
- Not thread-safe (scratch header buffer): one reader per thread.
Shutdown: descriptors are kept only in the ``OpenFiles`` cache given at construction (its owner, the
``CacheReader``, closes them); without one every fd is closed after its read.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.producer.batch_rows import HeadViews, RowBytes
from melfeed.producer.open_files import Identity, OpenFiles
from melfeed.producer.reader import read_file_exact
from melfeed.shared.cache.extras import EXTRAS_DIR
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.cache.npyfile import parse_npy_header
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.schema import ExtraSpec

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
        self._specs = tuple(c.spec for c in self._columns.values())
        self._heads = HeadViews()  # header bytes of the file being read, one view per data offset
        ids = [u.id for u in manifest.utterances]
        self._paths = {
            name: [os.path.join(manifest.cache_dir, EXTRAS_DIR, name, f"{uid}.npy") for uid in ids]
            for name in self._columns
        }
        self._checked_heads: dict[tuple[str, int], bytes] = {}  # bounded: extras x N x ~128 bytes
        self._frames = manifest.frames.tolist()  # a matrix's columns follow its utterance's frames
        self._scratch = np.empty(0, np.uint8)  # a matrix's kept rows, grown on demand
        # What one read needs, in one lookup: spec, has a length axis, is float (NaN/Inf check), rows, paths.
        self._reads = {
            name: (c.spec, c.spec.has_length, self._dtypes[name].kind == "f", self._rows[name], self._paths[name])
            for name, c in self._columns.items()
        }
        # Float values found finite, per (name, index): (file identity, elements checked). Bounded like the heads.
        self._finite: dict[tuple[str, int], tuple[Identity, int]] = {}

    @property
    def specs(self) -> tuple[ExtraSpec, ...]:
        return self._specs

    def rows_of(self, name: str, array: npt.NDArray[Any], zeros: memoryview) -> RowBytes:
        """A batch's extra ``name`` [B, ...] as ``RowBytes`` for ``read_row`` (checked once per build).

        Raises:
            ValueError: ``array`` has the wrong dtype, trailing shape or layout.
        """
        spec = self._columns[name].spec
        trailing = array.shape[1 + spec.lead_dims :]
        if array.dtype != self._dtypes[name] or trailing != spec.shape or array.ndim < 1:
            raise ValueError(
                f"batch array for extra {name!r} must be C-contiguous {spec.dtype} [B, ..., {spec.shape}], "
                f"got {array.dtype} {array.shape}"
            )
        return RowBytes(array, zeros)

    def read_row(self, name: str, index: int, rows: RowBytes, row: int) -> int:
        """Read utterance ``index``'s ``name`` into row ``row`` of ``rows`` (``rows_of``), padded by kind.

        Returns:
            Elements kept along the first axis (``min(length, capacity)``; 1 for an utterance extra).

        Raises:
            CacheError: see the module invariants.
        """
        spec, has_length, is_float, column_rows, paths = self._reads[name]
        length, offset, file_bytes = column_rows[index]
        n = min(length, rows.capacity) if has_length else 1
        path = paths[index]
        head = self._heads.get(offset)
        key = (name, index)
        if spec.kind == "matrix":
            identity = self._read_matrix(spec, index, key, path, file_bytes, head, rows, row, n)
        else:
            identity = read_file_exact(
                self._files, key, path, file_bytes, head, rows.head(row, n if has_length else rows.capacity)
            )
        if self._checked_heads.get(key) != bytes(head):
            self._check_head(spec, index, path, head, length, offset)
        if is_float:
            known = self._finite.get(key)
            if known is None or known[0] != identity or known[1] < n:
                values = rows.array[row, :n] if has_length else rows.array[row]
                if not np.isfinite(values).all():
                    raise CacheError(path, f"non-finite values (NaN/Inf) in extra {name!r}; run verify-cache")
                self._finite[key] = (identity, n)
        if has_length and n < rows.capacity:
            rows.zero_tail(row, n)
        return n

    def _read_matrix(
        self,
        spec: ExtraSpec,
        index: int,
        key: tuple[str, int],
        path: str,
        file_bytes: int,
        head: memoryview,
        rows: RowBytes,
        row: int,
        n: int,
    ) -> Identity:
        """A matrix's first ``n`` token rows into ``scratch``, then its columns (cut to the batch's) into the row."""
        dst = rows.array[row]  # [L, C, k...]
        file_cols = spec.columns(self._frames[index])
        shape = (n, file_cols, *spec.shape)
        nbytes = int(np.prod(shape)) * dst.dtype.itemsize
        if self._scratch.size < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        identity = read_file_exact(self._files, key, path, file_bytes, head, self._scratch[:nbytes].data)
        cols = min(file_cols, dst.shape[1])
        dst[:n, :cols] = self._scratch[:nbytes].view(dst.dtype).reshape(shape)[:, :cols]
        dst[:n, cols:] = 0
        return identity

    def _check_head(self, spec: ExtraSpec, index: int, path: str, head: memoryview, length: int, offset: int) -> None:
        """Parse a header not seen before and compare it with the manifest's row; remember it if equal."""
        try:
            header = parse_npy_header(bytes(head), path)
        except CacheError as err:
            raise CacheError(path, f"file changed since index ({err.reason}); re-run index") from err
        want = (spec.file_shape(length, self._frames[index]), np.dtype(spec.dtype).newbyteorder("<"), offset)
        if (header.shape, header.dtype, header.data_offset) != want:
            raise CacheError(
                path,
                f"file changed since index (header says shape {header.shape} dtype "
                f"{header.dtype.str}, manifest says {want[0]} {want[1].str}); re-run index",
            )
        self._checked_heads[(spec.name, index)] = bytes(head)
