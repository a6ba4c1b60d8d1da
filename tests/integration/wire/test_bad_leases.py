"""Bad input inside a session (B5/B9/B10 broken batches, B6-B8 handshake, B11-B12, shm fencing).

Against a real consumer and a real producer (harness: tests/integration/wire/bad_peer.py): a broken
batch is rejected and rebuilt, a batch not leased to its sender or already applied is never applied,
and a shared-memory BATCH that does not match its slot lease retires the slot.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from melfeed.producer.slot_maps import SlotMappings
from melfeed.shared.wire.layout import ARRAY_KEYS
from melfeed.shared.wire.protocol import (
    FATAL_REJECTS,
    PROTOCOL_VERSION,
    BatchHeader,
    Bye,
    Heartbeat,
    Lease,
    RejectCode,
    ShmSlot,
    encode,
)
from tests.integration.wire.bad_peer import (
    BATCH_CASES,
    BATCH_SIZE,
    WAIT_S,
    BadPeer,
    Mutation,
    Wire,
    delta,
    expect_rejected,
    grow_frames,
)


@pytest.mark.parametrize(("mutate", "code"), list(BATCH_CASES.values()), ids=list(BATCH_CASES))
def test_b5_b9_b10_broken_batch_for_a_lease_is_rejected_and_the_batch_rebuilt(
    wire: Wire, attack: Callable[..., BadPeer], mutate: Mutation, code: str
) -> None:
    peer = attack("batch")
    peer.join()
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)  # frees slots: the idle bad peer is leased first
    lease = peer.lease()
    header, payload = mutate(*peer.batch(lease))
    peer.send(encode(header), *payload)
    assert peer.errors(1) == [code]
    peer.bye()  # its other leases go back at once
    assert wire.stream.wait()
    after = wire.stats()
    assert delta(before.rejects, after.rejects) == {code: 1}
    assert delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: 1}
    assert after.leases_reissued > before.leases_reissued  # the rejected lease went back to the queue
    assert lease.batch_id in dict(wire.stream.applied)  # ... and its batch was built again
    wire.check_stream(start)  # with the right content, once, in order


# --- B6-B8: handshake ----------------------------------------------------------------------------------


def test_b6_protocol_version_mismatch_gets_err_proto_naming_supported_versions(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    peer = attack("proto")
    expect_rejected(
        wire,
        [[encode(wire.hello(proto=PROTOCOL_VERSION + 1))], [encode(wire.hello(proto=0))]],
        peer,
        [RejectCode.PROTO, RejectCode.PROTO],
    )
    assert all("supported: [1]" in e.why for e in peer.errs)
    assert RejectCode.PROTO in FATAL_REJECTS  # a real producer exits 78 on it


def test_b7_messages_before_hello_or_after_the_session_ended_get_err_unknown_peer(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    epoch = wire.consumer._run_id
    stranger = attack("stranger")
    header = BatchHeader(epoch, 0, 0, [[1]] * 4, ["float32"] * 4, None, [])
    expect_rejected(
        wire,
        [[encode(Heartbeat(epoch))], [encode(Bye(epoch))], [encode(header), b"", b"", b"", b""]],
        stranger,
        [RejectCode.UNKNOWN_PEER] * 3,
    )

    left = attack("left")  # said BYE, then talks on
    left.join()
    left.bye()
    expect_rejected(wire, [[encode(Heartbeat(epoch))]], left, [RejectCode.UNKNOWN_PEER])

    silent = attack("silent")  # expired: no heartbeat for the liveness period
    silent.join()
    deadline = time.monotonic() + WAIT_S
    while wire.stats().producers_alive > 1:
        assert time.monotonic() < deadline, "silent peer never expired"
        time.sleep(0.05)
    silent.epoch = None  # it does not know; no automatic heartbeats
    expect_rejected(wire, [[encode(Heartbeat(epoch))]], silent, [RejectCode.UNKNOWN_PEER])


_CONTRACT_CASES = {
    "fingerprint": {"fingerprint": "0" * 16},
    "n_mels": {"n_mels": 64},
    "seed": {"seed": 1},
    "bucket-frames": {"buckets": [[0, BATCH_SIZE, 448, 106, 80]]},
    "batch-size": {"buckets": "batch*2"},
    # no buckets at all asks for the consumer's plan (buckets.cost: measured): tests/unit/consumer/flow/session
}


@pytest.mark.parametrize("change", list(_CONTRACT_CASES.values()), ids=list(_CONTRACT_CASES))
def test_b8_hello_with_another_data_contract_gets_err_contract(
    wire: Wire, attack: Callable[..., BadPeer], change: dict[str, Any]
) -> None:
    if change.get("buckets") == "batch*2":
        change = {"buckets": [[b[0], b[1] * 2, *b[2:]] for b in wire.consumer._bucket_set.as_wire()]}
    peer = attack("contract")
    expect_rejected(wire, [[encode(wire.hello(**change))]], peer, [RejectCode.CONTRACT])
    assert wire.stats().producers_alive == 1


def test_a_repeated_hello_keeps_the_peers_leases_and_a_new_nonce_returns_them(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    peer = attack("repeat")
    peer.join(nonce=11)
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)
    lease = peer.lease()
    reissued = wire.stats().leases_reissued
    peer.join(nonce=11)  # a retry that crossed the WELCOME (a loaded machine)
    assert peer.welcomes[-1] == peer.welcomes[0] and peer.welcomes[0].nonce == 11  # answered again, the same
    after = wire.stats()
    assert (after.hello_repeats, after.leases_reissued) == (before.hello_repeats + 1, reissued)  # none returned
    header, payload = peer.batch(lease)
    peer.send(encode(header), *payload)  # the lease taken before the repeat is still its own
    held = peer.lease()  # its window refills as the stream takes batches
    reissued = wire.stats().leases_reissued
    peer.join(nonce=12)  # a new join: its leases come back at once
    assert wire.stats().leases_reissued >= reissued + 1 and wire.stats().hello_repeats == before.hello_repeats + 1
    peer.bye()
    assert wire.stream.wait()
    assert peer.codes == [] and lease.batch_id in dict(wire.stream.applied)
    assert held.batch_id in dict(wire.stream.applied)  # built again by the good producer
    wire.check_stream(start)


# --- B11, B12: batches that must never be applied --------------------------------------------------------


def test_b11_batch_not_leased_to_the_sender_gets_err_lease_and_is_not_applied(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    holder, thief = attack("holder"), attack("thief")
    holder.join()
    thief.join()
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)
    lease = holder.lease()  # leased to holder, not to thief
    header, payload = thief.poisoned(lease)
    thief.send(encode(header), *payload)
    thief.send(encode(dataclasses.replace(header, batch_id=10**9)), *payload)  # leased to nobody
    assert thief.errors(2) == [RejectCode.LEASE, RejectCode.LEASE]
    holder.bye()
    thief.bye()
    assert wire.stream.wait()
    after = wire.stats()
    assert delta(before.rejects, after.rejects) == {RejectCode.LEASE: 2}
    assert delta(before.rejects_by_peer, after.rejects_by_peer) == {thief.label: 2}
    assert lease.batch_id in dict(wire.stream.applied)
    wire.check_stream(start)  # the poisoned copy was never applied


def test_b12_duplicate_and_stale_batches_are_dropped_counted_and_never_applied(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    peer = attack("dup")
    peer.join()
    deadline = time.monotonic() + WAIT_S
    while not wire.consumer._ring.ready_ids():  # idle stream: the producer fills the ring
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ready = wire.consumer._ring.ready_ids()[0]  # received, not yet applied
    applied = wire.stream.applied[-1][0]  # applied long ago
    before = wire.stats()
    start = len(wire.stream.applied)
    for batch_id in (applied, ready):
        header, payload = peer.poisoned(Lease(batch_id, wire.reference.bucket(batch_id), [], 1.0))
        peer.send(encode(header), *payload)
    peer.send(b"\xc1")  # barrier: replies keep order, so a dup ERR would come first
    header, payload = peer.poisoned(Lease(ready, wire.reference.bucket(ready), [], 1.0))
    peer.send(encode(dataclasses.replace(header, epoch=wire.consumer._run_id + 1)), *payload)  # stale epoch
    peer.send(encode(Heartbeat(wire.consumer._run_id - 1)))  # stale epoch
    assert peer.errors(3) == [RejectCode.DECODE, RejectCode.UNKNOWN_PEER, RejectCode.UNKNOWN_PEER]
    peer.bye()
    wire.stream.take_and_wait(10)
    after = wire.stats()
    assert after.duplicates_dropped - before.duplicates_dropped == 2
    assert after.stale_dropped - before.stale_dropped == 2
    assert delta(before.rejects, after.rejects) == {RejectCode.DECODE: 1, RejectCode.UNKNOWN_PEER: 2}
    assert delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: 3}
    assert ready in dict(wire.stream.applied)
    wire.check_stream(start)  # the ready batch kept its real content


def test_b9_b12_negative_ids_and_epochs_are_schema_errors_not_duplicates_or_stale(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    peer = attack("negative")
    peer.join()
    header, payload = peer.poisoned(Lease(0, wire.reference.bucket(0), [], 1.0))
    before = wire.stats()
    expect_rejected(
        wire,
        [
            [encode(dataclasses.replace(header, batch_id=-1)), *payload],
            [encode(dataclasses.replace(header, epoch=-1)), *payload],
            [encode(dataclasses.replace(header, bucket=-1)), *payload],
            [encode(Heartbeat(-1))],
        ],
        peer,
        [RejectCode.SCHEMA] * 4,
    )
    after = wire.stats()
    assert (after.duplicates_dropped, after.stale_dropped) == (before.duplicates_dropped, before.stale_dropped)


# --- shared-memory path: a lease names a slot file, BATCH is a header naming slot and generation --------------


def _in_slot(peer: BadPeer, lease: Lease, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` into the lease's slot file, as a producer on the shm path does."""
    assert peer.shm_dir is not None and lease.shm is not None
    maps = SlotMappings(peer.wire.consumer._bucket_set, 1, shm_dir=None, endpoint=peer.wire.endpoint)
    views = maps.views(peer.shm_dir, lease.shm, lease.bucket)
    for key in ARRAY_KEYS:
        views[key][...] = arrays[key]


def _shm_header(
    peer: BadPeer, lease: Lease, arrays: dict[str, np.ndarray], slot_gen: tuple[int, int] | None = None
) -> BatchHeader:
    assert lease.shm is not None
    header, _ = peer.batch(lease, arrays)
    return dataclasses.replace(header, shm=slot_gen or (lease.shm.slot, lease.shm.generation))


ShmCase = Callable[[BadPeer, Lease], list[bytes]]


def _poison_then(change: Callable[[BadPeer, Lease, dict[str, np.ndarray]], list[bytes]]) -> ShmCase:
    """Poisoned (but well-formed, checksummed) content in the slot, then the message ``change`` makes."""

    def case(peer: BadPeer, lease: Lease) -> list[bytes]:
        arrays = peer.wire.reference.arrays(lease.batch_id)
        arrays["mel"][:] = 7.0
        _in_slot(peer, lease, arrays)
        return change(peer, lease, arrays)

    return case


def _real_in_slot_but_crc_of_poison(peer: BadPeer, lease: Lease) -> list[bytes]:
    real = peer.wire.reference.arrays(lease.batch_id)
    _in_slot(peer, lease, real)
    poison = {k: v.copy() for k, v in real.items()}
    poison["mel"][:] = 7.0
    return [encode(_shm_header(peer, lease, poison))]


def _length_beyond_bucket(peer: BadPeer, lease: Lease) -> list[bytes]:
    arrays = peer.wire.reference.arrays(lease.batch_id)
    arrays["mel_len"][0] = arrays["mel"].shape[1] + 1
    _in_slot(peer, lease, arrays)
    return [encode(_shm_header(peer, lease, arrays))]


def _shm(lease: Lease) -> ShmSlot:
    """The slot of a lease granted in shared-memory mode."""
    assert lease.shm is not None
    return lease.shm


def _n_slots(peer: BadPeer) -> int:
    return peer.wire.consumer._ring.n_slots


_SHM_CASES: dict[str, tuple[ShmCase, str]] = {
    "wrong-generation": (
        _poison_then(lambda p, x, a: [encode(_shm_header(p, x, a, (_shm(x).slot, _shm(x).generation + 1)))]),
        RejectCode.LEASE,
    ),
    "wrong-slot": (
        _poison_then(
            lambda p, x, a: [encode(_shm_header(p, x, a, ((_shm(x).slot + 1) % _n_slots(p), _shm(x).generation)))]
        ),
        RejectCode.LEASE,
    ),
    "payload-frames-on-shm-lease": (lambda p, x: [encode(p.poisoned(x)[0]), *p.poisoned(x)[1]], RejectCode.FRAMES),
    "slot-header-with-frames": (
        _poison_then(lambda p, x, a: [encode(_shm_header(p, x, a)), *p.batch(x, a)[1]]),
        RejectCode.FRAMES,
    ),
    "crc-mismatch": (_real_in_slot_but_crc_of_poison, RejectCode.CRC),
    "length-beyond-bucket": (_length_beyond_bucket, RejectCode.SHAPE),
    "header-shape": (
        _poison_then(
            lambda p, x, a: [
                encode(
                    dataclasses.replace(
                        _shm_header(p, x, a), shapes=[grow_frames(a["mel"].shape), *_shm_header(p, x, a).shapes[1:]]
                    )
                )
            ]
        ),
        RejectCode.SHAPE,
    ),
    "dtype": (
        _poison_then(
            lambda p, x, a: [
                encode(dataclasses.replace(_shm_header(p, x, a), dtypes=["float64", *_shm_header(p, x, a).dtypes[1:]]))
            ]
        ),
        RejectCode.DTYPE,
    ),
}


@pytest.mark.parametrize(("make", "code"), list(_SHM_CASES.values()), ids=list(_SHM_CASES))
def test_shm_batch_not_matching_its_slot_lease_is_rejected_never_applied_and_the_slot_retired(
    wire: Wire, attack: Callable[..., BadPeer], make: ShmCase, code: str
) -> None:
    peer = attack("shm")
    peer.join(caps=["shm"])
    assert peer.shm_dir is not None  # the consumer offers its slot files
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)
    lease = peer.lease()
    assert lease.shm is not None and lease.shm.slot < _n_slots(peer)
    peer.send(*make(peer, lease))
    assert peer.errors(1) == [code]
    peer.bye()
    assert wire.stream.wait()
    after = wire.stats()
    assert delta(before.rejects, after.rejects) == {code: 1}
    assert delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: 1}
    assert after.shm_retired > before.shm_retired  # the slot it wrote into was orphaned, not reused
    assert lease.batch_id in dict(wire.stream.applied)  # rebuilt by the good producer ...
    wire.check_stream(start)  # ... with the right content: the poison never applied


def test_shm_header_on_a_payload_lease_gets_err_lease(wire: Wire, attack: Callable[..., BadPeer]) -> None:
    peer = attack("noshm")
    peer.join()  # no CAP_SHM: payload leases
    assert peer.shm_dir is None
    start = len(wire.stream.applied)
    wire.stream.take(20)
    lease = peer.lease()
    assert lease.shm is None
    header, _ = peer.poisoned(lease)
    peer.send(encode(dataclasses.replace(header, shm=(0, 0))))
    assert peer.errors(1) == [RejectCode.LEASE]
    peer.bye()
    assert wire.stream.wait()
    wire.check_stream(start)
