"""Consumer-side ring of preallocated, 64-byte-aligned batch slots with a reorder stage.

Each slot is FREE, LEASED (reserved for a lease; the receiver writes into it), READY (holds a
received batch, keyed by batch id) or IN_STEP (handed to the step loop). A READY slot keeps the
lease's ``PlannedBatch``, so the step reads the bucket and sample ids from it, not from the plan.
Invariant: free + leased + ready + in_step == n_slots; a lease always owns a slot, so leases
outstanding <= slots not ready or in the step, and memory never exceeds n_slots * slot_nbytes.
The receiver thread only touches FREE/LEASED slots' bytes; the step thread only READY/IN_STEP
ones, so slot memory needs no lock; state changes go through one lock.
Slot bytes come from a ``SlotMemory``: ``PrivateSlots`` (one aligned buffer, the ZeroMQ payload
path) or ``melfeed.consumer.transport.shm_slots.ShmSlots`` (one shared file per slot that producers build into).
Shutdown: ``close()`` wakes every waiter with ``ClosedError``; no wait lasts longer than its timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import numpy as np
import numpy.typing as npt

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.shared.errors import ClosedError
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.layout import PAYLOAD_COPIES, aligned_buffer, batch_layout, layout_views, slot_nbytes_for

__all__ = ["SlotState", "BatchRing", "SlotMemory", "PrivateSlots", "ReadySlot", "slot_nbytes_for"]


class SlotMemory(Protocol):
    """Where slot bytes live. ``buffer(slot)`` is 64-byte aligned and ``slot_nbytes`` long, and the
    same object on every call until the slot's memory is replaced (``ShmSlots.retire``)."""

    slot_nbytes: int

    @property
    def total_nbytes(self) -> int: ...

    def buffer(self, slot: int) -> npt.NDArray[np.uint8]: ...

    def close(self) -> None: ...


class PrivateSlots:
    """All slots in one private aligned buffer (the ZeroMQ payload path)."""

    def __init__(self, n_slots: int, slot_nbytes: int) -> None:
        self.slot_nbytes = slot_nbytes
        self._memory = aligned_buffer(n_slots * slot_nbytes)
        # One view per slot, made once: the same object every call (BatchRing caches by identity).
        self._slots = [self._memory[i * slot_nbytes : (i + 1) * slot_nbytes] for i in range(n_slots)]

    @property
    def total_nbytes(self) -> int:
        return int(self._memory.nbytes)

    def buffer(self, slot: int) -> npt.NDArray[np.uint8]:
        return self._slots[slot]

    def close(self) -> None:
        """Nothing to release: the buffer goes with its last view."""


@dataclass(frozen=True, slots=True)
class ReadySlot:
    """A slot holding a received batch: which slot, which planned batch, and how it was filled."""

    slot: int
    planned: PlannedBatch
    copies: int  # copies from page cache into the slot: 1 shared memory, PAYLOAD_COPIES payload
    quarantined: tuple[int, ...] = ()  # its sample ids the producer left empty (bad cache file)
    quarantine_note: str = ""  # the producer's "PATH: REASON" of the first of them (escaped)


class SlotState(IntEnum):
    FREE = 0
    LEASED = 1
    READY = 2
    IN_STEP = 3


class BatchRing:
    """Fixed set of aligned slots; the receiver fills them, the step loop takes them in id order.

    Args:
        n_slots: number of slots (>= 3: filling, ready, in the step).
        buckets: every bucket shape a slot must be able to hold.
        on_release: called (from the releasing thread) after a slot becomes FREE; the receiver
            uses it to wake its poll loop so it can lease the slot again.
        memory: slot bytes; ``None`` = a private aligned buffer. Its ``slot_nbytes`` must be
            ``slot_nbytes_for(buckets)``.
    """

    def __init__(
        self,
        n_slots: int,
        buckets: tuple[Bucket, ...],
        on_release: Callable[[], None] | None = None,
        memory: SlotMemory | None = None,
    ) -> None:
        if n_slots < 1:
            raise ValueError("n_slots must be >= 1")
        self.slot_nbytes = slot_nbytes_for(buckets)
        self.memory: SlotMemory = memory if memory is not None else PrivateSlots(n_slots, self.slot_nbytes)
        if self.memory.slot_nbytes != self.slot_nbytes:
            raise ValueError(f"slot memory has {self.memory.slot_nbytes} bytes per slot, need {self.slot_nbytes}")
        self._layouts = {b.index: batch_layout(b) for b in buckets}
        # (slot, bucket) -> (the slot buffer they view, the views): built once, not per batch and side.
        self._views: dict[tuple[int, int], tuple[npt.NDArray[np.uint8], dict[str, npt.NDArray[np.generic]]]] = {}
        self._state = [SlotState.FREE] * n_slots
        self._ready: dict[int, ReadySlot] = {}  # batch id -> its READY slot
        self._cond = threading.Condition()
        self._closed = False
        self._on_release = on_release
        self.n_slots = n_slots

    @property
    def total_nbytes(self) -> int:
        return self.memory.total_nbytes

    def views(self, slot: int, bucket: int) -> dict[str, npt.NDArray[np.generic]]:
        """Aligned array views of ``slot`` laid out for ``bucket``; valid while the slot is held.

        Built once per (slot, bucket) and slot memory (a retired slot's new file gets new views; the
        old ones are dropped at once, so the cache never keeps an orphaned mapping alive). Each call
        returns a new dict of the cached arrays, so a caller that changes its dict changes no other.
        Any thread may call it: a stale read of the cache at worst builds the views again.
        """
        buf = self.memory.buffer(slot)
        key = (slot, bucket)
        hit = self._views.get(key)
        if hit is not None and hit[0] is buf:
            return dict(hit[1])
        if hit is not None:  # the slot's memory was replaced: forget all its views
            for stale in [k for k in list(self._views) if k[0] == slot]:  # list(): atomic copy
                self._views.pop(stale, None)
        views = layout_views(buf, 0, self._layouts[bucket])
        self._views[key] = (buf, views)
        return dict(views)

    # --- receiver side -------------------------------------------------------------------
    def reserve(self) -> int | None:
        """FREE -> LEASED; returns the slot or ``None`` when none is free."""
        with self._cond:
            for i, s in enumerate(self._state):
                if s is SlotState.FREE:
                    self._state[i] = SlotState.LEASED
                    return i
        return None

    def cancel(self, slot: int) -> None:
        """LEASED -> FREE (the lease was revoked before its batch arrived)."""
        with self._cond:
            self._expect(slot, SlotState.LEASED)
            self._state[slot] = SlotState.FREE

    def mark_ready(
        self,
        slot: int,
        planned: PlannedBatch,
        copies: int = PAYLOAD_COPIES,
        quarantined: tuple[int, ...] = (),
        quarantine_note: str = "",
    ) -> None:
        """LEASED -> READY: the slot now holds ``planned``, filled with ``copies`` copies; ``quarantined``:
        its rows left empty (``ReadySlot``)."""
        with self._cond:
            self._expect(slot, SlotState.LEASED)
            self._state[slot] = SlotState.READY
            self._ready[planned.batch_id] = ReadySlot(slot, planned, copies, quarantined, quarantine_note)
            self._cond.notify_all()

    # --- step side -------------------------------------------------------------------------
    def take(self, batch_id: int, timeout_s: float) -> ReadySlot | None:
        """Wait up to ``timeout_s`` for batch ``batch_id``; READY -> IN_STEP.

        Returns:
            The slot with its planned batch, or ``None`` on timeout.
        Raises:
            ClosedError: the ring was closed.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while batch_id not in self._ready:
                if self._closed:
                    raise ClosedError("ring closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            ready = self._ready.pop(batch_id)
            self._state[ready.slot] = SlotState.IN_STEP
            return ready

    def release(self, slot: int) -> None:
        """IN_STEP -> FREE once the step that read the slot has finished."""
        with self._cond:
            self._expect(slot, SlotState.IN_STEP)
            self._state[slot] = SlotState.FREE
        if self._on_release is not None:
            self._on_release()

    def counts(self) -> dict[SlotState, int]:
        with self._cond:
            return {s: self._state.count(s) for s in SlotState}

    def ready_ids(self) -> list[int]:
        with self._cond:
            return sorted(self._ready)

    def close(self) -> None:
        """Wake every waiter with ``ClosedError``. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _expect(self, slot: int, state: SlotState) -> None:
        if self._state[slot] is not state:
            raise ValueError(f"slot {slot} is {self._state[slot].name}, expected {state.name}")
