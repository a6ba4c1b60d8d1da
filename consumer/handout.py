"""What the library has handed out: ``Batch``, the array schema, and which taken batches count as applied.

Role: ``Handout`` is the pure bookkeeping behind ``Consumer.batches()`` and ``Consumer.as_dataset()``
(no ring, no sockets, no TensorFlow): the one iterator allowed to hand batches out (the newest;
older ones are superseded), the batch it holds unapplied, the batches to hand out again first,
and the ids applied so far. The rules it keeps are stated in consumer/README.md ("Exactly once on
the library path") and docs/design.md, invariant 3.
Invariants:
    * Applied ids are consecutive from ``start_batch``: each batch is applied once, in plan order
      (``record_applied`` raises ``RuntimeError`` otherwise; that is a bug, never a data problem).
    * Only this ``Handout``'s consumer applies or frees a batch (``Batch.owner``), and each batch's
      slot is freed once (``Batch.slot_freed``): a batch released twice, or released to another
      ``Consumer``, raises ``RuntimeError`` instead of freeing a slot that holds another batch.
    * A batch taken from the ring is exactly one of: held by the current iterator (handed out, not yet
      consumed: one for ``batches()``, up to ``consumer.stage_depth`` under a ``Stager``, up to the
      read-ahead depth for a dataset with a device prefetch stage), waiting in ``returned`` (lowest id
      first) to be handed out again, or applied.
    * Starting an iterator (``begin``) moves the batches the previous one held to ``returned``: a
      batch handed out but not consumed is handed out again, first (``returned`` stays sorted by id).
      A batch handed to an iterator that was superseded meanwhile goes to ``returned`` too.
Shutdown: nothing to release; the ring slots are the caller's (``consumer/feed.py``).
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.shared.wire.layout import PAYLOAD_COPIES

__all__ = ["Batch", "ArraySpec", "Handout", "row_mask"]


@functools.lru_cache(maxsize=1024)
def row_mask(rows: int, batch_size: int) -> npt.NDArray[np.bool_]:
    """[batch_size] bool, True for the ``rows`` real rows (they come first), False for padding rows.

    Derived from the plan (``PlannedBatch.rows``), never from the data: a row a producer left empty
    (quarantined: bad cache file, ``mel_len`` 0) is a planned row and stays True. Read-only and shared
    (one array per (rows, B)), so TensorFlow can wrap it without a copy.
    """
    mask = np.arange(batch_size) < rows
    mask.flags.writeable = False
    return mask


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One array of every batch: its name, numpy dtype name and shape in each bucket (by bucket index)."""

    name: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]


@dataclass(slots=True)
class Batch:
    """One batch in a ring slot. ``arrays`` are views valid until its slot is freed (``release``)."""

    planned: PlannedBatch                 # its identity in the plan: id, data epoch, bucket, sample ids
    # mel [B,T,M] f32, mel_len [B] i32, tokens [B,L] i32, tok_len [B] i32, then the cache's extras by name
    arrays: dict[str, npt.NDArray[Any]]
    slot: int
    copies: int = PAYLOAD_COPIES          # copies from page cache into the slot: 1 shared memory, 4 payload
    utterance_ids: tuple[str, ...] = ()   # manifest ids of the real rows, in row order
    quarantined: tuple[int, ...] = ()     # sample ids of the rows a producer left empty (bad cache file)
    quarantine_note: str = ""             # the producer's "PATH: REASON" for the first of them (escaped)
    owner: int = 0                        # the epoch of the Consumer that handed it out (no other may release it)
    slot_freed: bool = False              # its slot went back to the ring: ``arrays`` may hold another batch

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
        """Real rows, from the plan: rows ``0 .. rows - 1`` hold ``sample_ids``, the rest are padding.

        Fewer than B only in a bucket's last batch of an epoch under ``buckets.partial: pad``.
        """
        return self.planned.rows

    @property
    def row_mask(self) -> npt.NDArray[np.bool_]:
        """[B] bool, True for the real rows (``row_mask(rows, B)``; read-only)."""
        return row_mask(self.planned.rows, int(self.arrays["mel_len"].shape[0]))

    @property
    def real_frames(self) -> int:
        return int(self.arrays["mel_len"].sum())

    @property
    def padded_frames(self) -> int:
        mel = self.arrays["mel"]
        return int(mel.shape[0] * mel.shape[1])


class Handout:
    """Applied ids, the current iterator and its unapplied batch, and the batches to hand out again."""

    def __init__(self, start_batch: int, owner: int = 0) -> None:
        self._next_applied = start_batch
        self._owner = owner                  # Batch.owner of the batches this book may apply
        self._applied_ids = array("q")     # 8 bytes per applied batch
        self._returned: list[Batch] = []     # sorted by batch id, lowest first
        self._in_hand: list[Batch] = []      # held by the current iterator, unapplied, in id order
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
        for batch in self._in_hand:
            self._return(batch)
        self._in_hand = []
        return self._token

    def is_current(self, token: int) -> bool:
        return token == self._token

    def pop_returned(self) -> Batch | None:
        return self._returned.pop(0) if self._returned else None

    def hold(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` handed ``batch`` out and has not consumed it yet (superseded: returned)."""
        if self.is_current(token):
            self._in_hand.append(batch)
        else:
            self._return(batch)

    def first_held(self, token: int) -> Batch | None:
        """The oldest batch iterator ``token`` holds unconsumed (None if none, or superseded)."""
        return self._in_hand[0] if self.is_current(token) and self._in_hand else None

    def give_back(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` was dropped holding ``batch``: hand it out again, first. No-op if superseded."""
        if self.is_current(token) and any(b is batch for b in self._in_hand):
            self._in_hand = [b for b in self._in_hand if b is not batch]
            self._return(batch)

    def _return(self, batch: Batch) -> None:
        self._returned.append(batch)
        self._returned.sort(key=lambda b: b.batch_id)   # a few entries at most

    def is_applied(self, batch: Batch) -> bool:
        return batch.batch_id < self._next_applied

    def check_own(self, batch: Batch) -> None:
        """``RuntimeError`` unless ``batch`` was handed out by this book's consumer."""
        if batch.owner != self._owner:
            raise RuntimeError(f"batch {batch.batch_id} was handed out by another Consumer: release it there")

    def record_applied(self, batch: Batch) -> None:
        """``batch`` was applied; it must be this consumer's and the next id in plan order."""
        self.check_own(batch)
        if self.is_applied(batch):
            raise RuntimeError(f"batch {batch.batch_id} was already applied (released twice?)")
        if batch.batch_id != self._next_applied:
            raise RuntimeError(f"batch {batch.batch_id} applied out of order: {self._next_applied} is next")
        self._applied_ids.append(batch.batch_id)
        self._next_applied += 1
        self._in_hand = [b for b in self._in_hand if b is not batch]
        self._returned = [b for b in self._returned if b is not batch]   # released after its loop broke out

    def record_freed(self, batch: Batch) -> None:
        """``batch``'s slot goes back to the ring now; refused for another consumer's batch or a second time."""
        self.check_own(batch)
        if batch.slot_freed:
            raise RuntimeError(f"the slot of batch {batch.batch_id} was already freed (released twice?)")
        batch.slot_freed = True
