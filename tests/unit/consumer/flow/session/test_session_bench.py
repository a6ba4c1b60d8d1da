"""Unit tests for consumer/flow/session.py: a producer that heartbeats but never delivers is benched.

A lease that expires counts against its holder; ``lease_expiry_limit`` of them in a row (no batch
delivered in between) and the holder gets no leases for ``lease_backoff_s``. Driven with the session rig
and its fake clock; nothing sleeps.
"""

from __future__ import annotations

import logging

import pytest

from tests.unit.consumer.flow.session.session_rig import A, B, Rig, ids


def _apply_ready(rig: Rig, next_id: int) -> int:
    """The step loop: apply every ready batch in order; returns the next id it waits for."""
    while next_id in rig.ring.ready_ids():
        ready = rig.ring.take(next_id, 0.0)
        assert ready is not None
        rig.ring.release(ready.slot)
        next_id += 1
    return next_id


def _rounds(rig: Rig, n: int, next_id: int, granted: dict[bytes, list[int]], *, a_delivers: bool = False) -> int:
    """``n`` shell wakes 0.6 s apart: B delivers every lease at once, A only heartbeats (or delivers too)."""
    for _ in range(n):
        grants = rig.loop(applied_through=next_id - 1)
        for peer, leases in grants.items():
            granted[peer] += ids(leases)
            if peer == B or a_delivers:
                for batch_id in ids(leases):
                    assert rig.deliver(peer, batch_id).intake is not None
        next_id = _apply_ready(rig, next_id)
        rig.heartbeat(A)
        rig.heartbeat(B)
        rig.clock.advance(0.6)
    return next_id


def test_a_peer_that_heartbeats_but_never_delivers_gets_no_leases_for_the_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(n_slots=4, window=1, lease_timeout_s=1.0, liveness_s=100.0, lease_expiry_limit=3, lease_backoff_s=30.0)
    rig.join(A)
    rig.join(B)
    granted: dict[bytes, list[int]] = {A: [], B: []}
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.flow.session"):
        next_id = _rounds(rig, 20, 0, granted)
    assert len(granted[A]) == 3  # three leases expired in a row, then none
    assert next_id >= 15 and len(granted[B]) >= 15  # the good peer got all the rest, the stream moved on
    stats = rig.session.stats()
    assert stats.producers_benched == ("producer-a",) and stats.producers_alive == 2
    benched = [r.getMessage() for r in caplog.records if "in a row expire" in r.getMessage()]
    assert benched == ["producer producer-a (peer=producer-a) let 3 leases in a row expire; no leases for it for 30 s"]
    rig.clock.advance(30.0)  # the back-off is over: it is offered work again
    _rounds(rig, 1, next_id, granted)
    assert len(granted[A]) == 4 and rig.session.stats().producers_benched == ()


def test_a_delivered_batch_resets_the_count_and_a_new_hello_does_not() -> None:
    rig = Rig(n_slots=4, window=1, lease_timeout_s=1.0, liveness_s=100.0, lease_expiry_limit=3)
    rig.join(A)
    rig.join(B)
    granted: dict[bytes, list[int]] = {A: [], B: []}
    next_id = _rounds(rig, 4, 0, granted)  # A lets two leases expire ...
    assert len(granted[A]) == 2
    next_id = _rounds(rig, 1, next_id, granted, a_delivers=True)  # ... delivers one ...
    next_id = _rounds(rig, 5, next_id, granted)  # ... and lets two more expire: not three in a row
    assert rig.session.stats().producers_benched == ()
    rig.join(A)  # a re-HELLO under the same routing id keeps the count
    _rounds(rig, 3, next_id, granted)
    assert rig.session.stats().producers_benched == ("producer-a",)
