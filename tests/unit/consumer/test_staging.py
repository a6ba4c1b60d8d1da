"""``Stager``: the order of put / step / wait / apply / free, the in-flight bound, and what errors give back.

A fake feed (the real ``HandoutDesk`` the stager talks to, over a fake ring) and a fake device that
logs every operation; no TensorFlow, no sockets.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.handout import Batch, HandoutDesk, HandoutPorts
from melfeed.consumer.staging import Staged, Stager
from melfeed.shared.errors import PipelineError

Event = tuple[str, int]


def _batch(batch_id: int) -> Batch:
    arrays = {
        "mel": np.zeros((2, 4, 3), np.float32),
        "mel_len": np.array([4, batch_id % 4], np.int32),
        "tokens": np.zeros((2, 5), np.int32),
        "tok_len": np.array([5, 1], np.int32),
    }
    samples = (batch_id,) if batch_id % 4 == 0 else (batch_id, 100 + batch_id)  # the rows mel_len says are real
    return Batch(PlannedBatch(batch_id, 0, 0, samples), arrays, slot=batch_id % 4)


class _Feed:
    """The part of ``Consumer`` the stager uses: a real ``HandoutDesk`` over a fake ring; logs take / applied / free."""

    def __init__(self, n_batches: int, events: list[Event], slots: int = 4, late: frozenset[int] = frozenset()) -> None:
        self._ring = SimpleNamespace(n_slots=slots)
        self._late = set(late)  # batch ids not in the ring at the first look that does not wait
        ports = HandoutPorts(
            check_usable=lambda: None,
            take=self._take,
            free_slot=self._free,
            applied=self._applied,
            producers_alive=lambda: 1,
            wait_timeout_s=0.01,
        )
        self._desk = HandoutDesk(0, n_batches, 0, ports)
        self.events = events
        self.closed = False
        self._in_slot: dict[int, int] = {}  # slot -> the batch id in it

    def _take(self, batch_id: int, timeout_s: float) -> Batch | None:
        if timeout_s == 0.0 and batch_id in self._late:
            self._late.discard(batch_id)
            self.events.append(("late", batch_id))
            return None
        self.events.append(("take", batch_id))
        batch = _batch(batch_id)
        assert batch.slot not in self._in_slot, "a slot taken while another batch is in it"
        self._in_slot[batch.slot] = batch_id
        return batch

    def _applied(self, batch_id: int, wake: bool) -> None:
        self.events.append(("applied", batch_id))

    def _free(self, slot: int) -> None:
        self.events.append(("free", self._in_slot.pop(slot)))

    def close(self) -> None:
        self.closed = True


class _Device:
    """A fake device: asynchronous (a step completes only when waited for) or synchronous."""

    def __init__(
        self,
        events: list[Event],
        *,
        synchronous: bool = False,
        copies: bool = False,
        fail_step: int | None = None,
        ahead: bool = False,
    ) -> None:
        self.events, self.synchronous, self.copies, self.fail_step = events, synchronous, copies, fail_step
        self.copies_ahead = ahead  # the copy is ordered after the steps dispatched before it (TensorFlow's)

    def put(self, batch: Batch) -> Staged[int]:
        self.events.append(("put", batch.batch_id))
        return Staged(batch.batch_id, copied=(lambda: True) if self.copies else None)

    def step(self, batch: Batch, value: int) -> int:
        if value == self.fail_step:
            raise RuntimeError("step failed")
        self.events.append(("step", value))
        return value

    def is_done(self, outputs: int) -> bool:
        return self.synchronous

    def wait(self, outputs: int) -> float:
        self.events.append(("wait", outputs))
        return outputs / 10


def _rig(n: int, **device: object) -> tuple[list[Event], _Feed, _Device]:
    events: list[Event] = []
    return events, _Feed(n, events), _Device(events, **device)  # type: ignore[arg-type]


def _at(events: list[Event], event: Event) -> int:
    return events.index(event)


def test_on_an_asynchronous_device_batch_n_plus_1_is_staged_and_dispatched_before_step_n_is_waited_for() -> None:
    events, feed, device = _rig(5)
    stager = Stager(feed, device, depth=2)  # type: ignore[arg-type]
    done = list(stager.run())
    assert [d.batch.batch_id for d in done] == [0, 1, 2, 3, 4] and [d.result for d in done] == [0, 0.1, 0.2, 0.3, 0.4]
    assert events[:12] == [
        ("take", 0),
        ("put", 0),
        ("step", 0),
        ("take", 1),
        ("put", 1),
        ("step", 1),
        ("wait", 0),
        ("applied", 0),
        ("free", 0),
        ("take", 2),
        ("put", 2),
        ("step", 2),
    ]
    for k in range(4):
        assert _at(events, ("put", k + 1)) < _at(events, ("wait", k))  # the copy overlaps step k
        assert _at(events, ("wait", k)) < _at(events, ("applied", k)) < _at(events, ("free", k))
    assert stager.max_in_flight == 2 and feed._desk.applied_ids == [0, 1, 2, 3, 4]
    assert [d.rows for d in done] == [1, 2, 2, 2, 1] and done[1].real_frames == 5 and done[0].padded_frames == 8


def test_depth_bounds_the_batches_in_flight() -> None:
    events, feed, device = _rig(8)
    stager = Stager(feed, device, depth=3)  # type: ignore[arg-type]
    for _ in stager.run():
        taken = sum(e[0] == "take" for e in events)
        assert taken - feed._desk.applied <= 3
    assert stager.max_in_flight == 3


def test_on_a_synchronous_device_each_step_is_applied_and_its_slot_freed_before_the_next_batch_is_taken() -> None:
    events, feed, device = _rig(3, synchronous=True)
    stager = Stager(feed, device, depth=2)  # type: ignore[arg-type]
    list(stager.run())
    assert events[:7] == [("take", 0), ("put", 0), ("step", 0), ("wait", 0), ("applied", 0), ("free", 0), ("take", 1)]
    assert stager.max_in_flight == 1


def test_a_copied_batch_frees_its_slot_before_its_step_completes_but_is_applied_only_after() -> None:
    events, feed, device = _rig(3, copies=True)
    list(Stager(feed, device, depth=2).run())  # type: ignore[arg-type]
    for k in range(3):
        assert (
            _at(events, ("free", k)) < _at(events, ("step", k)) < _at(events, ("wait", k)) < _at(events, ("applied", k))
        )


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "copies-ahead"])
def test_drain_before_lets_the_steps_in_flight_complete_before_the_next_dispatch(ahead: bool) -> None:
    events, feed, device = _ahead_rig(4) if ahead else _rig(4)
    asked: list[int] = []

    def drain(running: int) -> bool:
        asked.append(running)
        return True

    list(Stager(feed, device, depth=3 if ahead else 2).run(drain_before=drain))  # type: ignore[arg-type]
    for k in range(3):
        assert _at(events, ("wait", k)) < _at(events, ("step", k + 1))
        if not ahead:
            assert _at(events, ("put", k + 1)) < _at(events, ("wait", k))
    assert asked and set(asked) == {1}


def test_a_failing_step_gives_every_unapplied_batch_back_lowest_id_first() -> None:
    events, feed, device = _rig(6, fail_step=2)
    with pytest.raises(RuntimeError, match="step failed"):
        list(Stager(feed, device, depth=2).run())  # type: ignore[arg-type]
    assert feed._desk.applied_ids == [0]
    assert ("free", 1) not in events and ("free", 2) not in events  # their slots are still held
    again = [feed._desk.next_batch(0.0), feed._desk.next_batch(0.0)]
    assert [b.batch_id for b in again if b is not None] == [1, 2] and not feed.closed


def test_a_failing_step_after_its_slot_was_freed_closes_the_feed_with_one_line() -> None:
    events, feed, device = _rig(6, copies=True, fail_step=1)
    with pytest.raises(PipelineError, match=r"batches \[0, 1\] were copied to the device and their slots reused"):
        list(Stager(feed, device, depth=2).run())  # type: ignore[arg-type]
    assert feed.closed


def test_a_loop_that_breaks_out_gets_its_dispatched_steps_applied_and_the_rest_given_back() -> None:
    events, feed, device = _rig(6)
    stager = Stager(feed, device, depth=2)  # type: ignore[arg-type]
    for done in stager.run():
        if done.batch.batch_id == 0:
            break  # batch 1 was dispatched: the model has seen it
    assert feed._desk.applied_ids == [0, 1] and ("free", 1) in events and not feed._desk.has_returned
    assert [d.batch.batch_id for d in stager.run()] == [2, 3, 4, 5]


def test_stop_ends_the_run_after_the_steps_in_flight_completed() -> None:
    events, feed, device = _rig(10)
    stop = threading.Event()
    seen = []
    for done in Stager(feed, device, depth=2).run(stop):  # type: ignore[arg-type]
        seen.append(done.batch.batch_id)
        stop.set()
    assert seen == [0, 1] and feed._desk.applied_ids == [0, 1] and not feed._desk.has_returned


@pytest.mark.parametrize("depth", [0, 4])
def test_a_depth_that_leaves_producers_no_slot_is_refused(depth: int) -> None:
    _, feed, device = _rig(1)
    with pytest.raises(ValueError, match="stage depth must be in 1..3"):
        Stager(feed, device, depth=depth)  # type: ignore[arg-type]


def _ahead_rig(n: int, late: frozenset[int] = frozenset()) -> tuple[list[Event], _Feed, _Device]:
    events: list[Event] = []
    return events, _Feed(n, events, late=late), _Device(events, copies=True, ahead=True)


def test_copies_ahead_puts_batch_k_plus_1_before_step_k_is_dispatched_within_the_depth() -> None:
    events, feed, device = _ahead_rig(6)
    stager = Stager(feed, device, depth=2)  # type: ignore[arg-type]
    done = [d.batch.batch_id for d in stager.run()]
    assert done == [0, 1, 2, 3, 4, 5] and feed._desk.applied_ids == done
    for k in range(5):
        assert _at(events, ("put", k + 1)) < _at(events, ("step", k))  # its copy is issued before step k
        assert _at(events, ("wait", k)) < _at(events, ("step", k + 1))  # the window made room first
    assert stager.max_in_flight == 2


def test_copies_ahead_does_not_wait_for_a_batch_the_ring_does_not_hold_yet() -> None:
    events, feed, device = _ahead_rig(4, late=frozenset({2}))
    done = [d.batch.batch_id for d in Stager(feed, device, depth=2).run()]  # type: ignore[arg-type]
    assert done == [0, 1, 2, 3]
    assert _at(events, ("late", 2)) < _at(events, ("step", 1)) < _at(events, ("put", 2))  # step 1 went first
    assert _at(events, ("put", 3)) < _at(events, ("step", 2))  # and the next one is ahead again
