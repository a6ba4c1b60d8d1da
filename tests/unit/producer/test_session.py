"""The producer's protocol decisions, driven with decoded consumer messages and a fake clock."""

from __future__ import annotations

import errno
import logging
from typing import Any

import pytest

from melfeed.producer.session import BuildOrder, ProducerSession, ProducerSessionConfig, failure_reason
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.protocol import (
    CAP_SHM,
    Bye,
    Err,
    Heartbeat,
    Hello,
    Lease,
    LeaseGrant,
    RejectCode,
    ShmSlot,
    StageCounters,
    Welcome,
)
from tests.fakes import FakeClock

HB_S = 0.2
LIVENESS_S = 1.0
BACKOFF_MAX_S = 1.0
STATS = StageCounters(3, 0.01, 0.002, 0.001)
CFG = ProducerSessionConfig(
    "producer-1",
    "ipc:///run/melfeed/sock",
    "fp",
    [[8, 100, 30]],
    80,
    7,
    heartbeat_interval_s=HB_S,
    liveness_s=LIVENESS_S,
    backoff_max_s=BACKOFF_MAX_S,
)


def _lease(batch_id: int, deadline_s: float = 5.0, shm: ShmSlot | None = None) -> Lease:
    return Lease(batch_id, 0, [2 * batch_id, 2 * batch_id + 1], deadline_s, shm)


def _welcome(s: ProducerSession, epoch: int, shm_dir: str | None = None, *, checksum: bool = False) -> Welcome:
    """The consumer's answer to the HELLO ``s`` sends now: it echoes that HELLO's join nonce."""
    return Welcome(epoch, 2, HB_S, checksum, s.hello().nonce, shm_dir)


def _joined(
    clock: FakeClock, epoch: int = 7, *leases: Lease, offers_shm: bool = False, shm_dir: str | None = None
) -> ProducerSession:
    s = ProducerSession(CFG, clock(), offers_shm=offers_shm)
    assert isinstance(s.on_turn(clock())[0], Hello)
    s.on_message(_welcome(s, epoch, shm_dir), clock())
    if leases:
        s.on_message(LeaseGrant(epoch, list(leases), 1), clock())
    return s


def _builds(s: ProducerSession, now_s: float) -> list[int]:
    """Batch ids of every order the session hands out now."""
    ids = []
    while s.pending_leases:
        order = s.next_build(now_s)
        if order is not None:
            ids.append(order.lease.batch_id)
    return ids


def test_hello_then_welcome_then_lease_gives_one_build_order_per_leased_batch() -> None:
    clock = FakeClock(100.0)
    s = ProducerSession(CFG, clock(), new_nonce=lambda: 41)
    [hello] = s.on_turn(clock())
    assert hello == Hello(1, "producer-1", "fp", [[8, 100, 30]], 80, 7, 41)
    assert s.joined_epoch is None and s.next_build(clock()) is None
    s.on_message(Welcome(7, 2, HB_S, True, 41), clock.advance(0.01))
    assert s.joined_epoch == 7
    leases = [_lease(3), _lease(4), _lease(3)]  # a repeated id is held once
    s.on_message(LeaseGrant(7, leases, 2), clock())
    assert s.next_build(clock()) == BuildOrder(7, leases[0], True, None)
    assert s.next_build(clock()) == BuildOrder(7, leases[1], True, None)
    assert s.next_build(clock()) is None and s.on_turn(clock()) == []


def test_a_lease_past_its_deadline_is_skipped_and_the_next_one_built() -> None:
    clock = FakeClock()
    s = _joined(clock, 7, _lease(1, deadline_s=0.5), _lease(2, deadline_s=2.0))
    assert s.next_build(clock.advance(0.6)) is None
    order = s.next_build(clock())
    assert order is not None and order.lease.batch_id == 2


def test_err_unknown_peer_drops_leases_and_says_hello_at_once_whatever_the_back_off() -> None:
    clock = FakeClock()
    s = ProducerSession(CFG, clock())
    for _ in range(40):  # unanswered HELLOs: the back-off grows to 1 s
        s.on_turn(clock.advance(0.05))
    s.on_message(_welcome(s, 7), clock())
    s.on_message(LeaseGrant(7, [_lease(1), _lease(2)], 2), clock())
    s.on_message(Err(RejectCode.UNKNOWN_PEER, "send HELLO"), clock.advance(0.01))
    assert s.joined_epoch is None and s.pending_leases == 0 and s.exit_code == 0
    assert s.poll_timeout_s(clock()) == pytest.approx(0.001)
    assert [type(m) for m in s.on_turn(clock())] == [Hello]
    assert s.on_turn(clock()) == []  # and the back-off starts over
    assert s.counts.rejoins == 1 and s.counts.errors == {RejectCode.UNKNOWN_PEER: 1}


@pytest.mark.parametrize("code", [RejectCode.PROTO, RejectCode.CONTRACT])
def test_err_proto_or_contract_is_a_config_error_exit_78(code: RejectCode) -> None:
    clock = FakeClock()
    s = ProducerSession(CFG, clock())
    s.on_turn(clock())
    s.on_message(Err(code, "fingerprint differs"), clock())
    assert s.exit_code == 78 and s.reason == f"{code}: fingerprint differs"
    assert s.farewell() is None  # never joined: no consumer to tell


def test_a_non_fatal_err_is_counted_and_changes_nothing() -> None:
    clock = FakeClock()
    s = _joined(clock, 7, _lease(1))
    s.on_message(Err(RejectCode.LEASE, "batch 9 not leased to you"), clock())
    assert s.exit_code == 0 and s.joined_epoch == 7 and _builds(s, clock()) == [1]


def test_a_non_fatal_err_answering_hello_keeps_the_back_off() -> None:
    clock = FakeClock()
    s = ProducerSession(CFG, clock())
    assert s.on_turn(clock())  # HELLO at 0; the next one is due at 0.1
    s.on_message(Err(RejectCode.SCHEMA, "missing key 'fp'"), clock.advance(0.01))
    assert s.on_turn(clock()) == []  # no HELLO/ERR ping-pong
    assert s.on_turn(clock.advance(0.1)) and s.counts.errors == {RejectCode.SCHEMA: 1}


def test_consumer_silent_past_liveness_drops_leases_and_hellos_with_growing_bounded_back_off() -> None:
    clock = FakeClock()
    s = _joined(clock, 7, _lease(1), _lease(2))
    s.on_message(Heartbeat(7, 1, 0), clock.advance(0.5))
    assert s.on_turn(clock.advance(LIVENESS_S)) == [] and s.pending_leases == 2  # exactly the period: alive
    hellos: list[Any] = []
    while clock() < 6.5:  # 5 s more silence; turns wait as the worker would
        if s.on_turn(clock.advance(0.01 if not hellos else s.poll_timeout_s(clock()))):
            hellos.append(clock())
    assert s.joined_epoch is None and s.pending_leases == 0 and s.counts.rejoins == 1
    assert hellos[0] == pytest.approx(0.5 + LIVENESS_S + 0.01)  # the first one at once
    gaps = [b - a for a, b in zip(hellos, hellos[1:])]
    assert gaps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])  # doubling, capped at backoff_max_s


def test_a_socket_connected_late_starts_the_hello_back_off_over() -> None:
    clock = FakeClock()
    s = ProducerSession(CFG, clock())
    hellos = [clock()] if s.on_turn(clock()) else []
    while clock() < 3.0:  # unanswered (unconnected) HELLOs: back-off at 1 s
        if s.on_turn(clock.advance(s.poll_timeout_s(clock()))):
            hellos.append(clock())
    assert hellos[-1] - hellos[-2] == pytest.approx(BACKOFF_MAX_S, abs=1e-3)
    connected_s = clock()
    s.hello_soon(connected_s)  # the HELLO sent with the connect may find no pipe
    after: list[float] = []
    while len(after) < 3:
        if s.on_turn(clock.advance(s.poll_timeout_s(clock()))):
            after.append(clock())
    assert [b - a for a, b in zip([connected_s, *after], after)] == pytest.approx([0.1, 0.2, 0.4], abs=1e-3)


def test_no_answer_for_ten_seconds_warns_once_naming_the_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    s = ProducerSession(CFG, clock())
    with caplog.at_level(logging.WARNING, logger="melfeed.producer.session"):
        for _ in range(120):
            s.on_turn(clock.advance(0.1))
    assert [r.getMessage() for r in caplog.records] == [
        "no consumer answered at ipc:///run/melfeed/sock for 10 s; still waiting"
    ]


def test_a_welcome_with_a_new_epoch_drops_the_old_epochs_leases() -> None:
    clock = FakeClock()
    s = _joined(clock, 7, _lease(1), _lease(2))
    s.on_message(_welcome(s, 9), clock())
    assert s.joined_epoch == 9 and s.pending_leases == 0 and s.counts.rejoins == 1
    s.on_message(LeaseGrant(9, [_lease(5)], 1), clock())
    assert _builds(s, clock()) == [5]


def test_a_heartbeat_with_a_new_epoch_drops_leases_and_rejoins_at_once() -> None:
    clock = FakeClock()
    s = _joined(clock, 7, _lease(1))
    s.on_turn(clock.advance(0.05))
    s.on_message(Heartbeat(9, 0, 0), clock())
    assert s.joined_epoch is None and s.pending_leases == 0
    assert [type(m) for m in s.on_turn(clock())] == [Hello]


def test_leases_of_another_epoch_are_never_built() -> None:
    clock = FakeClock()
    s = ProducerSession(CFG, clock())
    s.on_message(LeaseGrant(7, [_lease(1)], 1), clock())  # before any WELCOME
    assert s.pending_leases == 0
    s.on_message(_welcome(s, 9), clock())
    s.on_message(LeaseGrant(7, [_lease(2)], 1), clock())  # the previous consumer's
    s.on_message(_welcome(s, 9), clock())
    s.on_message(LeaseGrant(9, [_lease(3)], 1), clock())
    assert _builds(s, clock()) == [3]


def test_heartbeats_are_due_every_interval_while_joined_and_never_before() -> None:
    clock = FakeClock()
    s = ProducerSession(CFG, clock())
    assert s.heartbeat(clock(), STATS) is None  # not joined
    s.on_turn(clock())
    s.on_message(_welcome(s, 7), clock())
    assert s.heartbeat(clock(), STATS) == Heartbeat(7, stats=STATS)
    assert s.poll_timeout_s(clock()) == pytest.approx(HB_S)
    assert s.heartbeat(clock.advance(0.15), STATS) is None
    assert s.poll_timeout_s(clock()) == pytest.approx(0.05)  # woken when the next one is due
    assert s.heartbeat(clock.advance(0.05), STATS) == Heartbeat(7, stats=STATS)
    s.on_message(LeaseGrant(7, [_lease(1)], 1), clock())
    assert s.poll_timeout_s(clock()) == 0.0  # work pending: do not wait


def test_shm_is_offered_and_a_slot_lease_is_built_in_the_welcomes_directory() -> None:
    clock = FakeClock()
    s = ProducerSession(CFG, clock(), offers_shm=True)
    [hello] = s.on_turn(clock())
    assert isinstance(hello, Hello) and hello.caps == [CAP_SHM]
    lease = _lease(1, shm=ShmSlot("melfeed-s0-g0", 0, 0))
    s.on_message(_welcome(s, 7, "/dev/shm/melfeed"), clock())
    s.on_message(LeaseGrant(7, [lease], 1), clock())
    assert s.next_build(clock()) == BuildOrder(7, lease, False, "/dev/shm/melfeed")


def test_a_slot_lease_without_agreed_shm_makes_the_producer_join_again() -> None:
    clock = FakeClock()
    s = _joined(clock, 7, _lease(1, shm=ShmSlot("melfeed-s0-g0", 0, 0)), _lease(2))
    assert s.next_build(clock()) is None
    assert s.joined_epoch is None and s.pending_leases == 0


def test_missing_slot_files_are_skipped_three_times_then_shm_is_given_up_for_good() -> None:
    clock = FakeClock()
    slots = [_lease(i, shm=ShmSlot(f"melfeed-s{i}-g0", i, 0)) for i in range(5)]
    s = _joined(clock, 7, *slots, offers_shm=True, shm_dir="/dev/shm/melfeed")
    shm_join = s.hello().nonce
    verdicts = []
    for _ in range(4):
        order = s.next_build(clock())
        assert order is not None
        verdicts.append(s.on_slot_error(order, errno.ENOENT, "No such file", clock()))
    assert verdicts == [False, False, False, True]
    assert not s.offers_shm and s.joined_epoch is None and s.pending_leases == 0
    [hello] = s.on_turn(clock())
    assert isinstance(hello, Hello) and hello.caps == []
    s.on_message(Welcome(9, 2, HB_S, False, shm_join, "/dev/shm/melfeed"), clock())  # answer to the old HELLO
    assert s.joined_epoch is None
    s.on_turn(clock.advance(0.01))
    s.on_message(_welcome(s, 9), clock())
    assert s.joined_epoch == 9


def test_a_slot_file_that_cannot_be_mapped_gives_up_shm_at_once_and_a_mapped_one_resets_the_misses() -> None:
    clock = FakeClock()
    slots = [_lease(i, shm=ShmSlot(f"melfeed-s{i}-g0", i, 0)) for i in range(4)]
    s = _joined(clock, 7, *slots, offers_shm=True, shm_dir="/dev/shm/melfeed")
    for _ in range(3):
        order = s.next_build(clock())
        assert order is not None and not s.on_slot_error(order, errno.ENOENT, "No such file", clock())
        s.on_slot_mapped()
    order = s.next_build(clock())
    assert order is not None and s.on_slot_error(order, errno.EACCES, "Permission denied", clock())
    assert not s.offers_shm


def test_farewell_carries_the_exit_code_and_a_one_line_reason_naming_the_file() -> None:
    clock = FakeClock()
    s = _joined(clock, 7, _lease(1))
    assert s.farewell() == Bye(7)  # a planned leave
    s.fail(78, CacheError("/cache/mels/LJ001-0003.npy", "missing"))
    assert s.exit_code == 78 and s.next_build(clock()) is None  # nothing more is built
    assert s.farewell() == Bye(7, 78, "CacheError: /cache/mels/LJ001-0003.npy: missing")
    assert failure_reason(ValueError("two\nlines")) == "ValueError: two lines"
    assert failure_reason(KeyError()) == "KeyError"


def test_a_consumers_err_text_is_logged_on_one_escaped_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    s = _joined(clock, 7, _lease(1))
    with caplog.at_level(logging.WARNING, logger="melfeed.producer.session"):
        s.on_message(Err(RejectCode.LEASE, "no\nINFO forged line\x1b[31m"), clock())
    [line] = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x1b" not in line and "forged line" in line
