"""The producer's join nonce: a repeated HELLO keeps the leases, a join after dropping them asks anew.

Driven with decoded consumer messages, a fake clock and a counter for nonces (``producer/session.py``).
The consumer's side of the same rule: tests/unit/consumer/flow/session/test_session.py.
"""

from __future__ import annotations

import itertools

from melfeed.producer.session import ProducerSession, ProducerSessionConfig, random_nonce
from melfeed.shared.wire.protocol import Err, Hello, Lease, LeaseGrant, Message, RejectCode, Welcome
from tests.fakes import FakeClock
from tests.unit.producer.test_session import _builds

HB_S = 0.2
CFG = ProducerSessionConfig(
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


def _session(clock: FakeClock) -> ProducerSession:
    return ProducerSession(CFG, clock(), new_nonce=itertools.count(1).__next__)


def _hellos(msgs: list[Message]) -> list[Hello]:
    return [m for m in msgs if isinstance(m, Hello)]


def _lease(batch_id: int) -> Lease:
    return Lease(batch_id, 0, [batch_id], 5.0)


def test_every_hello_of_one_join_carries_the_same_nonce() -> None:
    clock = FakeClock()
    s = _session(clock)
    sent: list[Hello] = []
    while len(sent) < 4:  # unanswered: HELLO again with back-off
        sent += _hellos(s.on_turn(clock.advance(0.05)))
    assert {h.nonce for h in sent} == {1}


def test_the_answer_to_a_repeated_hello_keeps_the_leases_the_first_answer_brought() -> None:
    clock = FakeClock()
    s = _session(clock)
    s.on_turn(clock())
    s.on_turn(clock.advance(0.15))  # the retry left before any answer came
    s.on_message(Welcome(7, 2, HB_S, False, 1), clock.advance(0.01))
    s.on_message(LeaseGrant(7, [_lease(3), _lease(4)], 2), clock())
    s.on_message(Welcome(7, 2, HB_S, False, 1), clock.advance(0.5))  # the retry's answer
    assert s.joined_epoch == 7 and s.counts.rejoins == 0
    assert _builds(s, clock()) == [3, 4]
    assert s.on_turn(clock.advance(0.9)) == []  # it was a sign of life: not silent yet


def test_a_welcome_to_a_join_we_gave_up_is_ignored() -> None:
    clock = FakeClock()
    s = _session(clock)
    s.on_turn(clock())
    s.on_message(Welcome(7, 2, HB_S, False, 1), clock())
    s.on_message(LeaseGrant(7, [_lease(3)], 1), clock())
    s.on_message(Err(RejectCode.UNKNOWN_PEER, "send HELLO"), clock())  # dropped: leases gone, new join
    [hello] = _hellos(s.on_turn(clock()))
    assert hello.nonce == 2 and s.pending_leases == 0  # the consumer returns join 1's leases
    s.on_message(Welcome(7, 2, HB_S, False, 1), clock())  # a late answer to join 1
    assert s.joined_epoch is None
    s.on_message(Welcome(7, 2, HB_S, False, 2), clock())
    assert s.joined_epoch == 7


def test_leaving_for_a_silent_consumer_draws_a_new_nonce() -> None:
    clock = FakeClock()
    s = _session(clock)
    s.on_turn(clock())
    s.on_message(Welcome(7, 2, HB_S, False, 1), clock())
    [hello] = _hellos(s.on_turn(clock.advance(1.5)))  # silent past liveness: leases dropped
    assert hello.nonce == 2 and s.joined_epoch is None


def test_random_nonces_are_64_bit_and_differ() -> None:
    nonces = {random_nonce() for _ in range(64)}
    assert len(nonces) == 64 and all(0 <= n < 2**64 for n in nonces)
