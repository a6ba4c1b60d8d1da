"""Lease book + ring under arbitrary interleavings (Hypothesis): window, memory bound, exactly once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from melfeed.consumer.flow.credit import Arrival, LeaseBook, grant_round
from melfeed.consumer.flow.plan import EpochPlan
from melfeed.consumer.flow.ring import BatchRing, SlotState
from melfeed.shared.config import BucketConfig
from melfeed.shared.wire.buckets import build_buckets
from tests.fakes import ljspeech_like

BUCKET_SET = build_buckets(*ljspeech_like(60), 3, BucketConfig(batch_size=4))
PLAN = EpochPlan(BUCKET_SET, "3f9a0c47d12e88b5", seed=1)
PEERS = [b"p1", b"p2", b"p3"]


class Sim:
    """The receiver's and step loop's use of LeaseBook + BatchRing, driven by a script."""

    def __init__(self, n_slots: int, window: int, end: int) -> None:
        self.book = LeaseBook(PLAN, 0, end, window, lease_timeout_s=10.0)
        self.ring = BatchRing(n_slots, BUCKET_SET.buckets)
        self.now = 0.0
        self.next_apply = 0
        self.applied: list[int] = []
        self.alive = set(PEERS)

    def grant(self) -> None:
        grant_round(self.book, sorted(self.alive), self.ring.reserve, self.ring.cancel, self.now)

    def deliver(self, peer: bytes, pick: int) -> None:
        held = self.book.leases_of(peer)
        if not held:
            return
        lease = held[pick % len(held)]
        arrival, got = self.book.accept(peer, lease.batch_id)
        assert arrival == Arrival.ACCEPT and got is not None
        assert got.planned == PLAN.batch(lease.batch_id)  # the lease carries its planned batch
        self.ring.mark_ready(got.slot, got.planned)
        # a second copy of the same batch is a duplicate, never applied twice
        assert self.book.accept(peer, lease.batch_id)[0] == Arrival.DUP

    def step(self) -> None:
        ready = self.ring.take(self.next_apply, 0.0)
        if ready is None:
            return
        assert ready.planned.batch_id == self.next_apply
        self.ring.release(ready.slot)
        self.book.mark_applied(self.next_apply)
        self.applied.append(self.next_apply)
        self.next_apply += 1

    def kill(self, peer: bytes) -> None:
        for lease in self.book.revoke_peer(peer):
            self.ring.cancel(lease.slot)

    def expire(self) -> None:
        self.now += 11.0
        for lease in self.book.expire(self.now):
            self.ring.cancel(lease.slot)

    def check(self, n_slots: int, window: int) -> None:
        counts = self.ring.counts()
        assert sum(counts.values()) == n_slots
        assert counts[SlotState.LEASED] == self.book.outstanding  # every lease owns exactly one slot
        for peer in PEERS:
            assert self.book.held_by(peer) <= window
        assert self.applied == list(range(len(self.applied)))  # in order, no gaps, no repeats


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["grant", "deliver", "step", "kill", "expire", "revive"]),
        st.sampled_from(PEERS),
        st.integers(0, 7),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(n_slots=st.integers(3, 6), window=st.integers(1, 3), end=st.integers(1, 30), actions=ACTIONS)
def test_any_interleaving_keeps_bounds_and_applies_each_batch_once_in_order(
    n_slots: int, window: int, end: int, actions: list[tuple[str, bytes, int]]
) -> None:
    sim = Sim(n_slots, window, end)
    for action, peer, pick in actions:
        if action == "grant":
            sim.grant()
        elif action == "deliver" and peer in sim.alive:
            sim.deliver(peer, pick)
        elif action == "step":
            sim.step()
        elif action == "kill":
            sim.kill(peer)
            sim.alive.discard(peer)
        elif action == "expire":
            sim.expire()
        elif action == "revive":
            sim.alive.add(peer)
        sim.check(n_slots, window)
    # Drain: with one live producer everything planned is applied exactly once.
    sim.alive = {b"p1"}
    for peer in PEERS[1:]:
        sim.kill(peer)
    for _ in range(4 * end + 10):
        sim.grant()
        sim.deliver(b"p1", 0)
        sim.step()
        sim.check(n_slots, window)
    assert sim.applied == list(range(end))


def test_slow_consumer_stops_leasing_when_slots_are_full() -> None:
    sim = Sim(n_slots=3, window=8, end=1000)
    for _ in range(50):  # producers deliver everything they get, the step never runs
        sim.grant()
        for peer in PEERS:
            sim.deliver(peer, 0)
    assert sim.book.outstanding + len(sim.ring.ready_ids()) <= 3
    assert sim.ring.counts()[SlotState.FREE] == 0


def test_reissued_ids_come_back_first_and_late_copy_wins() -> None:
    book = LeaseBook(PLAN, 0, None, window=2, lease_timeout_s=5.0)
    a, b = book.next_batch(), book.next_batch()
    assert a is not None and b is not None and (a.batch_id, b.batch_id) == (0, 1)
    book.grant(b"p1", a, slot=0, now_s=0.0)
    book.grant(b"p1", b, slot=1, now_s=0.0)
    expired = book.expire(now_s=6.0)
    assert [x.batch_id for x in expired] == [0, 1]
    again = book.next_batch()
    assert again == a  # lowest reissued id first, the same planned batch
    assert again is not None
    book.grant(b"p2", again, slot=2, now_s=6.0)
    arrival, lease = book.accept(b"p1", 0)  # p1's late copy arrives first: it wins
    assert arrival == Arrival.ACCEPT and lease is not None and lease.slot == 2
    assert book.accept(b"p2", 0)[0] == Arrival.DUP
    assert book.accept(b"p3", 5)[0] == Arrival.NOT_LEASED


def test_requeue_after_a_bad_payload_leases_the_id_again() -> None:
    book = LeaseBook(PLAN, 0, 3, window=1, lease_timeout_s=5.0)
    planned = book.next_batch()
    assert planned is not None
    book.grant(b"p1", planned, slot=0, now_s=0.0)
    arrival, lease = book.accept(b"p1", planned.batch_id)
    assert arrival == Arrival.ACCEPT and lease is not None
    book.requeue(lease)
    assert book.next_batch() == planned


def test_the_plan_is_asked_once_per_batch_id_and_the_lease_carries_the_answer() -> None:
    asked: list[int] = []

    class CountingPlan:
        def batch(self, batch_id: int) -> object:
            asked.append(batch_id)
            return PLAN.batch(batch_id)

    book = LeaseBook(CountingPlan(), 5, None, window=1, lease_timeout_s=5.0)  # type: ignore[arg-type]
    first = book.next_batch()
    assert first is not None
    book.grant(b"p1", first, slot=0, now_s=0.0)
    book.revoke_peer(b"p1")  # the id goes back to the queue with its plan entry
    assert book.next_batch() == first == PLAN.batch(5)
    assert asked == [5]


def test_the_book_is_finished_once_every_id_below_its_end_was_applied_and_never_without_an_end() -> None:
    book = LeaseBook(PLAN, 5, 8, window=3, lease_timeout_s=10.0)
    for batch_id in (5, 6, 7):
        assert not book.is_finished
        planned = book.next_batch()
        assert planned is not None and planned.batch_id == batch_id
        book.grant(b"p1", planned, slot=batch_id - 5, now_s=0.0)
        assert book.accept(b"p1", batch_id)[0] == Arrival.ACCEPT
    assert not book.is_finished and not book.has_work()  # received is not applied
    for batch_id in (5, 6, 7):
        book.mark_applied(batch_id)
    assert book.is_finished
    assert LeaseBook(PLAN, 8, 8, 3, 10.0).is_finished  # resumed at its end
    endless = LeaseBook(PLAN, 0, None, 3, 10.0)
    endless.mark_applied(1000)
    assert not endless.is_finished
