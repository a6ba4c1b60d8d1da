"""The summary of a training run (``--summary-json``): what it applied, how fast, how it compiled, how it ended.

Role: ``TrainSummary`` is filled by the built-in loop (consumer/train/loop.py): ``finish`` when the run ends
in order, ``summary_on_failure`` when the step cannot be built or compiled or fails while training. Either way
``count_applied`` reads the counts from the consumer itself, so ``batches_applied`` and ``producers_seen``
are what the audit log and the receiver hold (``melfeed audit``: one record per applied batch), not a
figure of the last status interval.
``plan_figures`` adds the figures of the bucket plan itself (the shape grid, token padding, outliers); useful
work is feed efficiency x padding efficiency (docs/design.md, "Feed efficiency").
Invariant: ``write`` replaces the file (a stale summary of an earlier run is never left in its place).
Shutdown: nothing to release.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from melfeed.shared.errors import ConfigError, StepError
from melfeed.shared.metrics import feed_efficiency_goal
from melfeed.shared.output_files import write_output
from melfeed.shared.wire.bucket_mix import bucket_grid
from melfeed.shared.wire.buckets import BucketSet

if TYPE_CHECKING:
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.train.meter import LoopMeter

__all__ = ["TrainSummary", "count_applied", "finish", "plan_figures", "summary_on_failure"]

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    """Every figure of one run; ``error`` is set when it failed (one line)."""

    steps: int = 0
    samples: int = 0
    batches_applied: int = 0
    batches_per_s: float = 0.0
    samples_per_s: float = 0.0
    stall_pct: float = 0.0
    padding_efficiency: float = 0.0  # real frames / padded frames of the trained batches
    token_padding_efficiency: float = 0.0  # real tokens / padded token positions of one epoch's plan
    useful_work: float | None = None  # feed_efficiency x padding_efficiency (None: feed efficiency not measured)
    outliers: int = 0  # utterances outside buckets.{max,min}_frames_per_token (outliers.tsv)
    buckets: list[dict[str, Any]] = field(default_factory=list)  # the shape grid (plan_figures)
    partial: str = "pad"  # buckets.partial: a bucket's last, partial batch padded or dropped
    samples_dropped_per_epoch: int = 0  # kept samples left out of every epoch by partial: drop
    duplicates_dropped: int = 0
    quarantined_samples: int = 0  # rows trained that a producer left empty (bad file; named in its log)
    step_p50_ms: float | None = None  # compiled step time after warm-up (nearest-rank percentiles)
    step_p99_ms: float | None = None
    step_cv: float | None = None  # std / mean of the step time: jitter (recompiles, contention)
    rejects: dict[str, int] = field(default_factory=dict)
    compiles_after_ready: int = 0
    producers_seen: int = 0
    final_loss: float | None = None
    first_loss: float | None = None
    final_outputs: dict[str, float | None] = field(default_factory=dict)  # last step's named scalars
    jit_compile: str | None = None  # "xla" or "graph": how the step was compiled (None: it was not)
    jit_reason: str | None = None  # one line: what decided it (setting, XLA error, warm-up timings)
    error: str | None = None  # one line when the run failed: before training (e.g. XLA, jit: true), or
    # stopped by producer.max_quarantined_fraction (then exit 65)
    compile_s: float = 0.0  # compiling every bucket shape (warm-up), seconds
    time_to_first_step_s: float | None = None  # process start -> first applied step, seconds
    devices: list[str] = field(default_factory=list)  # the replicas' devices, else where the first step's outputs live
    replicas: int = 1  # model replicas (consumer.replicas; consumer/train/replicas.py)
    xla_cache_dir: str | None = None  # persistent XLA compilation cache in use (TF_XLA_FLAGS), None = none
    xla_cache_warm: bool | None = None  # it held compiled programs when the run started
    in_flight_bound_bytes: int = 0
    payload_copies_per_batch: float = 0.0
    feed_efficiency: float | None = None  # fed steps/s / resident steps/s, same buckets (None: not measured)
    feed_efficiency_goal: float | None = None  # what it should reach on this device (0.95 CPU, 0.98 GPU)
    resident_steps_per_s: float | None = None  # the limit for the measured batches' bucket mix
    resident_step_ms: list[float] = field(default_factory=list)  # per bucket, on a resident batch
    feed_efficiency_measure_s: float = 0.0  # start time spent measuring the limit, seconds
    checkpoint_failures: int = 0  # periodic checkpoints that could not be written (each retried later)
    interrupted: bool = False
    next_batch: int | None = None  # resume position of the final checkpoint (with a state_dir)
    rank: int = 0  # this consumer's rank in a multi-worker job (TF_CONFIG)
    world: int = 1  # ranks in the job; > 1: MultiWorkerMirroredStrategy, outputs are the job's

    def write(self, path: str | Path) -> None:
        """Replace ``path`` (``--summary-json``); a new file is 0640 whatever the umask, an old one keeps its mode.

        Raises:
            ConfigError: another user could redirect the write (``melfeed.shared.output_files.open_output``).
        """
        write_output(path, json.dumps(asdict(self), indent=2) + "\n", what="--summary-json")

    def line(self) -> str:
        """The headline figures on one line for the log; the JSON logged before it holds every figure."""

        def opt(value: float | None, spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        return (
            f"summary: steps {self.steps}, batches_applied {self.batches_applied}, loss "
            f"{opt(self.first_loss, '.2f')} -> {opt(self.final_loss, '.2f')}, {self.batches_per_s:.1f} batches/s, "
            f"{self.samples_per_s:.0f} samples/s, stall {self.stall_pct:.2f} %, padding_efficiency "
            f"{self.padding_efficiency:.3f}, feed_efficiency {opt(self.feed_efficiency, '.3f')}, useful_work "
            f"{opt(self.useful_work, '.3f')}, compile_s "
            f"{self.compile_s:.1f}, time_to_first_step_s {opt(self.time_to_first_step_s, '.1f')}, duplicates "
            f"{self.duplicates_dropped}, rejects {self.rejects}, compiles_after_ready {self.compiles_after_ready}, "
            f"payload_copies_per_batch {self.payload_copies_per_batch:.1f}"
        )


@contextmanager
def summary_on_failure(out: TrainSummary, summary_path: str | None, consumer: Consumer | None = None) -> Iterator[None]:
    """A step that cannot be built or compiled, breaks the output contract, or fails while training (StepError,
    exit 1; ConfigError, exit 78) still leaves its summary, with ``error`` set, before the error goes on.

    With ``consumer`` its counts are read first (``count_applied``), so the summary of a run that failed
    mid-training says what the audit log holds.
    """
    try:
        yield
    except (StepError, ConfigError) as err:
        out.error = str(err)
        if consumer is not None:
            count_applied(out, consumer)
        if summary_path:
            out.write(summary_path)
        raise


def count_applied(out: TrainSummary, consumer: Consumer) -> None:
    """The consumer's counts: batches applied (one audit record each), producers that joined, drops and rejects."""
    rs = consumer._receiver.stats()
    out.batches_applied = consumer.applied
    out.producers_seen = rs.producers_seen
    out.duplicates_dropped = rs.duplicates_dropped
    out.rejects = rs.rejects


def _feed_efficiency(out: TrainSummary, meter: LoopMeter) -> None:
    """Over every measured step, ending at the last one (the final checkpoint is not feeding time)."""
    figures = meter.steps.figures(meter.last_end_s) if meter.batches else None
    if figures is None or figures.feed_efficiency is None:
        return
    out.feed_efficiency = figures.feed_efficiency
    out.resident_steps_per_s = figures.batches_per_s / figures.feed_efficiency
    out.feed_efficiency_goal = feed_efficiency_goal(any("GPU" in d.upper() for d in out.devices))


def finish(
    out: TrainSummary, meter: LoopMeter, consumer: Consumer, compiles: int, outputs: dict[str, float], copies: int
) -> None:
    """The figures of a run that ended in order (plan done, stopped), logged as JSON and as one line."""
    wall = time.perf_counter() - meter.t0 if meter.t0 else 0.0
    count_applied(out, consumer)
    if wall > 0:
        out.batches_per_s = meter.batches / wall
        out.samples_per_s = meter.samples / wall
        out.stall_pct = 100.0 * (consumer._wait_s_total - meter.wait0) / wall
    out.padding_efficiency = meter.real_frames / meter.padded_frames if meter.padded_frames else 0.0
    plan_figures(out, consumer._bucket_set, consumer.manifest.frames)
    figures = meter.steps.figures(time.perf_counter())
    if figures is not None:
        out.step_p50_ms, out.step_p99_ms = 1000 * figures.step_p50_s, 1000 * figures.step_p99_s
        out.step_cv = figures.step_cv
    _feed_efficiency(out, meter)
    out.useful_work = out.feed_efficiency * out.padding_efficiency if out.feed_efficiency is not None else None
    out.compiles_after_ready = compiles
    finite = {name: (v if math.isfinite(v) else None) for name, v in outputs.items()}
    out.final_loss = finite.get("loss")
    out.final_outputs = finite
    # Mean over applied batches of the copies into the slot (shared memory: page cache -> slot = 1; payload:
    # page cache -> producer buffer -> kernel socket -> libzmq -> slot = 4) plus to_tensors' (DLPack: none).
    out.payload_copies_per_batch = copies / out.steps if out.steps else 0.0
    summary: dict[str, Any] = {k: v for k, v in asdict(out).items() if k != "rejects"}
    log.info("summary %s rejects=%s", json.dumps(summary), out.rejects)
    log.info("%s", out.line())


def plan_figures(out: TrainSummary, bucket_set: BucketSet, frames: npt.NDArray[np.integer]) -> None:
    """The plan's own figures: token padding efficiency, outliers and the grid (one row per shape)."""
    out.token_padding_efficiency = bucket_set.token_padding_efficiency()
    out.outliers = bucket_set.outliers
    out.buckets = bucket_grid(bucket_set, frames)
