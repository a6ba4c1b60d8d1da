"""Unit tests for consumer/flow/session.py: handshake, grants, deadlines, liveness, heartbeats and BYE.

The session is driven with decoded messages and a fake clock (``session_rig.Rig``); nothing sleeps.
Rejects, duplicates and floods: ``test_session_rejects.py``; shared-memory fencing: ``test_shm_leases.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import msgpack
import pytest

from melfeed.consumer.flow.session import escape_line
from melfeed.shared.errors import ProtocolError
from melfeed.shared.wire.protocol import (
    CAP_SHM,
    PROTOCOL_VERSION,
    Bye,
    Err,
    Heartbeat,
    Hello,
    LeaseGrant,
    RejectCode,
    Welcome,
    decode_header,
    encode,
)
from tests.fakes import FakeSlotFiles
from tests.unit.consumer.flow.session.session_rig import CONTRACT, EPOCH, A, B, Rig, err_codes, header, ids


# --- handshake --------------------------------------------------------------------------------
def test_good_hello_is_welcomed_then_leased_up_to_the_window() -> None:
    rig = Rig(n_slots=3, window=2, heartbeat_interval_s=0.5)
    welcome = rig.join(A, nonce=77)
    assert welcome == Welcome(EPOCH, 2, 0.5, False, 77)  # the nonce of the HELLO it answers
    assert rig.session.stats().producers_alive == 1
    grants = rig.grant()
    assert list(grants) == [A] and ids(grants[A]) == [0, 1]
    assert [x.sample_ids for x in grants[A]] == [[0, 1], [2, 3]]  # the plan's samples, not the producer's
    assert all(x.deadline_s == 10.0 and x.shm is None for x in grants[A])
    assert rig.grant() == {}  # window full: nothing more


def test_hello_with_an_unsupported_protocol_is_refused_with_proto() -> None:
    rig = Rig()
    decision = rig.hello(A, proto=99)
    assert err_codes(decision) == [RejectCode.PROTO] and decision.drain
    assert rig.session.stats().producers_alive == 0
    assert rig.session.stats().rejects == {RejectCode.PROTO: 1}
    assert rig.grant() == {}


@pytest.mark.parametrize(
    "field, value",
    [
        ("fingerprint", "cd" * 32),
        ("n_mels", 80),
        ("seed", 43),
        ("buckets", [[0, 2, 16, 4, 3]]),
        ("mel_dtype", "float16"),
    ],
)
def test_hello_with_another_contract_is_refused_with_contract(
    field: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig()
    overrides: dict[str, Any] = {field: value}
    with caplog.at_level(logging.WARNING):
        decision = rig.hello(A, **overrides)
    assert err_codes(decision) == [RejectCode.CONTRACT]
    assert rig.session.stats().producers_alive == 0 and rig.grant() == {}
    # An unauthenticated peer learns nothing of the consumer's contract; the consumer's log has it all.
    [out] = decision.sends
    assert isinstance(out.msg, Err)
    for secret in (CONTRACT.fingerprint, f"consumer {CONTRACT.seed}", str(CONTRACT.buckets), "consumer 3"):
        assert secret not in out.msg.why
    assert repr(value)[:20] in out.msg.why  # its own value, to fix its config by
    [line] = [r.getMessage() for r in caplog.records if "code=CONTRACT" in r.getMessage()]
    ours = {
        "fingerprint": CONTRACT.fingerprint[:20],
        "n_mels": "consumer 3",
        "seed": "consumer 42",
        "buckets": "consumer [[0",
        "mel_dtype": "transport.mel_dtype differs: producer 'float16', consumer 'float32'",
    }[field]
    assert ours in line


def test_curve_user_id_binds_the_producer_id() -> None:
    rig = Rig()
    assert err_codes(rig.hello(A, producer_id="mallory-1", user_id="alice")) == [RejectCode.CONTRACT]
    [out] = rig.hello(A, producer_id="alice-1", user_id="alice").sends
    assert isinstance(out.msg, Welcome)


def test_messages_before_hello_are_refused_as_unknown_peer() -> None:
    rig = Rig()
    assert err_codes(rig.heartbeat(A)) == [RejectCode.UNKNOWN_PEER]
    assert err_codes(rig.deliver(A, 0)) == [RejectCode.UNKNOWN_PEER]
    assert err_codes(rig.send(A, Bye(EPOCH))) == [RejectCode.UNKNOWN_PEER]
    assert rig.session.stats().rejects == {RejectCode.UNKNOWN_PEER: 3}


def test_a_control_message_with_extra_frames_is_refused_with_frames() -> None:
    rig = Rig()
    rig.join(A)
    assert err_codes(rig.send(A, Heartbeat(EPOCH), more=True)) == [RejectCode.FRAMES]
    assert err_codes(rig.send(A, LeaseGrant(EPOCH, [], 0))) == [RejectCode.TYPE]


def test_a_second_hello_returns_the_old_leases_first() -> None:
    rig = Rig(window=2)
    rig.join(A)
    assert ids(rig.grant()[A]) == [0, 1]
    rig.join(A)  # a new nonce: the producer dropped its leases (or restarted)
    assert rig.session.stats().leases_reissued == 2
    assert ids(rig.grant()[A]) == [0, 1]  # reissued ids go out again, lowest first


def test_a_repeated_hello_with_the_same_nonce_is_answered_again_and_keeps_the_leases() -> None:
    rig = Rig(window=2, liveness_s=5.0)
    first = rig.join(A, caps=(CAP_SHM,), nonce=5)
    assert ids(rig.grant()[A]) == [0, 1]
    rig.clock.advance(4.0)
    again = rig.join(A, caps=(CAP_SHM,), nonce=5)  # a retry that crossed our WELCOME under load
    assert again == first  # the same answer, sent again
    stats = rig.session.stats()
    assert (stats.leases_reissued, stats.leases_outstanding, stats.hello_repeats) == (0, 2, 1)
    assert stats.producers_alive == 1 and rig.grant() == {}  # nothing came back to lease again
    rig.clock.advance(4.0)  # the repeat counted as a sign of life
    assert rig.loop() == {} and rig.session.stats().producers_alive == 1
    assert rig.deliver(A, 0).intake is not None  # and the leases it held are still its own


@pytest.mark.parametrize(
    "second",
    [{"nonce": 6}, {"producer_id": "producer-z"}, {"caps": ()}],
    ids=["new-nonce", "other-name", "gave-up-shm"],
)
def test_a_hello_that_does_not_repeat_the_join_returns_the_leases(second: dict[str, Any]) -> None:
    rig = Rig(window=2, shm=FakeSlotFiles(3, directory="/run/melfeed"))
    rig.join(A, caps=(CAP_SHM,), nonce=5)
    assert ids(rig.grant()[A]) == [0, 1]
    welcome = rig.join(A, **{"caps": (CAP_SHM,), "nonce": 5, **second})
    assert welcome.nonce == second.get("nonce", 5)
    stats = rig.session.stats()
    assert (stats.leases_reissued, stats.leases_outstanding, stats.hello_repeats) == (2, 0, 0)
    assert ids(rig.grant()[A]) == [0, 1]  # leased again, under the new join


def test_a_hello_without_a_join_nonce_is_malformed_refused_with_schema_and_joins_nobody() -> None:
    rig = Rig(window=2)
    good = msgpack.unpackb(
        encode(
            Hello(
                PROTOCOL_VERSION,
                "producer-a",
                CONTRACT.fingerprint,
                CONTRACT.buckets,
                CONTRACT.n_mels,
                CONTRACT.seed,
                5,
            )
        )
    )
    with pytest.raises(ProtocolError) as info:  # the receiver shell decodes, then hands the error over
        decode_header(msgpack.packb({key: value for key, value in good.items() if key != "nonce"}))
    assert "nonce" in info.value.why
    decision = rig.session.on_invalid(A, info.value, rig.clock())
    assert err_codes(decision) == [RejectCode.SCHEMA] and decision.drain
    assert rig.session.stats().producers_alive == 0 and rig.grant() == {}


# --- grants -----------------------------------------------------------------------------------
def test_grants_never_exceed_free_slots_and_go_to_the_least_loaded_peer() -> None:
    rig = Rig(n_slots=4, window=3)
    rig.join(A)
    rig.join(B)
    grants = rig.grant()
    assert ids(grants[A]) == [0, 1, 2] and ids(grants[B]) == [3]  # 4 slots, never 6 leases
    assert rig.session.stats().leases_outstanding == 4
    assert rig.deliver(A, 0).intake is not None
    ready = rig.ring.take(0, 0.0)
    assert ready is not None
    rig.ring.release(ready.slot)
    # the freed slot goes to B (one lease held), not to A (two held), though A joined first
    assert {p: ids(v) for p, v in rig.loop(applied_through=0).items()} == {B: [4]}


def test_queue_depth_counts_ready_batches_and_leases_outstanding() -> None:
    rig = Rig(n_slots=3, window=3)
    rig.join(A)
    rig.grant()
    assert rig.session.queue_depth() == 3
    rig.deliver(A, 1)
    assert rig.session.queue_depth() == 3 and rig.ring.ready_ids() == [1]
    [hb] = rig.tick()
    assert hb.msg == Heartbeat(EPOCH, 3, 0)


def test_quarantined_rows_reach_the_ready_slot_only_when_they_are_the_batchs_own_with_the_note_escaped() -> None:
    rig = Rig(n_slots=3, window=2)
    rig.join(A)
    rig.grant()  # batch 1 holds samples 2 and 3
    hdr = header(1)
    decision = rig.send(
        A, dataclasses.replace(hdr, quarantined=[3, 99, 3], quarantine_note="/c/x.npy: bad\nline"), more=True
    )
    assert decision.intake is not None
    rig.session.on_batch_taken(decision.intake, 0)
    ready = rig.ring.take(1, 0.0)
    assert ready is not None and ready.quarantined == (3,)  # 99 is not its row; 3 counts once
    assert ready.quarantine_note == "/c/x.npy: bad\\nline"  # peer text, one escaped line
    assert rig.session.stats().quarantined == 1
    rig.deliver(A, 0)  # a clean batch carries nothing
    clean = rig.ring.take(0, 0.0)
    assert clean is not None and (clean.quarantined, clean.quarantine_note) == ((), "")


# --- deadlines and liveness -------------------------------------------------------------------
def test_an_expired_lease_goes_back_to_pending_and_to_another_peer() -> None:
    rig = Rig(n_slots=1, window=1, lease_timeout_s=10.0)
    rig.join(A)
    assert ids(rig.grant()[A]) == [0]
    rig.clock.advance(5.0)
    rig.join(B)
    assert rig.grant() == {}  # the only slot is leased to A
    rig.clock.advance(4.9)
    rig.heartbeat(A)
    assert rig.loop() == {} and rig.session.stats().leases_reissued == 0
    rig.clock.advance(0.2)  # past A's deadline; A is still alive
    rig.heartbeat(A)
    grants = rig.loop()  # B was never granted: it goes first
    assert list(grants) == [B] and ids(grants[B]) == [0]
    assert rig.book.leases_of(A) == [] and rig.session.stats().leases_reissued == 1
    assert rig.session.stats().producers_alive == 2


def test_a_silent_peer_is_dropped_and_its_leases_reissued() -> None:
    rig = Rig(window=2, liveness_s=3.0)
    rig.join(A)
    rig.grant()
    rig.clock.advance(2.9)
    rig.tick()
    assert rig.session.stats().producers_alive == 1
    rig.clock.advance(0.2)
    rig.join(B)
    grants = rig.loop()
    stats = rig.session.stats()
    assert stats.producers_alive == 1 and stats.leases_reissued == 2
    assert ids(grants[B]) == [0, 1]
    assert err_codes(rig.heartbeat(A)) == [RejectCode.UNKNOWN_PEER]  # it must say HELLO again


def test_a_peer_dropped_for_silence_may_join_again() -> None:
    rig = Rig(window=2, liveness_s=3.0)
    rig.join(A)
    assert ids(rig.grant()[A]) == [0, 1]
    rig.clock.advance(3.1)
    assert rig.loop() == {} and rig.session.stats().producers_alive == 0
    rig.join(A)
    assert ids(rig.grant()[A]) == [0, 1]
    assert rig.session.stats().producers_seen == 1  # the same producer id, seen once


def test_applied_batches_are_forgotten_by_the_lease_book_once_each_in_order() -> None:
    rig = Rig()
    forgotten: list[int] = []
    mark_applied = rig.book.mark_applied

    def spy(batch_id: int) -> None:
        forgotten.append(batch_id)
        mark_applied(batch_id)

    rig.book.mark_applied = spy  # type: ignore[method-assign]
    rig.tick(applied_through=-1)
    rig.tick(applied_through=2)
    rig.tick(applied_through=2)
    rig.tick(applied_through=3)
    assert forgotten == [0, 1, 2, 3]  # bounded memory: the book drops what the step applied


def test_heartbeats_go_to_every_peer_once_per_interval() -> None:
    rig = Rig(heartbeat_interval_s=1.0)
    rig.join(A)
    rig.join(B)
    first = rig.tick(applied_through=4)
    assert sorted(o.ident for o in first) == [A, B]
    assert all(o.msg == Heartbeat(EPOCH, 0, 5) for o in first)
    rig.clock.advance(0.5)
    assert rig.tick(applied_through=4) == []
    assert rig.session.poll_timeout_ms(rig.clock()) == 501
    rig.clock.advance(0.5)
    assert len(rig.tick(applied_through=4)) == 2


def test_a_vanished_peer_is_dropped_when_a_send_to_it_fails() -> None:
    rig = Rig(window=2)
    rig.join(A)
    rig.grant()
    rig.session.on_unreachable(A)
    assert rig.session.stats().producers_alive == 0 and rig.session.stats().leases_outstanding == 0
    rig.session.on_unreachable(B)  # never connected: nothing to do
    assert rig.session.stats().leases_reissued == 2


# --- BYE --------------------------------------------------------------------------------------
def test_bye_returns_the_leases_at_once_and_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(window=2)
    rig.join(A)
    rig.grant()
    caplog.set_level(logging.INFO, logger="melfeed.consumer.flow.session")
    caplog.clear()
    assert rig.send(A, Bye(EPOCH)).sends == []
    stats = rig.session.stats()
    assert stats.producers_alive == 0 and stats.leases_outstanding == 0 and stats.leases_reissued == 2
    assert stats.producer_failures == 0
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    rig.join(B)
    assert ids(rig.grant()[B]) == [0, 1]


def test_bye_with_an_exit_code_is_logged_as_a_failure_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(window=2)
    rig.join(A)
    rig.grant()
    reason = "CacheError: /c/mels/7.npy: truncated\nERROR forged line\x1b[2J"
    caplog.set_level(logging.INFO, logger="melfeed.consumer.flow.session")
    caplog.clear()
    assert rig.send(A, Bye(EPOCH, exit_code=3, reason=reason)).sends == []
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "producer failed id=producer-a exit=3: CacheError: /c/mels/7.npy: truncated\\nERROR forged line\\x1b[2J"
    ]
    stats = rig.session.stats()
    assert stats.producer_failures == 1 and stats.leases_outstanding == 0 and stats.leases_reissued == 2
    assert stats.producers_alive == 0


def test_escape_line_keeps_printable_text_and_escapes_the_rest() -> None:
    assert escape_line("bad file é.npy: 'x'") == "bad file é.npy: 'x'"
    assert escape_line("a\r\nb\tc\x00\u2028") == "a\\r\\nb\\tc\\x00\\u2028"
    assert "\n" not in escape_line("".join(chr(i) for i in range(0x20)))


def test_hello_offering_shm_is_welcomed_with_the_slot_directory_only_when_the_ring_has_files() -> None:
    rig = Rig()
    assert rig.join(A, caps=(CAP_SHM,)).shm_dir is None  # payload path: no slot files
    assert all(x.shm is None for x in rig.grant()[A])


def test_slot_starved_says_whether_only_a_free_slot_is_missing() -> None:
    """A freed slot needs to wake the receiver only then; with every window full the next BATCH will."""
    rig = Rig(n_slots=2, window=2)
    rig.grant()
    assert not rig.session.slot_starved  # no producer: nothing to lease to
    rig.join(A)
    assert ids(rig.grant()[A]) == [0, 1]
    assert not rig.session.slot_starved  # A's window is full
    rig.join(B)
    assert rig.grant() == {} and rig.session.slot_starved  # B has room, the ring has no slot
    rig.deliver(A, 0)
    ready = rig.ring.take(0, 0.0)
    assert ready is not None
    rig.ring.release(ready.slot)
    assert ids(rig.grant()[B]) == [2] and rig.session.slot_starved  # B still has room for one more
