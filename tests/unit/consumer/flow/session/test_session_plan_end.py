"""Unit tests for consumer/flow/session.py: a finite plan's end is announced (HB ``done``) to every producer.

Driven with decoded messages and a fake clock (``session_rig.Rig``); nothing sleeps.
"""

from __future__ import annotations

from melfeed.consumer.flow.decisions import Outgoing
from melfeed.shared.wire.protocol import Heartbeat
from tests.unit.consumer.flow.session.session_rig import EPOCH, A, B, Rig, ids


def _heartbeats(sends: list[Outgoing]) -> dict[bytes, Heartbeat]:
    out = {}
    for o in sends:
        assert isinstance(o.msg, Heartbeat) and o.msg.epoch == EPOCH, o.msg
        out[o.ident] = o.msg
    return out


def _said(sends: list[Outgoing]) -> dict[bytes, tuple[int, bool]]:
    """Each heartbeat's applied count and ``done`` (the rig's ring keeps its batches: depth is not checked)."""
    return {ident: (hb.applied, hb.done) for ident, hb in _heartbeats(sends).items()}


def _applied_through(rig: Rig, last_id: int) -> None:
    """Deliver ids 0..last_id from A (its leases) and keep granting, as the shell's loop does."""
    for batch_id in range(last_id + 1):
        rig.deliver(A, batch_id)
        rig.loop(batch_id - 1)


def test_the_tick_that_sees_the_last_batch_applied_says_done_at_once_and_every_heartbeat_repeats_it() -> None:
    rig = Rig(n_slots=3, window=3, end_id=3, heartbeat_interval_s=1.0)
    rig.join(A)
    rig.join(B)
    assert ids(rig.loop()[A]) == [0, 1, 2]
    _applied_through(rig, 2)
    first = _heartbeats(rig.tick(1))  # due now: the interval's first heartbeat
    assert not any(hb.done for hb in first.values())
    rig.clock.advance(0.1)
    assert rig.tick(1) == []  # not due yet, and the plan is not finished
    end = rig.tick(2)  # the last batch applied: not waiting for the interval
    assert _said(end) == {A: (3, True), B: (3, True)}
    assert rig.session.plan_ended and rig.grant() == {}
    rig.clock.advance(0.5)
    assert rig.tick(2) == []  # announced once per interval, not on every tick
    rig.clock.advance(0.5)
    assert all(hb.done for hb in _heartbeats(rig.tick(2)).values())


def test_an_endless_plan_never_says_done_not_even_when_closing() -> None:
    rig = Rig(end_id=None)
    rig.join(A)
    rig.loop()
    _applied_through(rig, 1)
    assert not any(hb.done for hb in _heartbeats(rig.tick(1)).values())
    assert rig.session.closing(rig.clock(), 1) == [] and not rig.session.plan_ended


def test_closing_after_the_last_step_sends_a_last_done_heartbeat_even_before_the_interval() -> None:
    rig = Rig(n_slots=3, window=3, end_id=2, heartbeat_interval_s=5.0)
    rig.join(A)
    rig.join(B)
    rig.loop()
    _applied_through(rig, 1)
    rig.tick(0)  # the shell stopped before a tick saw batch 1 applied
    sends = rig.session.closing(rig.clock(), 1)
    assert _said(sends) == {A: (2, True), B: (2, True)}


def test_closing_an_unfinished_plan_says_nothing() -> None:
    rig = Rig(n_slots=3, window=3, end_id=10)
    rig.join(A)
    rig.loop()
    _applied_through(rig, 1)
    assert rig.session.closing(rig.clock(), 1) == [] and not rig.session.plan_ended


def test_a_producer_joining_after_the_end_hears_done_within_one_interval() -> None:
    rig = Rig(end_id=0, heartbeat_interval_s=1.0)  # resumed at its end: nothing was ever to be leased
    rig.tick()
    assert rig.session.plan_ended
    rig.join(A)
    assert rig.grant() == {}
    rig.clock.advance(1.0)
    assert _heartbeats(rig.tick()) == {A: Heartbeat(EPOCH, 0, 0, done=True)}
