"""Sliding-window figures of the step loop: stall %, step time p50/p99 and CV, rates, padding.

Role: pure arithmetic over step records (no clock of its own, no I/O), so the same numbers feed the
status line, the summary and tests with hand-computed values. One record per applied batch:
``StepRecord(end_s, wait_s, step_s, rows, real_frames, padded_frames, queue_depth)``.
Definitions (docs/design.md "Feed efficiency"; docs/reference/metrics.md), over the records whose ``end_s`` falls in the
window ``(now - window_s, now]``:
    * wall = now - (end_s of the oldest record - its wait_s - its step_s), the span they cover;
    * stall % = 100 * sum(wait_s) / wall;
    * batches/s = n / wall, samples/s = sum(rows) / wall;
    * step p50 / p99: nearest-rank percentiles of ``step_s``; CV = population std / mean;
    * padding efficiency = sum(real_frames) / sum(padded_frames);
    * feed efficiency = sum(resident_s) / wall over EVERY record added so far (not only the window's): the
      time the same compiled step needs for the same bucket sequence on batches already resident on its
      device (no loader at all), over the time the fed loop took; = batches/s / resident steps/s. 1.0 is
      the limit no loader can beat. None (not measured yet) before ``feed_min_steps`` records
      (``FEED_EFFICIENCY_MIN_STEPS``, docs/design.md "Feed efficiency" says why that many), and when a
      record has no ``resident_s`` (the limit was not measured).
Feed efficiency goals (``feed_efficiency_goal``): >= 0.95 on a CPU step, >= 0.98 on a GPU step.
Invariants: memory is bounded by ``max_records`` (the oldest are dropped first).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = [
    "StepRecord",
    "WindowFigures",
    "StepWindow",
    "percentile",
    "PHASES",
    "PHASE_COMPILING",
    "PHASE_TRAINING",
    "PHASE_WAITING",
    "PHASE_DONE",
    "FEED_EFFICIENCY_GOAL_CPU",
    "FEED_EFFICIENCY_GOAL_GPU",
    "feed_efficiency_goal",
    "FEED_EFFICIENCY_MIN_STEPS",
]

# What the step loop is doing, as the metrics snapshot, ``status``, Prometheus and ``report`` name it.
PHASE_COMPILING = "compiling"  # from start until every bucket shape is compiled (READY)
PHASE_TRAINING = "training"  # steps are running
PHASE_WAITING = "waiting"  # a bounded wait for the next batch brought none
PHASE_DONE = "done"  # the loop ended; the last snapshot of a run
PHASES = (PHASE_COMPILING, PHASE_TRAINING, PHASE_WAITING, PHASE_DONE)
FEED_EFFICIENCY_GOAL_CPU = 0.95  # a CPU step shares its cores with the hand-off
FEED_EFFICIENCY_GOAL_GPU = 0.98  # a GPU step: the copy overlaps, only the dispatch is left
FEED_EFFICIENCY_MIN_STEPS = 100  # fed steps before feed efficiency is reported (docs/design.md)


def feed_efficiency_goal(on_gpu: bool) -> float:
    """The feed efficiency a run should reach: 0.98 when the step runs on a GPU, else 0.95."""
    return FEED_EFFICIENCY_GOAL_GPU if on_gpu else FEED_EFFICIENCY_GOAL_CPU


@dataclass(frozen=True, slots=True)
class StepRecord:
    end_s: float  # when the step finished (monotonic seconds)
    wait_s: float  # time the loop waited for this batch
    step_s: float  # time the step itself took
    rows: int  # real samples in the batch
    real_frames: int
    padded_frames: int
    queue_depth: int  # ready batches in the ring when it was taken
    resident_s: float | None = None  # the step time of its bucket on a resident batch (None: not measured)


@dataclass(frozen=True, slots=True)
class WindowFigures:
    batches: int
    wall_s: float
    stall_pct: float
    batches_per_s: float
    samples_per_s: float
    step_p50_s: float
    step_p99_s: float
    step_cv: float
    padding_efficiency: float
    queue_depth_mean: float
    feed_efficiency: float | None = None  # over every record so far (module docstring); None: not measured yet
    feed_steps_to_go: int = 0  # records still needed before feed efficiency is reported (0: none)


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list (``nan`` when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


class StepWindow:
    def __init__(
        self, window_s: float = 30.0, max_records: int = 100_000, feed_min_steps: int = FEED_EFFICIENCY_MIN_STEPS
    ) -> None:
        if window_s <= 0 or max_records < 1 or feed_min_steps < 1:
            raise ValueError("window_s must be > 0, max_records and feed_min_steps >= 1")
        self.window_s = window_s
        self.feed_min_steps = feed_min_steps
        self._records: deque[StepRecord] = deque(maxlen=max_records)
        self._fed = 0  # records added, for feed efficiency (never trimmed)
        self._fed_start_s = 0.0  # when the first record's wait began
        self._resident_s: float | None = 0.0  # sum of every record's resident_s; None once one had none

    def add(self, record: StepRecord) -> None:
        self._records.append(record)
        if self._fed == 0:
            self._fed_start_s = record.end_s - record.wait_s - record.step_s
        self._fed += 1
        if self._resident_s is not None:
            self._resident_s = None if record.resident_s is None else self._resident_s + record.resident_s

    def feed_efficiency(self, now_s: float) -> float | None:
        """Sum of every record's ``resident_s`` over the wall since the first began; None before
        ``feed_min_steps`` records or when one had no ``resident_s``."""
        if self._fed < self.feed_min_steps or self._resident_s is None:
            return None
        return self._resident_s / max(1e-9, now_s - self._fed_start_s)

    def _trim(self, now_s: float) -> list[StepRecord]:
        while self._records and self._records[0].end_s <= now_s - self.window_s:
            self._records.popleft()
        return list(self._records)

    def depth_histogram(self, now_s: float) -> list[int]:
        """Counts per queue depth over the window: index = depth seen when a batch was taken."""
        recs = self._trim(now_s)
        hist = [0] * (max((max(0, r.queue_depth) for r in recs), default=-1) + 1)
        for r in recs:
            hist[max(0, r.queue_depth)] += 1
        return hist

    def figures(self, now_s: float) -> WindowFigures | None:
        """The figures over the window ending at ``now_s``; ``None`` with no record in it."""
        recs = self._trim(now_s)
        if not recs:
            return None
        first = recs[0]
        wall = max(1e-9, now_s - (first.end_s - first.wait_s - first.step_s))
        steps = sorted(r.step_s for r in recs)
        mean = sum(steps) / len(steps)
        std = math.sqrt(sum((s - mean) ** 2 for s in steps) / len(steps))
        padded = sum(r.padded_frames for r in recs)
        return WindowFigures(
            batches=len(recs),
            wall_s=wall,
            stall_pct=100.0 * sum(r.wait_s for r in recs) / wall,
            batches_per_s=len(recs) / wall,
            samples_per_s=sum(r.rows for r in recs) / wall,
            step_p50_s=percentile(steps, 50),
            step_p99_s=percentile(steps, 99),
            step_cv=std / mean if mean > 0 else 0.0,
            padding_efficiency=sum(r.real_frames for r in recs) / padded if padded else 0.0,
            queue_depth_mean=sum(r.queue_depth for r in recs) / len(recs),
            feed_efficiency=self.feed_efficiency(now_s),
            feed_steps_to_go=max(0, self.feed_min_steps - self._fed) if self._resident_s is not None else 0,
        )
