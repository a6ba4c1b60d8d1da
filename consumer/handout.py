"""What the library has handed out: ``Batch``, the array schema, and which taken batches count as applied.

Role: ``Handout`` is the pure book (no ring, no sockets, no TensorFlow): the one iterator allowed to hand
batches out (the newest; others are superseded), the batches it holds unapplied, the batches to hand out
again first, and the ids applied so far. ``HandoutDesk`` is the hand-out protocol over that book, the one
object ``Consumer.batches()`` / ``next_batch()`` / ``release()``, a ``Stager`` (consumer/staging.py) and
``as_dataset()`` (consumer/dataset.py) talk to: iterator tokens, holds, a dataset's read-ahead and held slot,
applied batches (recorded here only; the receiver is told) and freed slots; its consumer owns it and hands it
the ring and the receiver as ``HandoutPorts``. Rules: docs/guide/your-model.md ("A loop of your own") and
docs/design.md, invariant 3.
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
Threads: the desk's iterator, hold and slot changes take its lock, so a dataset's finalizer, TensorFlow's
read-ahead hook and the caller's thread may call it at once.
Shutdown: nothing to release; the ring slots are the caller's (``consumer/feed.py``).
"""

from __future__ import annotations

import functools
import logging
import threading
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.shared.errors import ClosedError
from melfeed.shared.wire.layout import PAYLOAD_COPIES

__all__ = ["Batch", "ArraySpec", "Handout", "HandoutDesk", "HandoutPorts", "row_mask"]

log = logging.getLogger(__name__)

_WAITING_LOG_S = 10.0  # a starved loop says so this often, not at every bounded wait
_SUPERSEDED = "this iterator was superseded by a newer batches() / as_dataset() iterator"


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

    planned: PlannedBatch  # its identity in the plan: id, data epoch, bucket, sample ids
    # mel [B,T,M] f32, mel_len [B] i32, tokens [B,L] i32, tok_len [B] i32, then the cache's extras by name
    arrays: dict[str, npt.NDArray[Any]]
    slot: int
    copies: int = PAYLOAD_COPIES  # copies from page cache into the slot: 1 shared memory, 4 payload
    utterance_ids: tuple[str, ...] = ()  # manifest ids of the real rows, in row order
    quarantined: tuple[int, ...] = ()  # sample ids of the rows a producer left empty (bad cache file)
    quarantine_note: str = ""  # the producer's "PATH: REASON" for the first of them (escaped)
    owner: int = 0  # the run id of the Consumer that handed it out (no other may release it)
    slot_freed: bool = False  # its slot went back to the ring: ``arrays`` may hold another batch

    @property
    def batch_id(self) -> int:
        return self.planned.batch_id

    @property
    def bucket(self) -> int:
        """Index into ``Consumer.bucket_shapes`` (one bucket each)."""
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
        self._owner = owner  # Batch.owner of the batches this book may apply
        self._applied_ids = array("q")  # 8 bytes per applied batch
        self._returned: list[Batch] = []  # sorted by batch id, lowest first
        self._in_hand: list[Batch] = []  # held by the current iterator, unapplied, in id order
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
        self._returned.sort(key=lambda b: b.batch_id)  # a few entries at most

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
        self._returned = [b for b in self._returned if b is not batch]  # released after its loop broke out

    def record_freed(self, batch: Batch) -> None:
        """``batch``'s slot goes back to the ring now; refused for another consumer's batch or a second time."""
        self.check_own(batch)
        if batch.slot_freed:
            raise RuntimeError(f"the slot of batch {batch.batch_id} was already freed (released twice?)")
        batch.slot_freed = True


@dataclass(frozen=True, slots=True)
class HandoutPorts:
    """What a desk needs of its consumer, as callables: the desk holds no ring, socket or thread of its own."""

    check_usable: Callable[[], None]  # raises: closed, not started, the receiver or producer group failed
    take: Callable[[int, float], Batch | None]  # (batch id, timeout_s) -> that batch from the ring, None if late
    free_slot: Callable[[int], None]  # a ring slot goes back to the ring
    applied: Callable[[int, bool], None]  # (batch id, wake): the receiver hears that it was applied
    producers_alive: Callable[[], int]
    wait_timeout_s: float  # one bounded wait of ``wait_next`` (``consumer.wait_timeout_s``)


class HandoutDesk:
    """The hand-out protocol of one consumer: take in plan order, hold, give back, apply, free (module docstring).

    Args:
        start_batch, end_batch: the first batch id to apply (a resume position); the plan position to stop at
            (None: endless).
        owner: the consumer's run id (``Batch.owner``): no other consumer's batch is applied or freed here.
        ports: the consumer's ring and receiver.
    """

    def __init__(self, start_batch: int, end_batch: int | None, owner: int, ports: HandoutPorts) -> None:
        self._book = Handout(start_batch, owner)
        self._ports = ports
        self.end_batch = end_batch
        self.next_id = start_batch  # the id of the next batch taken from the ring
        self._held: Batch | None = None  # applied, its slot kept until the next element (a dataset)
        self._lock = threading.Lock()

    @property
    def applied(self) -> int:
        return self._book.applied

    @property
    def applied_ids(self) -> list[int]:
        return self._book.applied_ids

    @property
    def finished(self) -> bool:
        """The plan's end was reached and nothing handed out waits to be handed out again."""
        return self.end_batch is not None and self.next_id >= self.end_batch and not self._book.has_returned

    @property
    def has_returned(self) -> bool:
        return self._book.has_returned

    def next_batch(self, timeout_s: float) -> Batch | None:
        """A batch given back first, else the next in plan order (None: late); ``ClosedError`` at the plan's end."""
        self._ports.check_usable()
        again = self._book.pop_returned()
        if again is not None:
            return again
        if self.finished:
            raise ClosedError("all planned batches were applied")
        batch = self._ports.take(self.next_id, timeout_s)
        if batch is not None:
            self.next_id += 1
        return batch

    def wait_next(
        self, token: int, stop: threading.Event | None = None, on_wait: Callable[[int], None] | None = None
    ) -> Batch | None:
        """The next batch for iterator ``token``, waiting in bounded steps; ``None`` when the plan ended, ``stop``
        was set or the consumer was closed. ``on_wait(producers_alive)`` runs after every bounded wait that
        brought no batch (``consumer.wait_timeout_s``): the loop is alive though starved (sd_notify watchdog, status).

        Raises:
            RuntimeError: a newer iterator superseded ``token``.
            PipelineError: the receiver thread failed, or the owned producer group exited.
        """
        wait_s = self._ports.wait_timeout_s
        waited_s = 0.0
        while not self.finished and not (stop is not None and stop.is_set()):
            if not self.is_current(token):
                raise RuntimeError(_SUPERSEDED)
            try:
                batch = self.next_batch(wait_s)
            except ClosedError:
                return None
            if batch is not None:
                return batch
            if on_wait is not None:
                on_wait(self._ports.producers_alive())
            waited_s += wait_s
            if waited_s >= _WAITING_LOG_S:
                log.info("waiting for batch %d: producers alive=%d", self.next_id, self._ports.producers_alive())
                waited_s = 0.0
        return None

    def take_ready(self, token: int) -> Batch | None:
        """The next batch for iterator ``token`` if the ring holds it now (never waits); ``None`` when it has not
        arrived, at the plan's end or when the consumer was closed (``wait_next`` then says which)."""
        if not self.is_current(token):
            raise RuntimeError(_SUPERSEDED)
        try:
            return self.next_batch(0.0)
        except ClosedError:
            return None

    def iterate(self, stop: threading.Event | None, on_wait: Callable[[int], None] | None) -> Iterator[Batch]:
        """``Consumer.batches()``: a new iterator; each batch applied and freed when the next is asked for."""
        return self._iterate(self.begin(), stop, on_wait)

    def _iterate(
        self, token: int, stop: threading.Event | None, on_wait: Callable[[int], None] | None
    ) -> Iterator[Batch]:
        while True:
            batch = self.wait_next(token, stop, on_wait)
            if batch is None:
                return
            self.hold(token, batch)
            try:
                yield batch
            except BaseException:  # GeneratorExit (break, dropped) or an error thrown in
                self.give_back(token, batch)
                raise
            if not self.is_current(token):  # a newer iterator took this batch over: it is not applied
                raise RuntimeError(_SUPERSEDED)
            if not self._book.is_applied(batch):  # the loop body may have called release(batch)
                self.mark_applied(batch, wake=False)
            if not batch.slot_freed:
                self.free_slot(batch)

    def begin(self) -> int:
        """Start a new hand-out iterator (superseding any older one); returns its token. The slot a superseded
        dataset iterator still holds is freed here: a ``fit`` that ended never reads it again (a Keras iterator
        may be collected late, and would otherwise keep a ring slot until then)."""
        with self._lock:
            self._free_held()
            return self._book.begin()

    def is_current(self, token: int) -> bool:
        return self._book.is_current(token)

    def hold(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` handed ``batch`` out, unapplied: if the iterator ends without it, it comes back."""
        with self._lock:
            self._book.hold(token, batch)

    def give_back(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` ends without applying ``batch`` (slot still held): handed out again, first."""
        with self._lock:
            self._book.give_back(token, batch)

    def release(self, batch: Batch) -> None:
        """The step that read ``batch`` has finished: count it applied and free its slot."""
        self.mark_applied(batch, wake=False)  # the release wakes the receiver if that helps
        self.free_slot(batch)

    def mark_applied(self, batch: Batch, wake: bool = True) -> None:
        """Count ``batch`` applied (the next id in plan order); its slot stays held. ``wake=False`` (``release``):
        no wake of its own, except for the plan's last batch (its ``done`` heartbeat should not wait)."""
        self._book.record_applied(batch)
        last = self.end_batch is not None and batch.batch_id + 1 >= self.end_batch
        self._ports.applied(batch.batch_id, wake or last)

    def free_slot(self, batch: Batch) -> None:
        """Give ``batch``'s slot back to the ring (its arrays are invalid from here on)."""
        self._book.record_freed(batch)  # never twice: the slot may hold another batch by now
        self._ports.free_slot(batch.slot)

    # --- a dataset's element: applied when handed out, its slot held to the next ------------------
    def apply_and_hold(self, batch: Batch) -> None:
        """Count ``batch`` applied and keep its slot until ``free_held_slot`` or a newer iterator starts."""
        with self._lock:
            self._apply_and_hold(batch)

    def _apply_and_hold(self, batch: Batch) -> None:
        self._free_held()
        self.mark_applied(batch)
        self._held = batch

    def free_held_slot(self, batch: Batch) -> None:
        """Free the slot ``apply_and_hold`` kept for ``batch``, unless a newer iterator already did."""
        with self._lock:
            if self._held is batch:
                self._free_held()

    def _free_held(self) -> None:
        if self._held is not None:
            self.free_slot(self._held)
            self._held = None

    # --- a dataset's device read-ahead: held (``hold``) until the caller takes the element -------
    def consume_read_ahead(self, token: int, batch_id: int, keep_slot: bool) -> None:
        """The caller of iterator ``token`` took batch ``batch_id`` out of the read-ahead stage: apply it.

        ``keep_slot``: the element still reads the slot (host stage), so it is freed at the next consumption or
        iterator; else (copied to a device) now. A superseded iterator's elements are handed out again.
        """
        with self._lock:
            batch = self._book.first_held(token)
            if batch is None or batch.batch_id != batch_id:
                return
            if keep_slot:
                self._apply_and_hold(batch)
            else:
                self.mark_applied(batch)
                self.free_slot(batch)
