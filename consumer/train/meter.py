"""The step loop's meter and its periodic status line.

Role: counts what the summary needs since warm-up (batches, samples, frames, every step's time)
and keeps the live window of the status line: the same ``melfeed.shared.metrics.StepWindow`` arithmetic,
over the same ``consumer.metrics_window_s``, as the metrics snapshot (consumer/observe/telemetry.py),
so the status line and ``melfeed status`` agree on batches/s, samples/s and stall %.
``OutputMeans`` averages the steps' named scalars (``consumer/train/outputs.py``) per status
interval from the sums the device accumulated; the status line, the snapshot, Prometheus and
``melfeed status`` show those means.
Invariants: rates come only from ``StepWindow.figures`` (the span the records cover, their wait and
step time included), never from counters divided by time since the last line: with slow steps that
divided a batch by the microseconds since it ended (it printed 3930 batches/s for 0.5).
``format_status_line`` and ``OutputMeans`` are pure (no clock, no TensorFlow); the loop decides
when an interval ends. Shutdown: nothing to release.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from melfeed.shared.metrics import StepRecord, StepWindow, WindowFigures

__all__ = ["LoopMeter", "OutputMeans", "format_outputs", "format_status_line"]

_SUMMARY_RECORDS = 100_000  # newest step times kept for the summary's percentiles (~5 MB)


class IntervalFigures(Protocol):
    """One host read of the device's accumulated outputs (``IntervalRead``, consumer/train/device/accumulators.py)."""

    @property
    def steps(self) -> int: ...
    @property
    def sums(self) -> dict[str, float]: ...
    @property
    def last(self) -> dict[str, float]: ...
    @property
    def first(self) -> dict[str, float]: ...
    @property
    def turns(self) -> int: ...


class OutputMeans:
    """Per-name means of the named scalars since the last ``take()``, from the device's interval sums.

    The step accumulates its outputs on the device (consumer/train/device/accumulators.py); the loop reads
    them at status intervals, checkpoints and the end and adds each read here with ``add_sums``. A
    non-finite value makes that name's mean NaN for the interval (the snapshot shows null): it is news,
    not noise.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def add_sums(self, sums: Mapping[str, float], steps: int) -> None:
        """One read: per-name sums over ``steps`` steps (0: nothing was dispatched since the last read)."""
        if steps <= 0:
            return
        for name, value in sums.items():
            self._sums[name] = self._sums.get(name, 0.0) + float(value)
            self._counts[name] = self._counts.get(name, 0) + steps

    def take(self) -> dict[str, float]:
        """Means of the interval that ends now (``loss`` first); the previous means if no step came."""
        if self._counts:
            means = {name: self._sums[name] / self._counts[name] for name in self._counts}
            self._last = {k: means[k] for k in sorted(means, key=lambda k: (k != "loss", k))}
            self._sums, self._counts = {}, {}
        return dict(self._last)

    def latest(self) -> dict[str, float]:
        """The means returned by the newest ``take()`` ({} before the first)."""
        return dict(self._last)


def format_outputs(means: Mapping[str, float]) -> str:
    """``loss 0.9123 mel_l1 0.5012``: the status line's part (``nan`` shown as such)."""
    return " ".join(
        f"{name} {value:.4f}" if math.isfinite(value) else f"{name} {value}" for name, value in means.items()
    )


class LoopMeter:
    """Counters since warm-up, the status line's live window and the named-scalar means."""

    def __init__(self, window_s: float) -> None:
        """Args: window_s: the live window (``consumer.metrics_window_s``), seconds."""
        self.t0 = 0.0
        self.wait0 = 0.0
        self.batches = self.samples = self.real_frames = self.padded_frames = 0
        self.wait_seen = 0.0
        self.last_end_s = 0.0  # end_s of the newest record
        # Every post-warm-up step (the newest 100k on longer runs): step time percentiles and CV.
        self.steps = StepWindow(window_s=math.inf, max_records=_SUMMARY_RECORDS)
        self.live = StepWindow(window_s=window_s)
        self.outputs = OutputMeans()
        self.reads = 0  # host reads of the accumulated outputs
        self.last_outputs: dict[str, float] = {}  # the newest step's named scalars, as of the newest read
        self.first_loss: float | None = None  # the first step's loss if finite (the first read's first value)
        self._first_seen = False

    @property
    def last_loss(self) -> float:
        return self.last_outputs.get("loss", math.nan)

    def add_read(self, read: IntervalFigures) -> bool:
        """Fold one read into the interval's means; True when the loss turned NaN/inf in it (warn once)."""
        self.reads += 1
        self.outputs.add_sums(read.sums, read.steps)
        if read.steps:
            self.last_outputs = dict(read.last)
            if not self._first_seen:
                first = read.first.get("loss", math.nan)
                self.first_loss, self._first_seen = (first if math.isfinite(first) else None), True
        return read.turns > 0

    def add(self, record: StepRecord) -> None:
        """One applied batch after warm-up."""
        self.batches += 1
        self.samples += record.rows
        self.real_frames += record.real_frames
        self.padded_frames += record.padded_frames
        self.last_end_s = record.end_s
        self.steps.add(record)
        self.live.add(record)


def format_status_line(
    *,
    step: int,
    steps_total: int | None,
    outputs: Mapping[str, float],
    figures: WindowFigures | None,
    queue_depth: int,
    producers_alive: int,
    rejects: int,
    quarantined: int,
    gpus: str = "",
) -> str:
    """``step 120/300 loss 0.91 mel_l1 0.50 | 10.2 batches/s 320 samples/s | stall 0.1% | ...``.

    Args:
        outputs: the named scalars' means over the status interval (``loss`` first).
        figures: the live window's figures (None before the first step after warm-up: "-").
    """
    total = f"/{steps_total}" if steps_total else ""
    named = format_outputs(outputs) or "loss -"
    if figures is None:
        rates, stall = "- batches/s - samples/s", "-"
    else:
        rates = f"{figures.batches_per_s:.2f} batches/s {figures.samples_per_s:.0f} samples/s"
        stall = f"{figures.stall_pct:.1f}%"
        if figures.feed_efficiency is not None:
            stall += f" | feed efficiency {figures.feed_efficiency:.3f}"
        elif figures.feed_steps_to_go:  # the limit was measured, too few fed steps yet for a stable figure
            stall += f" | feed efficiency - (not measured yet: {figures.feed_steps_to_go} steps to go)"
    return (
        f"step {step}{total} {named} | {rates} | stall {stall} | queue {queue_depth} | "
        f"producers {producers_alive} | rejects {rejects}"
        + (f" | quarantined {quarantined}" if quarantined else "")
        + (f" | {gpus}" if gpus else "")
    )
