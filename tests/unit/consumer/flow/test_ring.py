"""Slot ring: alignment, state machine, reorder by batch id, bounded waits, close."""

from __future__ import annotations

import threading

import pytest

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.flow.ring import BatchRing, SlotState
from melfeed.shared.errors import ClosedError
from melfeed.shared.wire.buckets import Bucket

BUCKETS = (Bucket(0, 4, 16, 5, 80), Bucket(1, 2, 40, 9, 80))


def test_every_view_is_64_byte_aligned_and_disjoint() -> None:
    ring = BatchRing(3, BUCKETS)
    spans = []
    for slot in range(3):
        for bucket in (0, 1):
            for key, arr in ring.views(slot, bucket).items():
                assert arr.ctypes.data % 64 == 0, (slot, bucket, key)
                assert arr.flags.c_contiguous
        spans.append({k: (a.ctypes.data, a.ctypes.data + a.nbytes) for k, a in ring.views(slot, 1).items()})
    assert spans[0]["tok_len"][1] <= spans[1]["mel"][0]
    assert ring.views(0, 0)["mel"].shape == (4, 16, 80)


def _reserved(ring: BatchRing) -> int:
    slot = ring.reserve()
    assert slot is not None
    return slot


def test_batches_are_taken_in_id_order_whatever_the_arrival_order() -> None:
    released: list[int] = []
    ring = BatchRing(3, BUCKETS, on_release=lambda: released.append(1))
    slots = [_reserved(ring) for _ in range(3)]
    assert ring.reserve() is None
    ten = PlannedBatch(batch_id=10, data_epoch=0, bucket=1, sample_ids=(3, 4))
    ring.mark_ready(slots[0], PlannedBatch(batch_id=11, data_epoch=0, bucket=0, sample_ids=(5,)))
    ring.mark_ready(slots[1], ten, copies=1)
    assert ring.take(12, 0.0) is None
    taken = ring.take(10, 0.0)
    assert taken is not None and (taken.slot, taken.planned, taken.copies) == (slots[1], ten, 1)
    assert ring.counts()[SlotState.IN_STEP] == 1
    ring.release(slots[1])
    assert released == [1]
    assert ring.reserve() == slots[1]
    with pytest.raises(ValueError):
        ring.release(slots[0])  # READY, not IN_STEP


def test_close_wakes_a_waiting_taker() -> None:
    ring = BatchRing(3, BUCKETS)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            ring.take(0, 30.0)
        except ClosedError as err:
            errors.append(err)

    t = threading.Thread(target=wait)
    t.start()
    ring.close()
    t.join(5.0)
    assert not t.is_alive() and len(errors) == 1


def test_views_are_built_once_per_slot_and_bucket_and_each_caller_gets_its_own_dict() -> None:
    ring = BatchRing(2, BUCKETS)
    first, again = ring.views(1, 1), ring.views(1, 1)
    assert first is not again and first.keys() == again.keys()
    assert all(first[k] is again[k] for k in first)  # the same cached arrays
    for _ in range(2):
        ring.views(1, 1).pop("mel")
    assert "mel" in ring.views(1, 1)  # a caller's dict changes no other
    assert ring.views(0, 1)["mel"].ctypes.data != again["mel"].ctypes.data


def test_views_follow_a_slot_whose_memory_was_replaced_and_drop_the_old_ones() -> None:
    import numpy as np

    from melfeed.shared.wire.layout import aligned_buffer

    class Swappable:
        def __init__(self, n: int, nbytes: int) -> None:
            self.slot_nbytes = nbytes
            self.bufs = [aligned_buffer(nbytes) for _ in range(n)]

        @property
        def total_nbytes(self) -> int:
            return sum(int(b.nbytes) for b in self.bufs)

        def buffer(self, slot: int) -> np.ndarray:
            return self.bufs[slot]

        def close(self) -> None:
            pass

    probe = BatchRing(1, BUCKETS)
    memory = Swappable(2, probe.slot_nbytes)
    ring = BatchRing(2, BUCKETS, memory=memory)
    old0, old1 = ring.views(0, 0)["mel"], ring.views(0, 1)["mel"]
    memory.bufs[0] = aligned_buffer(probe.slot_nbytes)  # what ShmSlots.retire does
    new = ring.views(0, 0)["mel"]
    assert new.ctypes.data == memory.bufs[0].ctypes.data != old0.ctypes.data
    assert all(buf is memory.bufs[0] for (slot, _), (buf, _) in ring._views.items() if slot == 0)
    assert ring.views(0, 1)["mel"].ctypes.data != old1.ctypes.data
