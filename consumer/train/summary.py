"""The run summary: every figure of one training run, for the log, ``--summary-json`` and ``report``.

Role: ``TrainSummary`` (filled by ``consumer/train/loop.py``) and ``plan_figures``, the figures of the
bucket plan itself (the shape grid, token padding, outliers). Useful work is feed efficiency x padding
efficiency (docs/ARCHITECTURE.md, "The figures that matter"). Shutdown: nothing to release.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.shared.output_files import write_output
from melfeed.shared.wire.bucket_mix import bucket_grid
from melfeed.shared.wire.buckets import BucketSet

__all__ = ["TrainSummary", "plan_figures"]


@dataclass
class TrainSummary:
    steps: int = 0
    samples: int = 0
    batches_applied: int = 0
    batches_per_s: float = 0.0
    samples_per_s: float = 0.0
    stall_pct: float = 0.0
    padding_efficiency: float = 0.0     # real frames / padded frames of the trained batches
    token_padding_efficiency: float = 0.0  # real tokens / padded token positions of one epoch's plan
    useful_work: float | None = None    # feed_efficiency x padding_efficiency (None: feed efficiency not measured)
    outliers: int = 0                   # utterances outside buckets.{max,min}_frames_per_token (outliers.tsv)
    buckets: list[dict[str, Any]] = field(default_factory=list)  # the shape grid (plan_figures)
    partial: str = "pad"                # buckets.partial: a bucket's last, partial batch padded or dropped
    samples_dropped_per_epoch: int = 0  # kept samples left out of every epoch by partial: drop
    duplicates_dropped: int = 0
    quarantined_samples: int = 0        # rows trained that a producer left empty (bad file; named in its log)
    step_p50_ms: float | None = None    # compiled step time after warm-up (nearest-rank percentiles)
    step_p99_ms: float | None = None
    step_cv: float | None = None        # std / mean of the step time: jitter (recompiles, contention)
    rejects: dict[str, int] = field(default_factory=dict)
    compiles_after_ready: int = 0
    producers_seen: int = 0
    final_loss: float | None = None
    first_loss: float | None = None
    final_outputs: dict[str, float | None] = field(default_factory=dict)  # last step's named scalars
    jit_compile: str | None = None      # "xla" or "graph": how the step was compiled (None: it was not)
    jit_reason: str | None = None       # one line: what decided it (setting, XLA error, warm-up timings)
    error: str | None = None            # one line when the run failed: before training (e.g. XLA, jit: true), or
                                        # stopped by producer.max_quarantined_fraction (then exit 65)
    compile_s: float = 0.0              # compiling every bucket shape (warm-up), seconds
    time_to_first_step_s: float | None = None  # process start -> first applied step, seconds
    devices: list[str] = field(default_factory=list)  # the replicas' devices, else where the first step's outputs live
    replicas: int = 1                   # model replicas (consumer.replicas; consumer/train/replicas.py)
    xla_cache_dir: str | None = None    # persistent XLA compilation cache in use (TF_XLA_FLAGS), None = none
    xla_cache_warm: bool | None = None  # it held compiled programs when the run started
    in_flight_bound_bytes: int = 0
    payload_copies_per_batch: float = 0.0
    feed_efficiency: float | None = None      # fed steps/s / resident steps/s, same buckets (None: not measured)
    feed_efficiency_goal: float | None = None  # what it should reach on this device (0.95 CPU, 0.98 GPU)
    resident_steps_per_s: float | None = None  # the limit for the measured batches' bucket mix
    resident_step_ms: list[float] = field(default_factory=list)  # per bucket, on a resident batch
    feed_efficiency_measure_s: float = 0.0     # start time spent measuring the limit, seconds
    checkpoint_failures: int = 0        # periodic checkpoints that could not be written (each retried later)
    interrupted: bool = False
    next_batch: int | None = None       # resume position of the final checkpoint (with a state_dir)
    rank: int = 0                       # this consumer's rank in a multi-worker job (TF_CONFIG)
    world: int = 1                      # ranks in the job; > 1: MultiWorkerMirroredStrategy, outputs are the job's

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
        return (f"summary: steps {self.steps}, batches_applied {self.batches_applied}, loss "
                f"{opt(self.first_loss, '.2f')} -> {opt(self.final_loss, '.2f')}, {self.batches_per_s:.1f} batches/s, "
                f"{self.samples_per_s:.0f} samples/s, stall {self.stall_pct:.2f} %, padding_efficiency "
                f"{self.padding_efficiency:.3f}, feed_efficiency {opt(self.feed_efficiency, '.3f')}, useful_work "
                f"{opt(self.useful_work, '.3f')}, compile_s "
                f"{self.compile_s:.1f}, time_to_first_step_s {opt(self.time_to_first_step_s, '.1f')}, duplicates "
                f"{self.duplicates_dropped}, rejects {self.rejects}, compiles_after_ready {self.compiles_after_ready}, "
                f"payload_copies_per_batch {self.payload_copies_per_batch:.1f}")


def plan_figures(out: TrainSummary, bucket_set: BucketSet, frames: npt.NDArray[np.integer]) -> None:
    """The plan's own figures: token padding efficiency, outliers and the grid (one row per shape)."""
    out.token_padding_efficiency = bucket_set.token_padding_efficiency()
    out.outliers = bucket_set.outliers
    out.buckets = bucket_grid(bucket_set, frames)
