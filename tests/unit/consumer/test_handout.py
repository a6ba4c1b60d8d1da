"""``Handout``: applied ids in plan order, the newest iterator wins, a dropped iterator's batch comes back first."""

from __future__ import annotations

import numpy as np
import pytest

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.handout import Batch, Handout


def _batch(batch_id: int) -> Batch:
    arrays = {"mel": np.zeros((2, 4, 3), np.float32), "mel_len": np.array([4, 0], np.int32),
              "tokens": np.zeros((2, 5), np.int32), "tok_len": np.array([5, 0], np.int32)}
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
    h.give_back(old, b0)                           # the superseded iterator is closed later: no-op
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
        h.hold(token, b)                           # a read-ahead stage took three
    assert h.first_held(token) is b0
    h.record_applied(b0)                           # the caller took the first
    assert h.first_held(token) is b1
    h.give_back(token, b2)                         # by identity, never by comparing arrays
    new = h.begin()
    assert h.first_held(token) is None and h.first_held(new) is None
    assert [h.pop_returned() for _ in range(2)] == [b1, b2] and not h.has_returned
    late = _batch(3)
    h.hold(token, late)                            # handed to a superseded iterator: returned, not lost
    assert h.pop_returned() is late
