"""Unit tests for consumer/flow/shm_leases.py through the session: shared-memory leases and their fencing.

A slot whose shm lease ends unfilled is retired (new generation); a BATCH is taken in place only from
the lease's own producer naming the slot and generation its lease named, so a zombie's late header
is refused and never read.
"""

from __future__ import annotations

from melfeed.consumer.flow.credit import ActiveLease
from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.flow.ring import SlotState
from melfeed.consumer.flow.shm_leases import ShmLeases
from melfeed.shared.errors import ProtocolError
from melfeed.shared.wire.protocol import CAP_SHM, Bye, RejectCode, ShmSlot
from tests.fakes import FakeSlotFiles
from tests.unit.consumer.flow.session.session_rig import EPOCH, A, B, Rig, err_codes, header, ids

SHM = (CAP_SHM,)


def test_an_shm_producer_is_told_the_directory_and_leased_named_slot_files() -> None:
    files = FakeSlotFiles(3, directory="/run/melfeed")
    rig = Rig(n_slots=3, window=2, shm=files)
    assert rig.join(A, caps=SHM).shm_dir == "/run/melfeed"
    assert rig.join(B).shm_dir is None  # did not offer CAP_SHM
    grants = rig.grant()
    assert [x.shm for x in grants[A]] == [ShmSlot(files.name(0), 0, 0), ShmSlot(files.name(1), 1, 0)]
    assert [x.shm for x in grants[B]] == [None]  # a payload lease


def test_a_header_only_batch_naming_its_slot_and_generation_is_taken_in_place() -> None:
    rig = Rig(window=1, shm=FakeSlotFiles(3))
    rig.join(A, caps=SHM)
    [lease] = rig.grant()[A]
    assert lease.shm is not None
    decision = rig.deliver(A, 0, shm=(lease.shm.slot, lease.shm.generation))
    assert decision.intake is not None and decision.intake.in_place
    ready = rig.ring.take(0, 0.0)
    assert ready is not None and ready.slot == lease.shm.slot and ready.copies == 1  # one copy: built in the slot
    assert rig.session.stats().shm_retired == 0


def test_an_expired_shm_lease_retires_its_slot_and_the_zombies_late_batch_is_refused() -> None:
    files = FakeSlotFiles(1)
    rig = Rig(n_slots=1, window=1, lease_timeout_s=10.0, shm=files)
    rig.join(A, caps=SHM)
    [old] = rig.grant()[A]
    assert old.shm == ShmSlot(files.name(0), 0, 0)
    rig.clock.advance(5.0)
    rig.join(B, caps=SHM)
    rig.clock.advance(5.1)  # A's deadline passes; A is alive
    rig.heartbeat(A)
    grants = rig.loop()
    assert files.retired_slots == [0] and rig.session.stats().shm_retired == 1
    [new] = grants[B]
    assert new.batch_id == 0 and new.shm == ShmSlot(files.name(0), 0, 1)  # the next generation
    # A wakes up and says it built batch 0 in the old generation: refused, nothing read
    assert err_codes(rig.deliver(A, 0, shm=(0, 0))) == [RejectCode.LEASE]
    assert err_codes(rig.deliver(B, 0, shm=(0, 0))) == [RejectCode.LEASE]  # the holder, wrong generation
    assert err_codes(rig.deliver(A, 0, shm=(0, 1))) == [RejectCode.LEASE]  # not the holder, though it names it
    assert err_codes(rig.deliver(A, 0)) == [RejectCode.LEASE]  # nor its payload copy
    assert rig.session.stats().batches_received == 0 and [x.batch_id for x in rig.book.leases_of(B)] == [0]
    assert rig.deliver(B, 0, shm=(0, 1)).intake is not None


def test_a_slot_delivered_in_place_is_a_payload_slot_for_its_next_payload_lease() -> None:
    rig = Rig(n_slots=1, window=1, shm=FakeSlotFiles(1))
    rig.join(A, caps=SHM)
    [lease] = rig.grant()[A]
    assert lease.shm is not None and rig.deliver(A, 0, shm=(0, 0)).intake is not None
    ready = rig.ring.take(0, 0.0)
    assert ready is not None and ready.slot == 0
    rig.ring.release(ready.slot)
    rig.send(A, Bye(EPOCH))
    rig.join(B)  # payload producer
    assert ids(rig.grant()[B]) == [1]
    decision = rig.deliver(B, 1)
    assert decision.intake is not None and not decision.intake.in_place  # its frames go into the slot


def test_a_payload_batch_for_an_shm_lease_of_another_producer_is_refused() -> None:
    rig = Rig(n_slots=2, window=1, shm=FakeSlotFiles(2))
    rig.join(A, caps=SHM)
    rig.join(B)
    assert ids(rig.grant()[A]) == [0]
    # B never held batch 0; even if it had, its frames must never be written into A's slot file
    assert err_codes(rig.deliver(B, 0)) == [RejectCode.LEASE]
    assert rig.ring.counts()[SlotState.LEASED] == 2


def test_a_header_naming_a_slot_on_a_payload_lease_is_refused() -> None:
    rig = Rig(window=1, shm=FakeSlotFiles(3))
    rig.join(A)  # payload producer
    [lease] = rig.grant()[A]
    assert lease.shm is None
    assert err_codes(rig.deliver(A, 0, shm=(0, 0))) == [RejectCode.LEASE]


def test_a_slot_that_fell_back_to_private_memory_is_leased_as_a_payload_slot() -> None:
    rig = Rig(n_slots=2, window=2, shm=FakeSlotFiles(2, private=frozenset({0})))
    rig.join(A, caps=SHM)
    assert [x.shm is None for x in rig.grant()[A]] == [True, False]


def test_a_refused_in_place_batch_retires_its_slot() -> None:
    files = FakeSlotFiles(3)
    rig = Rig(window=1, shm=files)
    rig.join(A, caps=SHM)
    [lease] = rig.grant()[A]
    assert lease.shm is not None
    decision = rig.send(A, header(0, shm=(lease.shm.slot, 0)))
    assert decision.intake is not None
    rig.session.on_batch_refused(decision.intake, ProtocolError(RejectCode.SHAPE, "mel_len"), rig.clock())
    assert files.retired_slots == [lease.shm.slot]
    [again] = rig.grant()[A]
    assert again.batch_id == 0 and again.shm is not None and again.shm.generation == 1


def test_a_producer_leaving_retires_every_slot_it_held_but_not_delivered_ones() -> None:
    files = FakeSlotFiles(3)
    rig = Rig(n_slots=3, window=3, shm=files)
    rig.join(A, caps=SHM)
    leases = rig.grant()[A]
    first = leases[0].shm
    assert first is not None
    rig.deliver(A, 0, shm=(first.slot, first.generation))
    rig.send(A, Bye(EPOCH, exit_code=1, reason="crash"))
    assert sorted(files.retired_slots) == sorted(x.shm.slot for x in leases[1:] if x.shm is not None)
    assert first.slot not in files.retired_slots  # READY: nobody may write it


def test_without_slot_files_every_lease_is_a_payload_lease() -> None:
    book = ShmLeases(None)
    lease = ActiveLease(PlannedBatch(batch_id=0, data_epoch=0, bucket=0, sample_ids=()), A, 0, 10.0)
    assert not book.is_enabled and book.directory is None and book.retired == 0
    assert book.slot_for(lease, uses_shm=True) is None and not book.is_in_place(0)
    assert book.cancel(lease) is False
