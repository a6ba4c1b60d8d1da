"""Staging: batch n+1 goes to the model device while step n runs; a slot is freed when nothing reads it.

Role: ``Stager`` drives a training step over a ``Consumer``'s batches through a framework's ``StageAdapter``
(put a batch on the device, dispatch a step, tell whether a step completed, wait for its results). It
imports no framework: the TensorFlow adapter is consumer/train/handoff.py; a JAX (or any) client
writes the four methods itself (docs/guide/your-model.md, "A loop of your own").

Order on an asynchronous device (a GPU), depth 2, steady state: dispatch step k (batch k was staged
before), wait for step k-1 and report it (the host waits one step late, while step k is queued behind
it, so the device does not idle), then take batch k+1 from the ring and stage it (its copy overlaps
step k). On a synchronous device (TensorFlow on the CPU) a step has completed when its dispatch
returns: it is reported, applied and its slot freed at once, so the loop holds one slot.

An adapter whose copies are ordered after the steps already dispatched (``copies_ahead``: TensorFlow on a
GPU, where the copy waits for the compute stream as it stood when the copy was issued) needs the copy of
batch k+1 issued before step k is dispatched, or it starts only when step k has finished. Its ``put`` only
starts the copy; the stager then takes batch k+1, when the ring already holds it, and puts it before it
dispatches step k, completing the oldest dispatched step first when the window is full (a completion that
does not wait on such a device). A batch the ring does not hold yet is not waited for: step k is dispatched,
and that copy then follows it.

Invariants:
    * At most ``depth`` batches are in flight: taken from the ring and not yet completed.
    * Steps are dispatched and completed in plan order; a batch is marked applied (on the consumer's
      hand-out desk, ``HandoutDesk.mark_applied`` in consumer/handout.py) only when its step completed.
    * A slot is freed only when nothing can read it any more: when its step completed, or earlier when
      the adapter copied it and ``Staged.copied()`` says the device copy completed.
    * Before a step is dispatched while others are in flight, ``drain_before`` may ask for those to
      complete first (a checkpoint must hold the variables of exactly the applied batches).
    * ``Completed`` carries the batch's row and frame counts, read before its slot could be freed.
Errors: an exception from the adapter (or the consumer) gives every unapplied in-flight batch back
(the next iterator hands them out again, first); if one of them had its slot freed already (it was
copied), it cannot be handed out again: the consumer is closed and ``PipelineError`` raised. When the
caller stops iterating (break, an exception in its loop body), the steps already dispatched are waited
for and applied (the model has seen them); the others are given back.
Shutdown: nothing owned; the ring slots and the consumer stay the caller's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from melfeed.shared.errors import PipelineError

if TYPE_CHECKING:
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.handout import Batch, HandoutDesk

__all__ = ["Completed", "StageAdapter", "Staged", "Stager"]

log = logging.getLogger(__name__)

V = TypeVar("V")  # what a step reads: device arrays, or tensors over the slot
Out = TypeVar("Out")  # a dispatched step's outputs (not yet on the host)
R = TypeVar("R")  # a completed step's results on the host
R_co = TypeVar("R_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Staged(Generic[V]):
    """A batch put on the model device.

    ``copied``: None when ``value`` may read the slot until its step completes (it aliases host memory,
    as TensorFlow on the CPU does, or the adapter cannot tell when its copy ends); else a non-blocking
    check that is True once the device copy completed, so the slot can be freed before the step ends.
    ``host_copies``: arrays copied on the host while staging (0 for a zero-copy adapter).
    """

    value: V
    copied: Callable[[], bool] | None = None
    host_copies: int = 0


class StageAdapter(Protocol[V, Out, R_co]):
    """What a framework supplies; every method runs on the thread iterating ``Stager.run``."""

    def put(self, batch: Batch) -> Staged[V]:
        """Start moving ``batch.arrays`` to the model device (or wrap them); must not wait for a step."""

    def step(self, batch: Batch, value: V) -> Out:
        """Dispatch one training step on ``value``; may return before the device has run it."""

    def is_done(self, outputs: Out) -> bool:
        """Whether the step behind ``outputs`` has completed (never blocks; False when unknown)."""

    def wait(self, outputs: Out) -> R_co:
        """Wait until that step completed and return its results on the host (losses, metrics)."""

    # Optional: ``copies_ahead = True`` (read with getattr; default False) for an adapter whose copy is ordered
    # after the steps already dispatched (TensorFlow's, consumer/train/handoff.py) and whose ``put`` only starts
    # it. The stager then puts the next batch, when the ring already holds it, before it dispatches the step
    # ahead of it, and completes the oldest dispatched step first when that makes room (module docstring).


@dataclass(frozen=True, slots=True)
class Completed(Generic[R]):
    """One applied step. ``batch.arrays`` are invalid (its slot may hold another batch by now)."""

    batch: Batch
    result: R
    step_s: float  # host seconds dispatching the step plus waiting for it to complete
    dispatched_s: float  # time.perf_counter() when its dispatch began (periods between dispatches)
    host_copies: int  # Staged.host_copies
    rows: int  # real rows, real and padded frames: read while the slot was held
    real_frames: int
    padded_frames: int


@dataclass(slots=True)
class _InFlight(Generic[V, Out]):
    batch: Batch
    staged: Staged[V]
    figures: tuple[int, int, int]
    outputs: Out | None = None
    dispatched: bool = False
    slot_freed: bool = False
    step_s: float = 0.0
    dispatched_s: float = 0.0


class Stager(Generic[V, Out, R]):
    """Bounded staging of a consumer's batches through ``handoff``.

    Args:
        consumer: the feed; its ring must have more slots than ``depth`` (producers need one to fill).
        handoff: the framework's four operations (a ``StageAdapter``).
        depth: most batches in flight (``consumer.stage_depth``, default 2; 1 = no overlap).
    """

    def __init__(self, consumer: Consumer, handoff: StageAdapter[V, Out, R], depth: int = 2) -> None:
        n_slots = consumer._ring.n_slots
        if not 1 <= depth < n_slots:
            raise ValueError(f"stage depth must be in 1..{n_slots - 1} (ring slots - 1), got {depth}")
        self._consumer = consumer
        self._desk: HandoutDesk = consumer._desk
        self.handoff = handoff
        self.depth = depth
        self.max_in_flight = 0  # most batches ever in flight at once (<= depth)
        self._ahead = bool(getattr(handoff, "copies_ahead", False))  # StageAdapter.copies_ahead

    def run(
        self,
        stop: threading.Event | None = None,
        on_wait: Callable[[int], None] | None = None,
        drain_before: Callable[[int], bool] | None = None,
    ) -> Generator[Completed[R], None, None]:
        """Yield each completed step in plan order until the plan ends, ``stop`` is set or ``close()``.

        Starts a new hand-out iterator (it supersedes any other). ``on_wait``: see
        ``Consumer.batches``. ``drain_before(n)``: asked before a step is dispatched while ``n``
        steps are in flight; True = let those complete (and be yielded) first.
        """
        token = self._desk.begin()
        window: deque[_InFlight[V, Out]] = deque()
        return self._run(token, window, self._steps(token, window, stop, on_wait, drain_before))

    def _run(
        self, token: int, window: deque[_InFlight[V, Out]], steps: Iterator[Completed[R]]
    ) -> Generator[Completed[R], None, None]:
        while True:
            try:
                done = next(steps)
            except StopIteration:
                return
            except BaseException:  # the adapter or the consumer failed: nothing more completes
                self._give_back(token, window)
                raise
            try:
                yield done
            except BaseException:  # the caller stopped: finish what the device already runs
                self._finish_dispatched(token, window)
                raise

    def _steps(
        self,
        token: int,
        window: deque[_InFlight[V, Out]],
        stop: threading.Event | None,
        on_wait: Callable[[int], None] | None,
        drain_before: Callable[[int], bool] | None,
    ) -> Iterator[Completed[R]]:
        source_open = True
        while True:
            while window and window[0].dispatched and self.handoff.is_done(window[0].outputs):  # type: ignore[arg-type]
                yield self._complete(token, window.popleft())
            self._free_copied(window)
            pending = next((f for f in window if not f.dispatched), None)
            if pending is not None:
                running = sum(f.dispatched for f in window)
                full = self._ahead and len(window) >= self.depth  # room for the next copy first
                if running and (full or (drain_before is not None and drain_before(running))):
                    yield self._complete(token, window.popleft())
                else:
                    if self._ahead and source_open and len(window) < self.depth and pending is window[-1]:
                        self._stage_ready(token, window)
                    self._dispatch(pending)
            elif source_open and len(window) < self.depth:
                batch = self._desk.wait_next(token, stop, on_wait)
                if batch is None:
                    source_open = False
                    continue
                self._put(token, batch, window)
            elif window:
                yield self._complete(token, window.popleft())
            else:
                return

    def _stage_ready(self, token: int, window: deque[_InFlight[V, Out]]) -> None:
        """Put the next batch if the ring holds it now, so that its copy is issued before the step ahead of it."""
        batch = self._desk.take_ready(token)
        if batch is not None:
            self._put(token, batch, window)

    def _put(self, token: int, batch: Batch, window: deque[_InFlight[V, Out]]) -> None:
        self._desk.hold(token, batch)
        figures = (batch.rows, batch.real_frames, batch.padded_frames)
        window.append(_InFlight(batch, self.handoff.put(batch), figures))
        self.max_in_flight = max(self.max_in_flight, len(window))

    def _dispatch(self, f: _InFlight[V, Out]) -> None:
        t0 = f.dispatched_s = time.perf_counter()
        f.outputs = self.handoff.step(f.batch, f.staged.value)
        f.dispatched = True
        f.step_s += time.perf_counter() - t0

    def _complete(self, token: int, f: _InFlight[V, Out]) -> Completed[R]:
        """Wait for ``f``'s step, count its batch applied, free its slot (if still held)."""
        t0 = time.perf_counter()
        result = self.handoff.wait(f.outputs)  # type: ignore[arg-type]
        f.step_s += time.perf_counter() - t0
        if not self._desk.is_current(token):
            raise RuntimeError("this stager was superseded by a newer batches() / as_dataset() iterator")
        self._desk.mark_applied(f.batch)
        if not f.slot_freed:
            f.slot_freed = True
            self._desk.free_slot(f.batch)
        return Completed(f.batch, result, f.step_s, f.dispatched_s, f.staged.host_copies, *f.figures)

    def _free_copied(self, window: deque[_InFlight[V, Out]]) -> None:
        """Free the slots whose batches the device has copied (never those a step may still read)."""
        for f in window:
            if not f.slot_freed and f.staged.copied is not None and f.staged.copied():
                f.slot_freed = True
                self._desk.free_slot(f.batch)

    def _finish_dispatched(self, token: int, window: deque[_InFlight[V, Out]]) -> None:
        while window and window[0].dispatched:
            try:
                self._complete(token, window[0])
            except Exception:  # the caller's exception is the one to raise
                log.exception("a staged step failed while the loop was stopping")
                break
            window.popleft()
        self._give_back(token, window)

    def _give_back(self, token: int, window: deque[_InFlight[V, Out]]) -> None:
        lost = [f.batch.batch_id for f in window if f.slot_freed]
        for f in window:
            if not f.slot_freed:
                self._desk.give_back(token, f.batch)
        window.clear()
        if lost:
            self._consumer.close()
            raise PipelineError(
                f"batches {lost} were copied to the device and their slots reused, but their "
                "steps did not complete: they cannot be handed out again; the consumer is "
                "closed (restart from the last checkpoint)"
            )
