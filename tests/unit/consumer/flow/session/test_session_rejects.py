"""Unit tests for consumer/flow/session.py: what is not taken -- duplicates, stale epochs, rejects, floods.

Every message the session does not take is counted once: a reject (answered by exactly one ERR),
a duplicate (dropped quietly), or a message of a blocked flooder (FLOOD, dropped unread, unanswered).
"""

from __future__ import annotations

from melfeed.consumer.flow.ring import SlotState
from melfeed.consumer.flow.session import BLOCK_S
from melfeed.shared.errors import ProtocolError
from melfeed.shared.wire.protocol import RejectCode
from tests.unit.consumer.flow.session.session_rig import EPOCH, A, B, Rig, err_codes, header, ids


def test_a_second_copy_of_a_batch_is_dropped_and_counted_as_a_duplicate() -> None:
    rig = Rig(window=2)
    rig.join(A)
    rig.grant()
    assert rig.deliver(A, 0).intake is not None
    again = rig.deliver(A, 0)
    assert again.intake is None and again.drain and again.sends == []  # dropped unread, unanswered
    stats = rig.session.stats()
    assert stats.duplicates_dropped == 1 and stats.batches_received == 1 and stats.rejects == {}
    assert rig.ring.ready_ids() == [0]


def test_a_late_copy_after_the_batch_was_applied_is_a_duplicate() -> None:
    rig = Rig(window=1)
    rig.join(A)
    rig.grant()
    rig.deliver(A, 0)
    ready = rig.ring.take(0, 0.0)
    assert ready is not None
    rig.ring.release(ready.slot)
    rig.tick(applied_through=0)
    assert rig.deliver(A, 0).sends == [] and rig.session.stats().duplicates_dropped == 1


def test_messages_of_an_old_consumer_epoch_are_dropped_counted_and_answered_unknown_peer() -> None:
    rig = Rig(window=1)
    rig.join(A)
    rig.grant()
    assert err_codes(rig.deliver(A, 0, epoch=EPOCH + 1)) == [RejectCode.UNKNOWN_PEER]
    assert err_codes(rig.heartbeat(A, epoch=EPOCH - 1)) == [RejectCode.UNKNOWN_PEER]
    stats = rig.session.stats()
    assert stats.stale_dropped == 2 and stats.batches_received == 0
    assert rig.book.leases_of(A)[0].batch_id == 0  # the lease is still open


def test_a_batch_not_leased_to_the_sender_is_refused_with_lease() -> None:
    rig = Rig(window=1)
    rig.join(A)
    rig.join(B)
    grants = rig.grant()
    assert ids(grants[A]) == [0] and ids(grants[B]) == [1]
    assert err_codes(rig.deliver(B, 0)) == [RejectCode.LEASE]  # A's lease
    assert err_codes(rig.deliver(A, 5)) == [RejectCode.LEASE]  # never leased
    assert rig.session.stats().batches_received == 0 and rig.ring.ready_ids() == []


def test_a_refused_payload_leaves_its_lease_open_to_be_built_again() -> None:
    rig = Rig(n_slots=1, window=1)
    rig.join(A)
    rig.grant()
    decision = rig.send(A, header(0), more=True)
    assert decision.intake is not None
    refused = rig.session.on_batch_refused(
        decision.intake, ProtocolError(RejectCode.CRC, "crc32 mismatch"), rig.clock()
    )
    assert err_codes(refused) == [RejectCode.CRC] and refused.drain
    assert rig.ring.counts()[SlotState.FREE] == 1  # the slot came back unfilled
    assert rig.session.stats().leases_reissued == 1
    assert ids(rig.grant()[A]) == [0]  # leased again, first


def test_an_undecodable_message_is_answered_and_counted_by_routing_id() -> None:
    rig = Rig()
    decision = rig.session.on_invalid(b"\x00\xff", ProtocolError(RejectCode.DECODE, "not msgpack"), rig.clock())
    assert err_codes(decision) == [RejectCode.DECODE] and decision.drain
    assert rig.session.stats().rejects_by_peer == {"0x00ff": 1}


def test_a_flooding_peer_is_cut_off_and_its_messages_dropped_unanswered() -> None:
    rig = Rig(window=2, flood_limit=3)
    rig.join(A)
    rig.grant()
    answers = [err_codes(rig.deliver(A, 9)) for _ in range(4)]
    assert answers == [[RejectCode.LEASE]] * 3 + [[RejectCode.FLOOD]]  # the last answer says why
    stats = rig.session.stats()
    assert stats.producers_alive == 0 and stats.leases_outstanding == 0 and stats.leases_reissued == 2
    ignored = rig.hello(A)  # even a good HELLO
    assert ignored.sends == [] and ignored.drain
    assert rig.session.stats().rejects == {RejectCode.LEASE: 4, RejectCode.FLOOD: 1}  # counted once each
    assert rig.session.stats().producers_alive == 0
    rig.clock.advance(BLOCK_S)
    assert rig.join(A).epoch == EPOCH  # the block ends


def test_a_flooder_does_not_get_another_peer_blocked() -> None:
    rig = Rig(window=1, flood_limit=2)
    rig.join(A)
    for _ in range(3):
        rig.heartbeat(B)  # B never said HELLO
    assert rig.heartbeat(A).sends == [] and rig.session.stats().producers_alive == 1
    assert rig.heartbeat(B).sends == []  # B is blocked: unanswered
