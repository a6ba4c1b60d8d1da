"""Lease accounting: which batch ids are leased to which producer, and until when.

Pure logic (no sockets, no clocks: callers pass ``now_s``). Credits are leases of concrete batch
ids (docs/design.md, invariant 2): a producer may only deliver ids leased to it in this consumer epoch.
Invariants:
  * every batch id >= ``start_id`` is in exactly one of: never issued, reissue queue, active
    lease, received (until applied);
  * a peer holds at most ``window`` active leases;
  * revoked or expired ids go back to the reissue queue, which is served lowest id first, so the
    batch the step loop waits for is always the next one leased;
  * the plan is asked once per batch id, when it is first leased: the lease carries the
    ``PlannedBatch`` (bucket, sample ids) from then on, through the ring to the step.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from melfeed.consumer.flow.plan import EpochPlan, PlannedBatch

__all__ = ["ActiveLease", "Arrival", "LeaseBook", "grant_round"]


@dataclass(slots=True)
class ActiveLease:
    """One open lease: which planned batch, held by which peer, in which ring slot, until when."""

    planned: PlannedBatch
    peer: bytes
    slot: int
    deadline_s: float

    @property
    def batch_id(self) -> int:
        return self.planned.batch_id


class Arrival(Enum):  # not a str enum: it never leaves the process, so no bare string can stand in for it
    """What ``LeaseBook.accept`` makes of an arriving batch, and so what the consumer does with it."""

    ACCEPT = "accept"  # lease found: fill its slot
    DUP = "dup"  # already received or applied: drop, count as duplicate
    NOT_LEASED = "lease"  # never leased to this peer in this epoch: reject ERR LEASE


class LeaseBook:
    """Lease table for one consumer epoch.

    Args:
        plan: the epoch plan; asked for each batch id when it is first leased.
        start_id: first batch id to lease (the resume position).
        end_id: one past the last id to lease, or ``None`` for an endless run.
        window: most leases one peer may hold.
        lease_timeout_s: deadline given to each lease.
    """

    def __init__(self, plan: EpochPlan, start_id: int, end_id: int | None, window: int, lease_timeout_s: float) -> None:
        self._plan = plan
        self._next_new = start_id
        self._end_id = end_id
        self._applied_floor = start_id  # ids below this were applied (or precede the resume)
        self._reissue: list[tuple[int, PlannedBatch]] = []  # heap by batch id (ids are unique)
        self._active: dict[int, ActiveLease] = {}
        self._by_peer: dict[bytes, set[int]] = {}
        self._leased_to: dict[int, set[bytes]] = {}  # every peer that ever held the id (late copies win too)
        self._received: set[int] = set()
        self.window = window
        self.lease_timeout_s = lease_timeout_s

    # --- queries ---------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return len(self._active)

    def held_by(self, peer: bytes) -> int:
        return len(self._by_peer.get(peer, ()))

    def room(self, peer: bytes) -> int:
        return max(0, self.window - self.held_by(peer))

    @property
    def is_finished(self) -> bool:
        """A finite plan whose every batch id below its end was applied: nothing will be leased again."""
        return self._end_id is not None and self._applied_floor >= self._end_id

    def has_work(self) -> bool:
        return bool(self._reissue) or self._end_id is None or self._next_new < self._end_id

    def active(self, batch_id: int) -> ActiveLease | None:
        """The open lease of ``batch_id``, if any (read-only look before ``accept``)."""
        return self._active.get(batch_id)

    def leases_of(self, peer: bytes) -> list[ActiveLease]:
        return [self._active[b] for b in sorted(self._by_peer.get(peer, ()))]

    # --- transitions -----------------------------------------------------------------------
    def next_batch(self) -> PlannedBatch | None:
        """The batch to lease next: lowest reissued id first, then the next new one from the plan."""
        if self._reissue:
            return heapq.heappop(self._reissue)[1]
        if self._end_id is not None and self._next_new >= self._end_id:
            return None
        self._next_new += 1
        return self._plan.batch(self._next_new - 1)

    def grant(self, peer: bytes, planned: PlannedBatch, slot: int, now_s: float) -> ActiveLease:
        """Record a lease of ``planned`` (from ``next_batch``) to ``peer`` in ``slot``."""
        batch_id = planned.batch_id
        if batch_id in self._active:
            raise ValueError(f"batch {batch_id} is already leased")
        lease = ActiveLease(planned, peer, slot, now_s + self.lease_timeout_s)
        self._active[batch_id] = lease
        self._by_peer.setdefault(peer, set()).add(batch_id)
        self._leased_to.setdefault(batch_id, set()).add(peer)
        return lease

    def accept(self, peer: bytes, batch_id: int) -> tuple[Arrival, ActiveLease | None]:
        """Classify an arriving batch. On ACCEPT the lease is closed and its slot returned.

        The first valid copy wins: a peer whose lease expired and was reissued to another may
        still deliver (batches are rebuilt bit-identically), and the other copy becomes a DUP.
        """
        if batch_id < self._applied_floor or batch_id in self._received:
            return Arrival.DUP, None
        lease = self._active.get(batch_id)
        if lease is None or peer not in self._leased_to.get(batch_id, ()):
            return Arrival.NOT_LEASED, None
        self._close(lease)
        self._received.add(batch_id)
        return Arrival.ACCEPT, lease

    def requeue(self, lease: ActiveLease) -> None:
        """Undo an ``accept`` whose payload turned out invalid: the id is leased again, first."""
        self._received.discard(lease.batch_id)
        self._push_reissue(lease)

    def revoke_peer(self, peer: bytes) -> list[ActiveLease]:
        """Return all of ``peer``'s leases to the reissue queue (peer dead or gone)."""
        leases = [self._active[b] for b in sorted(self._by_peer.get(peer, ()))]
        for lease in leases:
            self._close(lease)
            self._push_reissue(lease)
        self._by_peer.pop(peer, None)
        return leases

    def expire(self, now_s: float) -> list[ActiveLease]:
        """Return leases past their deadline to the reissue queue."""
        late = [x for x in self._active.values() if x.deadline_s <= now_s]
        for lease in late:
            self._close(lease)
            self._push_reissue(lease)
        return late

    def mark_applied(self, batch_id: int) -> None:
        """The step loop applied ``batch_id``: forget it (ids are applied in order)."""
        self._received.discard(batch_id)
        self._leased_to.pop(batch_id, None)
        self._applied_floor = max(self._applied_floor, batch_id + 1)

    def _push_reissue(self, lease: ActiveLease) -> None:
        heapq.heappush(self._reissue, (lease.batch_id, lease.planned))

    def _close(self, lease: ActiveLease) -> None:
        del self._active[lease.batch_id]
        held = self._by_peer.get(lease.peer)
        if held is not None:
            held.discard(lease.batch_id)


def grant_round(
    book: LeaseBook,
    peers: Iterable[bytes],
    reserve: Callable[[], int | None],
    cancel: Callable[[int], None],
    now_s: float,
) -> list[ActiveLease]:
    """Fill every peer's window in the given order while a slot is free and work remains.

    ``reserve``/``cancel`` take and give back ring slots, so each lease owns exactly one slot.
    """
    granted: list[ActiveLease] = []
    for peer in peers:
        while book.room(peer) > 0 and book.has_work():
            slot = reserve()
            if slot is None:
                return granted
            planned = book.next_batch()
            if planned is None:  # unreachable while has_work() holds; keeps the slot from leaking
                cancel(slot)
                return granted
            granted.append(book.grant(peer, planned, slot, now_s))
    return granted
