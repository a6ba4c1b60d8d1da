"""Consumer-side ring of preallocated, 64-byte-aligned batch slots with a reorder stage.

Each slot is FREE, LEASED (reserved for a lease; the receiver writes into it), READY (holds a
received batch, keyed by batch id) or IN_STEP (handed to the step loop).
Invariant: free + leased + ready + in_step == n_slots; a lease always owns a slot, so leases
outstanding <= slots not ready or in the step, and memory never exceeds n_slots * slot_nbytes.
The receiver thread only touches FREE/LEASED slots' bytes; the step thread only READY/IN_STEP
ones, so slot memory needs no lock; state changes go through one lock.
Shutdown: ``close()`` wakes every waiter with ``ClosedError``; no wait lasts longer than its timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from shared.buckets import Bucket
from shared.errors import ClosedError
from shared.layout import aligned_buffer, round_up, batch_layout, layout_nbytes, layout_views

__all__ = ["SlotState", "BatchRing"]

_PAGE_BYTES = 4096


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
    """

    def __init__(self, n_slots: int, buckets: tuple[Bucket, ...],
                 on_release: Callable[[], None] | None = None) -> None:
        if n_slots < 1:
            raise ValueError("n_slots must be >= 1")
        self.slot_nbytes = round_up(max(layout_nbytes(b) for b in buckets), _PAGE_BYTES)
        self._memory = aligned_buffer(n_slots * self.slot_nbytes)
        self._layouts = {b.index: batch_layout(b) for b in buckets}
        self._state = [SlotState.FREE] * n_slots
        self._ready: dict[int, int] = {}        # batch id -> slot
        self._cond = threading.Condition()
        self._closed = False
        self._on_release = on_release
        self.n_slots = n_slots

    @property
    def total_nbytes(self) -> int:
        return int(self._memory.nbytes)

    def views(self, slot: int, bucket: int) -> dict[str, npt.NDArray[np.generic]]:
        """Aligned array views of ``slot`` laid out for ``bucket``; valid while the slot is held."""
        return layout_views(self._memory, slot * self.slot_nbytes, self._layouts[bucket])

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

    def mark_ready(self, slot: int, batch_id: int) -> None:
        """LEASED -> READY: the slot now holds batch ``batch_id``."""
        with self._cond:
            self._expect(slot, SlotState.LEASED)
            self._state[slot] = SlotState.READY
            self._ready[batch_id] = slot
            self._cond.notify_all()

    # --- step side -------------------------------------------------------------------------
    def take(self, batch_id: int, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for batch ``batch_id``; READY -> IN_STEP.

        Returns:
            The slot, or ``None`` on timeout.
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
            slot = self._ready.pop(batch_id)
            self._state[slot] = SlotState.IN_STEP
            return slot

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
