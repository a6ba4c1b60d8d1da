"""What the library has handed out: ``Batch``, the array schema, and which taken batches count as applied.

Role: ``Handout`` is the pure bookkeeping behind ``Consumer.batches()`` and ``Consumer.as_dataset()``
(no ring, no sockets, no TensorFlow): the one iterator allowed to hand batches out (the newest;
older ones are superseded), the batch it holds unapplied, the batches to hand out again first,
and the ids applied so far. The rules it keeps are stated in consumer/README.md ("Exactly once on
the library path") and docs/ARCHITECTURE.md, invariant 3.
Invariants:
    * Applied ids are consecutive from ``start_batch``: each batch is applied once, in plan order
      (``record_applied`` raises ``RuntimeError`` otherwise; that is a bug, never a data problem).
    * A batch taken from the ring is exactly one of: held by the current iterator, waiting in
      ``returned`` (lowest id first) to be handed out again, or applied.
    * Starting an iterator (``begin``) moves the batch the previous one held to the front of
      ``returned``: a batch handed out but not consumed is handed out again, first.
Shutdown: nothing to release; the ring slots are the caller's (``consumer/feed.py``).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from consumer.flow.plan import PlannedBatch
from shared.wire.layout import PAYLOAD_COPIES

__all__ = ["Batch", "ArraySpec", "Handout"]


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One array of every batch: its name, numpy dtype name and shape in each bucket (by bucket index)."""

    name: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]


@dataclass(slots=True)
class Batch:
    """One batch in a ring slot. ``arrays`` are views valid until the batch is released."""

    planned: PlannedBatch                 # its identity in the plan: id, data epoch, bucket, sample ids
    # mel [B,T,M] f32, mel_len [B] i32, tokens [B,L] i32, tok_len [B] i32, then the cache's extras by name
    arrays: dict[str, npt.NDArray[Any]]
    slot: int
    copies: int = PAYLOAD_COPIES          # copies from page cache into the slot: 1 shared memory, 4 payload
    utterance_ids: tuple[str, ...] = ()   # manifest ids of the real rows, in row order

    @property
    def batch_id(self) -> int:
        return self.planned.batch_id

    @property
    def bucket(self) -> int:
        """Index into ``Consumer.bucket_set.buckets``."""
        return self.planned.bucket

    @property
    def sample_ids(self) -> tuple[int, ...]:
        """Manifest indices of the real rows, in row order."""
        return self.planned.sample_ids

    @property
    def rows(self) -> int:
        """Real (non-padding) rows."""
        return int(np.count_nonzero(self.arrays["mel_len"]))

    @property
    def real_frames(self) -> int:
        return int(self.arrays["mel_len"].sum())

    @property
    def padded_frames(self) -> int:
        mel = self.arrays["mel"]
        return int(mel.shape[0] * mel.shape[1])


class Handout:
    """Applied ids, the current iterator and its unapplied batch, and the batches to hand out again."""

    def __init__(self, start_batch: int) -> None:
        self._next_applied = start_batch
        self._applied_ids = array("q")     # 8 bytes per applied batch
        self._returned: deque[Batch] = deque()
        self._in_hand: Batch | None = None
        self._token = 0

    @property
    def applied(self) -> int:
        return len(self._applied_ids)

    @property
    def applied_ids(self) -> list[int]:
        return self._applied_ids.tolist()

    @property
    def has_returned(self) -> bool:
        return bool(self._returned)

    def begin(self) -> int:
        """A new iterator takes over; returns its token. The batch the previous one held comes back first."""
        self._token += 1
        if self._in_hand is not None:
            self._returned.appendleft(self._in_hand)   # lower than any still returned: those came first
            self._in_hand = None
        return self._token

    def is_current(self, token: int) -> bool:
        return token == self._token

    def pop_returned(self) -> Batch | None:
        return self._returned.popleft() if self._returned else None

    def hold(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` handed ``batch`` out and has not consumed it yet."""
        if self.is_current(token):
            self._in_hand = batch

    def give_back(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` was dropped holding ``batch``: hand it out again, first. No-op if superseded."""
        if self.is_current(token) and self._in_hand is batch:
            self._in_hand = None
            self._returned.appendleft(batch)

    def record_applied(self, batch: Batch) -> None:
        """``batch`` was applied; it must be the next id in plan order."""
        if batch.batch_id != self._next_applied:
            raise RuntimeError(f"batch {batch.batch_id} applied out of order: {self._next_applied} is next")
        self._applied_ids.append(batch.batch_id)
        self._next_applied += 1
        if self._in_hand is batch:
            self._in_hand = None
