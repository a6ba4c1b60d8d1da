"""Builds one leased batch straight into a reusable, aligned send buffer.

Each row is read from the cache with one ``preadv`` into its place in the buffer (no per-file
``np.load`` + copy); only the padding tail of a row is zeroed. Buffers are sent zero-copy
(``copy=False``), so a buffer is reused only after ZeroMQ reports it done (``MessageTracker``).
On the same-host shared-memory path the caller passes ``target`` (views of the consumer's ring slot)
and the batch is built there instead: no send buffer at all. The cache's extra arrays (the batch
schema, ``shared/wire/schema.py``) are read the same way, row by row into their place
(``producer/extra_reader.py``), a sequence extra's length into ``<name>_len``. Given a packed cache
(``pack``, ``producer/pack/reader.py``), a row's arrays come from it instead (copied out of its mapping), same bytes.
No ``bucket_set`` (a producer that learns its plan in the handshake): no shapes until ``use_buckets``.
Invariant: at most ``max_buffers`` buffers per bucket exist; a build never blocks longer than
``reuse_timeout_s`` waiting for one.
Quarantine (``bad_sample_policy="quarantine"``): a row whose file is bad is left empty (length 0)
and reported in the header (its sample id; the first such row's ``PATH: REASON`` too, so the consumer
can name it when quarantined rows stop the run), the same decision on every producer because it depends
only on the file; ``"fail"`` raises ``CacheError`` naming the file. ``TransientReadError`` (out of fds or
memory) says nothing about the file, so it is raised under either policy, never quarantined.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import zmq

from melfeed.producer.batch_rows import RowBytes, zero_bytes
from melfeed.producer.extra_reader import ExtraReader
from melfeed.producer.reader import CacheReader, TransientReadError
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.buckets import Bucket, BucketSet, apply_rows
from melfeed.shared.wire.layout import aligned_buffer, batch_layout, layout_nbytes, layout_views

if TYPE_CHECKING:
    from melfeed.producer.pack.reader import PackReader

__all__ = ["BuiltBatch", "BatchAssembler"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Buffer:
    arrays: dict[str, npt.NDArray[np.generic]]
    tracker: zmq.MessageTracker | None = None


@dataclass(slots=True)
class BuiltBatch:
    batch_id: int
    bucket: int
    arrays: dict[str, npt.NDArray[np.generic]]  # views into a send buffer, wire order
    quarantined: list[int] = field(default_factory=list)  # sample ids left empty
    buffer: _Buffer | None = None
    quarantine_note: str = ""  # the first quarantined row's "PATH: REASON" (BatchHeader.quarantine_note)

    def attach(self, tracker: zmq.MessageTracker | None) -> None:
        """Record the send's tracker so the buffer is not reused before ZeroMQ is done with it."""
        if self.buffer is not None:
            self.buffer.tracker = tracker


class BatchAssembler:
    def __init__(
        self,
        reader: CacheReader,
        bucket_set: BucketSet | None,
        *,
        max_buffers: int = 4,
        reuse_timeout_s: float = 1.0,
        bad_sample_policy: str = "quarantine",
        pack: PackReader | None = None,
    ) -> None:
        self._reader = reader
        self._pack = pack  # a packed cache: rows copied from it (producer/pack/reader.py)
        self._extras = (
            ExtraReader(reader.manifest, getattr(reader, "open_files", None)) if reader.manifest.extras else None
        )
        self._length_keys = tuple(s.length_key for s in self._extras.specs) if self._extras is not None else ()
        self.use_buckets(bucket_set.buckets if bucket_set is not None else ())
        self._max_buffers = max_buffers
        self._reuse_timeout_s = reuse_timeout_s
        self._policy = bad_sample_policy
        self._quarantined_ids: set[int] = set()  # warned about once each; repeats log at DEBUG
        self.read_s_total = 0.0  # seconds in the cache reads (the producer's stage counters)

    def use_buckets(self, buckets: tuple[Bucket, ...]) -> None:
        """Build these shapes from now on (a plan learned in the handshake): the pools start empty.

        A buffer ZeroMQ still sends stays alive with its frames; none is reused for the new shapes.
        """
        self._buckets = buckets
        self._layouts = {b.index: batch_layout(b) for b in buckets}
        # One zero buffer as long as the longest row of any array: padding tails are copied from it.
        self._zeros = zero_bytes(
            max(
                (
                    int(np.prod(shape[1:])) * dtype.itemsize
                    for layout in self._layouts.values()
                    for _, _, shape, dtype in layout
                ),
                default=0,
            )
        )
        self._pools: dict[int, list[_Buffer]] = {b.index: [] for b in buckets}

    def use_rows(self, rows: list[int]) -> None:
        """Build every bucket with ``rows`` rows from now on (learned in the handshake): ``use_buckets`` of the same
        shapes with those rows."""
        self.use_buckets(apply_rows(self._buckets, rows))

    def build(
        self,
        batch_id: int,
        bucket: int,
        sample_ids: list[int],
        target: dict[str, npt.NDArray[np.generic]] | None = None,
    ) -> BuiltBatch:
        """Read the leased samples into ``target`` (a slot's views) or a free buffer of ``bucket``'s shape.

        Raises:
            ValueError: a bucket or sample count that cannot be right (a lease from a consumer
                configured differently; the handshake should have caught it).
            CacheError: a bad file under the ``fail`` policy; ``TransientReadError`` under either.
        """
        if not 0 <= bucket < len(self._buckets):
            raise ValueError(f"lease names bucket {bucket}, have {len(self._buckets)}")
        spec = self._buckets[bucket]
        if len(sample_ids) > spec.batch_size:
            raise ValueError(f"lease has {len(sample_ids)} samples, bucket holds {spec.batch_size}")
        buf = self._free_buffer(bucket) if target is None else None
        arrays = target if target is not None else buf.arrays  # type: ignore[union-attr]
        n = len(sample_ids)
        quarantined: list[int] = []
        note = ""
        reader, zeros = self._reader, self._zeros
        read_mel, read_tokens = reader.read_mel_row, reader.read_tokens_row
        mel_rows, tok_rows = reader.mel_rows(arrays["mel"], zeros), reader.token_rows(arrays["tokens"], zeros)
        extras = self._extra_rows(arrays, n)
        read_extra = self._extras.read_row if self._extras is not None else None
        pack = self._pack
        if pack is not None:
            if mel_rows.dtype_name != pack.mel_dtype:
                raise ValueError(f"the pack holds {pack.mel_dtype} mels, the batch is {mel_rows.dtype_name}")
            pack.check_intact()  # a pack cut in place: restart (TransientReadError), never a SIGBUS
        mel_lens, tok_lens = [0] * n, [0] * n  # written once per batch, not one numpy store per row
        t0 = time.perf_counter()  # one clock pair per batch: the loop is the reads
        try:
            for row, sid in enumerate(sample_ids):
                try:
                    if pack is not None:  # the whole row in one read (sequence extras' lengths set)
                        mel_lens[row], tok_lens[row] = pack.read_row(sid, mel_rows, tok_rows, extras, row)
                        continue
                    mel_lens[row] = read_mel(sid, mel_rows, row)
                    tok_lens[row] = read_tokens(sid, tok_rows, row)
                    for name, rows, lens in extras:
                        kept = read_extra(name, sid, rows, row)  # type: ignore[misc]
                        if lens is not None:
                            lens[row] = kept
                except TransientReadError:
                    raise
                except CacheError as err:
                    if self._policy == "fail":
                        raise
                    self._log_quarantine(sid, batch_id, err)
                    note = note or str(err)
                    mel_lens[row] = tok_lens[row] = 0
                    for _, rows, lens in extras:
                        rows.array[row] = 0
                        if lens is not None:
                            lens[row] = 0
                    mel_rows.array[row] = 0
                    tok_rows.array[row] = 0
                    quarantined.append(sid)
        finally:
            self.read_s_total += time.perf_counter() - t0
        arrays["mel_len"][:n] = mel_lens
        arrays["tok_len"][:n] = tok_lens
        for (_, _, lens), key in zip(extras, self._length_keys):
            if lens is not None and key is not None:
                arrays[key][:n] = lens
        if n < spec.batch_size:  # padding rows of a bucket's last batch
            for key in arrays:
                arrays[key][n:] = 0
        return BuiltBatch(batch_id, bucket, arrays, quarantined, buf, note)

    def _extra_rows(
        self, arrays: dict[str, npt.NDArray[np.generic]], n: int
    ) -> list[tuple[str, RowBytes, list[int] | None]]:
        """Per extra: its name, its batch array as ``RowBytes`` and, for a sequence, its ``n`` row lengths."""
        if self._extras is None:
            return []
        return [
            (
                s.name,
                self._extras.rows_of(s.name, arrays[s.name], self._zeros),
                [0] * n if s.length_key is not None else None,
            )
            for s in self._extras.specs
        ]

    def close(self) -> None:
        """Close the reader's kept cache descriptors (``producer.open_files``) and the pack's. Idempotent."""
        close = getattr(self._reader, "close", None)  # duck-typed readers (the probe's) may have none
        if close is not None:
            close()
        if self._pack is not None:
            self._pack.close()

    def _log_quarantine(self, sid: int, batch_id: int, err: CacheError) -> None:
        """WARNING the first time this process quarantines ``sid``; each epoch repeats it at DEBUG."""
        if sid in self._quarantined_ids:
            log.debug("quarantined sample=%d batch=%d again: %s", sid, batch_id, err)
            return
        self._quarantined_ids.add(sid)
        log.warning(
            "quarantined sample=%d batch=%d (row left empty; %d distinct so far): %s",
            sid,
            batch_id,
            len(self._quarantined_ids),
            err,
        )

    def _free_buffer(self, bucket: int) -> _Buffer:
        pool = self._pools[bucket]
        for buf in pool:
            if buf.tracker is None or buf.tracker.done:
                return buf
        if len(pool) < self._max_buffers:
            layout = self._layouts[bucket]
            buf = _Buffer(layout_views(aligned_buffer(layout_nbytes(self._buckets[bucket])), 0, layout))
            pool.append(buf)
            return buf
        oldest = pool[0]
        try:
            if oldest.tracker is not None:
                oldest.tracker.wait(self._reuse_timeout_s)
            return oldest
        except zmq.NotDone:
            # ZeroMQ still holds it (peer gone, message queued): let it keep that buffer and
            # replace it, so memory stays bounded by max_buffers live buffers we can reach.
            pool.pop(0)
            layout = self._layouts[bucket]
            buf = _Buffer(layout_views(aligned_buffer(layout_nbytes(self._buckets[bucket])), 0, layout))
            pool.append(buf)
            return buf
