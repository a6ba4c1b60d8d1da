"""The producer session when the consumer's plan ends (its HB says ``done``): exit 0, or wait for the next
consumer, by ``ProducerSessionConfig.exit_at_plan_end``. Decoded messages and a fake clock; nothing sleeps."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from melfeed.producer.session import ProducerSession, ProducerSessionConfig
from melfeed.shared.wire.protocol import Bye, Heartbeat, Hello, Lease, LeaseGrant, StageCounters
from tests.fakes import FakeClock
from tests.unit.producer.test_session import _welcome

HB_S = 0.2
WAIT_CFG = ProducerSessionConfig(
    "producer-1",
    "ipc:///run/melfeed/sock",
    "fp",
    [[8, 100, 30]],
    80,
    7,
    heartbeat_interval_s=HB_S,
    liveness_s=1.0,
    backoff_max_s=1.0,
)
EXIT_CFG = dataclasses.replace(WAIT_CFG, exit_at_plan_end=True)
DONE = Heartbeat(7, 0, 12, done=True)


def _joined_with_leases(cfg: ProducerSessionConfig, clock: FakeClock) -> ProducerSession:
    s = ProducerSession(cfg, clock())
    assert isinstance(s.on_turn(clock())[0], Hello)
    s.on_message(_welcome(s, 7), clock())
    s.on_message(LeaseGrant(7, [Lease(10, 0, [1, 2], 5.0), Lease(11, 0, [3, 4], 5.0)], 2), clock())
    assert s.pending_leases == 2
    return s


def _next_hello(s: ProducerSession, clock: FakeClock, within_s: float = 2.0) -> float:
    """The time of the next HELLO, the clock running in 10 ms turns (the worker's loop, compressed)."""
    deadline_s = clock() + within_s
    while clock() < deadline_s:
        if any(isinstance(m, Hello) for m in s.on_turn(clock())):
            return clock()
        clock.advance(0.01)
    raise AssertionError(f"no HELLO within {within_s} s")


def test_with_exit_at_plan_end_the_session_stops_building_and_leaves_with_a_planned_bye() -> None:
    clock = FakeClock(100.0)
    s = _joined_with_leases(EXIT_CFG, clock)
    s.on_message(DONE, clock())
    assert s.finished and s.exit_code == 0
    assert s.pending_leases == 0 and s.next_build(clock()) is None
    assert s.heartbeat(clock.advance(1.0), StageCounters(0, 0.0, 0.0, 0.0)) is None  # nothing more to say
    assert s.farewell() == Bye(7)  # exit code 0: a planned leave


def test_without_it_the_session_says_bye_and_waits_for_the_next_consumer() -> None:
    clock = FakeClock(100.0)
    s = _joined_with_leases(WAIT_CFG, clock)
    s.on_message(DONE, clock())
    assert not s.finished and s.joined_epoch is None and s.pending_leases == 0
    assert s.on_turn(clock()) == [Bye(7)]  # the consumer returns nothing: none held
    assert s.farewell() is None  # no consumer knows us any more
    _next_hello(s, clock, within_s=0.2)  # and looks for the next consumer
    s.on_message(_welcome(s, 8, checksum=True), clock())
    assert s.joined_epoch == 8
    s.on_message(LeaseGrant(8, [Lease(0, 0, [5], 5.0)], 1), clock())
    order = s.next_build(clock())
    assert order is not None and (order.epoch, order.lease.batch_id) == (8, 0)


def test_waiting_for_the_next_consumer_warns_once_after_ten_silent_seconds(caplog: pytest.LogCaptureFixture) -> None:
    """What a producer started by hand logs while it waits: the finished consumer still answers a HELLO, then it
    is gone; ten seconds of silence after its last answer, one warning naming the endpoint, and no more."""
    clock = FakeClock(100.0)
    s = _joined_with_leases(WAIT_CFG, clock)
    s.on_message(DONE, clock())
    _next_hello(s, clock)
    s.on_message(_welcome(s, 7), clock())  # still up (checkpointing): its last answer
    answered_s = clock()
    with caplog.at_level(logging.WARNING, logger="melfeed.producer.session"):
        while clock() < answered_s + 9.9:  # then nobody answers
            s.on_turn(clock.advance(0.1))
        assert caplog.records == []
        for _ in range(300):
            s.on_turn(clock.advance(0.1))
    assert [r.getMessage() for r in caplog.records] == [
        "no consumer answered at ipc:///run/melfeed/sock for 10 s; still waiting"
    ]


def test_the_finished_consumer_is_never_joined_again_and_the_back_off_goes_on() -> None:
    clock = FakeClock(100.0)
    s = _joined_with_leases(WAIT_CFG, clock)
    s.on_message(DONE, clock())
    s.on_turn(clock())
    hellos = []
    for _ in range(4):  # it is still up (checkpointing): it answers each HELLO with WELCOME
        hellos.append(_next_hello(s, clock))
        s.on_message(_welcome(s, 7), clock())
        assert s.joined_epoch is None and s.on_turn(clock()) == [Bye(7)]
        s.on_message(DONE, clock())  # a heartbeat sent before our BYE arrived
        assert s.joined_epoch is None and s.on_turn(clock()) == []
    gaps = [b - a for a, b in zip(hellos, hellos[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 0.3  # doubling, not a HELLO/WELCOME/BYE storm


def test_done_from_another_epoch_is_an_epoch_change_not_the_end_of_our_plan() -> None:
    clock = FakeClock(100.0)
    s = _joined_with_leases(EXIT_CFG, clock)
    s.on_message(Heartbeat(99, done=True), clock())
    assert not s.finished and s.joined_epoch is None  # re-join as on any other epoch change
    s.on_message(Heartbeat(7, 0, 3), clock())
    assert not s.finished


def test_a_heartbeat_without_done_changes_nothing() -> None:
    clock = FakeClock(100.0)
    s = _joined_with_leases(EXIT_CFG, clock)
    s.on_message(Heartbeat(7, 2, 5), clock())
    assert not s.finished and s.joined_epoch == 7 and s.pending_leases == 2
