"""Builds one leased batch straight into a reusable, aligned send buffer.

Each row is read from the cache with one ``preadv`` into its place in the buffer (no per-file
``np.load`` + copy); only the padding tail of a row is zeroed. Buffers are sent zero-copy
(``copy=False``), so a buffer is reused only after ZeroMQ reports it done (``MessageTracker``).
On the same-host shared-memory path the caller passes ``target`` (views of the consumer's ring slot)
and the batch is built there instead: no send buffer at all. The cache's extra arrays (the batch
schema, ``shared/wire/schema.py``) are read the same way, row by row into their place
(``producer/extra_reader.py``), a sequence extra's length into ``<name>_len``.
Invariant: at most ``max_buffers`` buffers per bucket exist; a build never blocks longer than
``reuse_timeout_s`` waiting for one.
Quarantine (``bad_sample_policy="quarantine"``): a row whose file is bad is left empty (length 0)
and reported in the header, the same decision on every producer because it depends only on the
file; ``"fail"`` raises ``CacheError`` naming the file. ``TransientReadError`` (out of fds or
memory) says nothing about the file, so it is raised under either policy, never quarantined.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import zmq

from producer.extra_reader import ExtraReader
from producer.reader import CacheReader, TransientReadError
from shared.wire.buckets import BucketSet
from shared.errors import CacheError
from shared.wire.layout import aligned_buffer, batch_layout, layout_nbytes, layout_views

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
    arrays: dict[str, npt.NDArray[np.generic]]     # views into a send buffer, wire order
    quarantined: list[int] = field(default_factory=list)   # sample ids left empty
    buffer: _Buffer | None = None

    def attach(self, tracker: zmq.MessageTracker | None) -> None:
        """Record the send's tracker so the buffer is not reused before ZeroMQ is done with it."""
        if self.buffer is not None:
            self.buffer.tracker = tracker


class BatchAssembler:
    def __init__(self, reader: CacheReader, bucket_set: BucketSet, *, max_buffers: int = 4,
                 reuse_timeout_s: float = 1.0, bad_sample_policy: str = "quarantine") -> None:
        self._reader = reader
        self._extras = (ExtraReader(reader.manifest, getattr(reader, "open_files", None))
                        if reader.manifest.extras else None)
        self._buckets = bucket_set.buckets
        self._layouts = {b.index: batch_layout(b) for b in self._buckets}
        self._pools: dict[int, list[_Buffer]] = {b.index: [] for b in self._buckets}
        self._max_buffers = max_buffers
        self._reuse_timeout_s = reuse_timeout_s
        self._policy = bad_sample_policy
        self._quarantined_ids: set[int] = set()   # warned about once each; repeats log at DEBUG
        self.read_s_total = 0.0                   # seconds in the cache reads (the producer's stage counters)

    def build(self, batch_id: int, bucket: int, sample_ids: list[int],
              target: dict[str, npt.NDArray[np.generic]] | None = None) -> BuiltBatch:
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
        mel, mel_len = arrays["mel"], arrays["mel_len"]
        tokens, tok_len = arrays["tokens"], arrays["tok_len"]
        quarantined: list[int] = []
        read_mel, read_tokens = self._reader.read_mel_into, self._reader.read_tokens_into
        t0 = time.perf_counter()            # one clock pair per batch: the loop is the reads
        try:
            for row, sid in enumerate(sample_ids):
                try:
                    mel_len[row] = read_mel(sid, mel[row])
                    tok_len[row] = read_tokens(sid, tokens[row])
                    if self._extras is not None:
                        self._read_extras(sid, row, arrays)
                except TransientReadError:
                    raise
                except CacheError as err:
                    if self._policy == "fail":
                        raise
                    self._log_quarantine(sid, batch_id, err)
                    mel[row] = 0
                    tokens[row] = 0
                    mel_len[row] = tok_len[row] = 0
                    for key in self._extra_keys():
                        arrays[key][row] = 0
                    quarantined.append(sid)
        finally:
            self.read_s_total += time.perf_counter() - t0
        n = len(sample_ids)
        if n < spec.batch_size:                        # padding rows of a bucket's last batch
            mel[n:] = 0
            tokens[n:] = 0
            mel_len[n:] = 0
            tok_len[n:] = 0
            for key in self._extra_keys():
                arrays[key][n:] = 0
        return BuiltBatch(batch_id, bucket, arrays, quarantined, buf)

    def _read_extras(self, sid: int, row: int, arrays: dict[str, npt.NDArray[np.generic]]) -> None:
        """Each extra of sample ``sid`` into its row (and a sequence's length into ``<name>_len``)."""
        assert self._extras is not None
        for spec in self._extras.specs:
            whole = arrays[spec.name]
            n = self._extras.read_into(spec.name, sid, whole[row:row + 1].reshape(whole.shape[1:]))
            if spec.length_key is not None:
                arrays[spec.length_key][row] = n

    def _extra_keys(self) -> list[str]:
        """Batch keys the extras own (a sequence's ``<name>_len`` included)."""
        if self._extras is None:
            return []
        return [k for s in self._extras.specs for k in (s.name, s.length_key) if k is not None]

    def close(self) -> None:
        """Close the reader's kept cache descriptors (``producer.open_files``). Idempotent."""
        close = getattr(self._reader, "close", None)    # duck-typed readers (the probe's) may have none
        if close is not None:
            close()

    def _log_quarantine(self, sid: int, batch_id: int, err: CacheError) -> None:
        """WARNING the first time this process quarantines ``sid``; each epoch repeats it at DEBUG."""
        if sid in self._quarantined_ids:
            log.debug("quarantined sample=%d batch=%d again: %s", sid, batch_id, err)
            return
        self._quarantined_ids.add(sid)
        log.warning("quarantined sample=%d batch=%d (row left empty; %d distinct so far): %s",
                    sid, batch_id, len(self._quarantined_ids), err)

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
