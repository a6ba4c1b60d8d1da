"""The TensorFlow hand-off copying ahead, on the CPU: the copy of batch k+1 is issued on the copy thread
before step k is dispatched, the slot is held to its step's end (the CPU region aliases it), and training is
bit-identical to the hand-off without the copy thread. What the CPU cannot show (the copy overlapping the
step on a GPU) is in docs/design.md "The path of one batch"."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.handout import Batch, HandoutDesk, HandoutPorts
from melfeed.consumer.staging import Stager
from melfeed.consumer.train.device.packed import PackedSteps
from melfeed.consumer.train.handoff import TfStageAdapter
from melfeed.consumer.train.model import StepSpec, build_reference_step
from melfeed.consumer.train.step import CompiledStep
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.layout import aligned_buffer, batch_layout, layout_nbytes, layout_views

pytestmark = pytest.mark.tf

N_MELS = 16
BUCKET = Bucket(0, 4, 24, 8, N_MELS)
_BATCHES = 6
_SLOTS = 3
_BOUND_S = 60.0  # a copy held for a dispatch that never comes fails the test instead of hanging it


class _Feed:
    """The part of ``Consumer`` the stager uses: a real ``HandoutDesk`` over real aligned slots, filled at take."""

    def __init__(self, events: list[tuple[str, int, str]]) -> None:
        self._ring = SimpleNamespace(n_slots=_SLOTS)
        self.buffers = [aligned_buffer(layout_nbytes(BUCKET) + 4096) for _ in range(_SLOTS)]
        self._in_slot: dict[int, int] = {}
        self._rng = np.random.default_rng(5)
        self.events = events
        ports = HandoutPorts(lambda: None, self._take, self._free, lambda i, w: None, lambda: 1, 0.01)
        self._desk = HandoutDesk(0, _BATCHES, 0, ports)

    def _take(self, batch_id: int, timeout_s: float) -> Batch | None:
        slot = next(s for s in range(_SLOTS) if s not in self._in_slot)
        self._in_slot[slot] = batch_id
        views = layout_views(self.buffers[slot], 0, batch_layout(BUCKET))
        views["mel"][...] = self._rng.normal(size=views["mel"].shape)
        views["mel_len"][...] = self._rng.integers(1, 25, 4)
        views["tokens"][...] = self._rng.integers(1, 32, views["tokens"].shape)
        views["tok_len"][...] = self._rng.integers(1, 9, 4)
        return Batch(PlannedBatch(batch_id, 0, 0, (0, 1, 2, 3)), views, slot=slot)

    def _free(self, slot: int) -> None:
        self.events.append(("free", self._in_slot.pop(slot), threading.current_thread().name))


def _packed() -> tuple[Any, PackedSteps]:
    step = build_reference_step(StepSpec(N_MELS, 32, 1e-3, False, 0))
    packed = PackedSteps.for_buckets(CompiledStep(step, [BUCKET.shapes()], jit_compile=False), [BUCKET], None)
    packed.warm_up(step.variables())
    return step, packed


def _stage_all(packed: PackedSteps, feed: _Feed, on_step: Any, copy_ahead: bool) -> TfStageAdapter:
    """Every batch of the plan through a ``Stager`` over ``feed`` and the hand-off; the hand-off, closed."""
    handoff = TfStageAdapter(
        packed,
        None,
        on_step=on_step,
        slot_buffer=feed.buffers.__getitem__,
        copy_ahead=copy_ahead,
        next_copy_start_s=_BOUND_S,  # the order under test must not depend on how busy the machine is
    )
    try:
        done = [d.batch.batch_id for d in Stager(feed, handoff, depth=2).run()]  # type: ignore[arg-type]
    finally:
        handoff.close()
    assert done == list(range(_BATCHES))
    return handoff


def _train(copy_ahead: bool) -> tuple[list[bytes], list[tuple[str, int, str]], TfStageAdapter]:
    step, packed = _packed()
    events: list[tuple[str, int, str]] = []
    feed = _Feed(events)
    placing = packed.place

    def place(parts: Any) -> Any:
        events.append(("copy", len([e for e in events if e[0] == "copy"]), threading.current_thread().name))
        return placing(parts)

    packed.place = place  # type: ignore[method-assign]  # observed, not replaced
    handoff = _stage_all(
        packed, feed, lambda n: events.append(("step", n - 1, threading.current_thread().name)), copy_ahead
    )
    return [v.numpy().tobytes() for v in step.variables()], events, handoff


def test_the_copy_of_batch_k_plus_1_is_issued_on_the_copy_thread_before_step_k_and_training_is_unchanged() -> None:
    want, _, plain = _train(copy_ahead=False)
    got, events, handoff = _train(copy_ahead=True)
    assert got == want  # every variable, bit for bit
    assert not plain.copies_ahead and plain.dispatched_behind_copy == 0
    at = {(what, k): i for i, (what, k, _) in enumerate(events)}
    for k in range(_BATCHES - 1):
        assert at[("copy", k + 1)] < at[("step", k)]  # issued before the step ahead of it
        assert at[("step", k)] < at[("free", k)]  # the CPU region aliases the slot: held to its step's end
    assert {name for what, _, name in events if what == "copy"} == {"melfeed-copy"}
    assert handoff.dispatched_behind_copy == _BATCHES - 1 and handoff.transfers == _BATCHES


def test_a_batch_put_and_given_back_undispatched_does_not_hold_up_the_next_and_none_steps_twice() -> None:
    _, packed = _packed()
    feed = _Feed([])
    handoff = TfStageAdapter(packed, None, slot_buffer=feed.buffers.__getitem__, copy_ahead=True)
    try:
        batch = feed._take(0, 0.0)
        assert batch is not None
        given_back = handoff.put(batch)  # a stopped iterator gives it back before its step
        again = handoff.put(batch)  # the next iterator hands it out again
        handoff.step(batch, again.value)
        with pytest.raises(RuntimeError, match="dispatched twice, or never put"):
            handoff.step(batch, given_back.value)
        assert handoff.dispatched == 1
    finally:
        handoff.close()


def test_step_k_is_dispatched_while_the_copy_of_batch_k_plus_1_is_still_running() -> None:
    """Each copy after the first is held until the step ahead of it was dispatched: with the copy issued ahead
    the run goes on (the dispatch did not wait for that copy to end); issued after its step, it would find
    that step already dispatched, which the test records."""
    _, packed = _packed()
    dispatched = [threading.Event() for _ in range(_BATCHES)]
    late: list[int] = []  # copies that began after the step ahead of them was dispatched
    placing, copies = packed.place, iter(range(_BATCHES))

    def held_place(parts: Any) -> Any:
        k = next(copies)
        if k > 0:
            if dispatched[k - 1].is_set():
                late.append(k)
            assert dispatched[k - 1].wait(_BOUND_S), f"step {k - 1} was never dispatched while copy {k} ran"
        return placing(parts)

    packed.place = held_place  # type: ignore[method-assign]
    _stage_all(packed, _Feed([]), lambda n: dispatched[n - 1].set(), copy_ahead=True)
    assert late == []
