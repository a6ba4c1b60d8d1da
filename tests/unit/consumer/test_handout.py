"""``Handout``: applied ids in plan order, the newest iterator wins, a dropped iterator's batch comes back first.

``HandoutDesk`` over fake ports (a ring of batches made on demand): what the receiver hears, held and read-ahead slots.
"""

from __future__ import annotations

import numpy as np
import pytest

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.handout import Batch, Handout, HandoutDesk, HandoutPorts


def _batch(batch_id: int) -> Batch:
    arrays = {
        "mel": np.zeros((2, 4, 3), np.float32),
        "mel_len": np.array([4, 0], np.int32),
        "tokens": np.zeros((2, 5), np.int32),
        "tok_len": np.array([5, 0], np.int32),
    }
    return Batch(PlannedBatch(batch_id, 0, 0, (batch_id,)), arrays, slot=batch_id % 3)


def test_applied_ids_are_recorded_in_plan_order_from_the_start_batch() -> None:
    h = Handout(start_batch=7)
    for i in (7, 8, 9):
        h.record_applied(_batch(i))
    assert h.applied_ids == [7, 8, 9] and h.applied == 3


def test_applying_out_of_plan_order_is_refused() -> None:
    h = Handout(start_batch=0)
    with pytest.raises(RuntimeError, match="out of order"):
        h.record_applied(_batch(1))


def test_a_dropped_iterator_gives_its_batch_back_first() -> None:
    h = Handout(0)
    token = h.begin()
    b0 = _batch(0)
    h.hold(token, b0)
    h.give_back(token, b0)
    assert h.has_returned and h.pop_returned() is b0 and not h.has_returned


def test_a_new_iterator_takes_the_held_batch_over_and_the_old_one_cannot_give_it_back_twice() -> None:
    h = Handout(0)
    old = h.begin()
    b0 = _batch(0)
    h.hold(old, b0)
    new = h.begin()
    assert not h.is_current(old) and h.is_current(new)
    h.give_back(old, b0)  # the superseded iterator is closed later: no-op
    assert h.pop_returned() is b0 and h.pop_returned() is None


def test_an_applied_batch_is_no_longer_held_so_a_new_iterator_does_not_return_it() -> None:
    h = Handout(0)
    token = h.begin()
    b0 = _batch(0)
    h.hold(token, b0)
    h.record_applied(b0)
    h.begin()
    assert not h.has_returned


def test_batch_reports_rows_frames_and_identity() -> None:
    b = _batch(3)
    assert (b.batch_id, b.bucket, b.sample_ids) == (3, 0, (3,))
    assert (b.rows, b.real_frames, b.padded_frames) == (1, 4, 8)
    assert b.row_mask.tolist() == [True, False] and not b.row_mask.flags.writeable


def test_several_held_batches_come_back_lowest_id_first_whichever_order_they_are_given_back() -> None:
    h = Handout(0)
    token = h.begin()
    b0, b1, b2 = _batch(0), _batch(1), _batch(2)
    for b in (b0, b1, b2):
        h.hold(token, b)
    h.record_applied(b0)
    h.give_back(token, b2)
    h.give_back(token, b1)
    assert [h.pop_returned(), h.pop_returned(), h.pop_returned()] == [b1, b2, None]


def test_a_new_iterator_returns_every_batch_the_old_one_held_in_id_order() -> None:
    h = Handout(0)
    old = h.begin()
    b0, b1 = _batch(0), _batch(1)
    h.hold(old, b0)
    h.hold(old, b1)
    h.begin()
    assert [h.pop_returned(), h.pop_returned(), h.pop_returned()] == [b0, b1, None]


def test_an_iterator_may_hold_several_read_ahead_batches_and_a_new_one_gets_them_back_in_order() -> None:
    h = Handout(0)
    token = h.begin()
    b0, b1, b2 = _batch(0), _batch(1), _batch(2)
    for b in (b0, b1, b2):
        h.hold(token, b)  # a read-ahead stage took three
    assert h.first_held(token) is b0
    h.record_applied(b0)  # the caller took the first
    assert h.first_held(token) is b1
    h.give_back(token, b2)  # by identity, never by comparing arrays
    new = h.begin()
    assert h.first_held(token) is None and h.first_held(new) is None
    assert [h.pop_returned() for _ in range(2)] == [b1, b2] and not h.has_returned
    late = _batch(3)
    h.hold(token, late)  # handed to a superseded iterator: returned, not lost
    assert h.pop_returned() is late


class _Ports:
    """A desk's consumer side: every batch arrives at once; records what the receiver hears and the slots freed."""

    def __init__(self) -> None:
        self.heard: list[tuple[int, bool]] = []
        self.freed: list[int] = []

    def desk(self, end_batch: int | None) -> HandoutDesk:
        ports = HandoutPorts(
            check_usable=lambda: None,
            take=lambda batch_id, timeout_s: _batch(batch_id),
            free_slot=self.freed.append,
            applied=lambda i, wake: self.heard.append((i, wake)),
            producers_alive=lambda: 1,
            wait_timeout_s=0.01,
        )
        return HandoutDesk(0, end_batch, 0, ports)


def test_the_desk_records_each_applied_batch_once_and_tells_the_receiver_waking_it_for_the_last() -> None:
    ports = _Ports()
    desk = ports.desk(end_batch=3)
    assert [b.batch_id for b in desk.iterate(None, None)] == [0, 1, 2]
    assert desk.applied_ids == [0, 1, 2] and desk.finished
    assert ports.heard == [(0, False), (1, False), (2, True)] and ports.freed == [0, 1, 2]


def test_a_dataset_element_stays_applied_with_its_slot_held_until_a_new_iterator_begins() -> None:
    ports = _Ports()
    desk = ports.desk(end_batch=None)
    token = desk.begin()
    batch = desk.wait_next(token)
    assert batch is not None
    desk.apply_and_hold(batch)
    assert desk.applied_ids == [0] and ports.freed == []
    desk.begin()  # a late-collected Keras iterator keeps no slot
    assert ports.freed == [batch.slot]
    desk.free_held_slot(batch)  # its finalizer runs later: nothing is freed twice
    assert ports.freed == [batch.slot]


def test_read_ahead_is_applied_only_when_taken_and_only_for_the_current_iterator() -> None:
    ports = _Ports()
    desk = ports.desk(end_batch=None)
    old = desk.begin()
    b0, b1 = desk.wait_next(old), desk.wait_next(old)
    assert b0 is not None and b1 is not None
    desk.hold(old, b0)
    desk.hold(old, b1)
    desk.consume_read_ahead(old, 1, keep_slot=False)  # not the oldest held: ignored
    desk.consume_read_ahead(old, 0, keep_slot=False)  # copied to a device: applied, slot freed now
    assert desk.applied_ids == [0] and ports.freed == [b0.slot]
    new = desk.begin()
    desk.consume_read_ahead(old, 1, keep_slot=False)  # superseded: handed out again instead
    assert desk.applied_ids == [0] and desk.wait_next(new) is b1
