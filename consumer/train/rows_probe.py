"""Trials of the user's compiled step at a bucket's shape with some rows: ``buckets.batch_size: auto``'s measurements.

Role: ``StepTrials`` builds the step once from its factory (``model.step``; the spec's bucket shapes at
``buckets.max_batch_size`` rows, the most any trial uses) and, for each trial, compiles a program of one bucket's
shape at the trial's rows (``CompiledStep``; on a GPU XLA or graph mode as ``model.jit_compile``, "auto" trying XLA
and keeping what compiled, untimed; on the CPU graph mode, whose compile costs seconds where XLA's costs up to a
minute per trial, unless the step fails there), runs it on a batch of the bucket's own longest samples
(``sample_batch``)
and times ``_TIMED_STEPS`` more steps (median; host read after each), or on a GPU reads the step's peak memory
(``tf.config.experimental.get_memory_info``, reset before the trial). An out-of-memory error is a trial that does
not fit. The search rules are in consumer/train/rows_search.py.
Invariants: every variable of the step holds its value from before each trial (``CompiledStep.warm_up`` restores
its own steps; the timed ones are restored here); the step runs locally, never under a multi-worker strategy, so
ranks may try different rows without pairing collectives. Shutdown: nothing to release; programs are dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from melfeed.consumer.train.preflight import is_out_of_memory
from melfeed.consumer.train.rows_search import Trial
from melfeed.consumer.train.warm_batches import read_sample_batch, sample_batch
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import PipelineConfig
from melfeed.shared.wire.buckets import Bucket, BucketSet

__all__ = ["StepTrials"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_TIMED_STEPS = 3  # per trial after the compiling one; the median ignores one outlier (a GC pause)


@contextmanager
def _quiet_compiles() -> Iterator[None]:
    """The step's "compiled" INFO line describes the run's programs: a trial's would be one more per trial."""
    step_log = logging.getLogger("melfeed.consumer.train.step")
    level = step_log.level
    step_log.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        step_log.setLevel(level)


class StepTrials:
    """Runs trials of the step built from ``cfg.model`` for the buckets of ``bucket_set`` (any rows).

    Args:
        on_gpu: measure peak memory of ``GPU:0`` instead of timing.
        jit_mode: "xla" or "graph" decided earlier (``jit.remembered_mode``); None = as ``model.jit_compile``.
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        bucket_set: BucketSet,
        manifest: Manifest,
        *,
        on_gpu: bool,
        jit_mode: str | None = None,
    ) -> None:
        from melfeed.consumer.train.model import StepSpec
        from melfeed.consumer.train.replicas import Replicas, replica_scope
        from melfeed.consumer.train.step import build_step

        self._cfg, self._set, self._manifest, self.on_gpu = cfg, bucket_set, manifest, on_gpu
        cap = cfg.buckets.max_batch_size
        shapes = [dataclasses.replace(b, batch_size=cap).shapes() for b in bucket_set.buckets]
        self._replicas = Replicas.from_config(cfg)
        with replica_scope(self._replicas):
            self._step = build_step(cfg.model.step, StepSpec.from_config(cfg, shapes, None, manifest.schema.extras))
        setting = cfg.model.jit_compile
        self._jit: str | bool = setting if jit_mode is None or setting != "auto" else jit_mode == "xla"
        self._configured = self._jit
        if not on_gpu:  # an XLA compile per trial costs 15-60 s on a small CPU: graph mode, unless it fails
            self._jit = False
        self.trials_run = 0

    def __call__(self, bucket: Bucket, rows: int) -> Trial:
        """One trial: ``bucket``'s shape at ``rows`` rows (on the CPU in graph mode, or as configured if that fails)."""
        return self._graph_or_configured(lambda: self._trial(bucket, rows))

    def _graph_or_configured(self, trial: Callable[[], _T]) -> _T:
        """``trial()`` in the trials' mode; a step that fails in graph mode on the CPU is tried again (and every
        later trial compiled) as ``model.jit_compile`` says."""
        from melfeed.shared.errors import StepError

        with _quiet_compiles():
            try:
                return trial()
            except StepError:
                if self._jit is not False or self.on_gpu or self._configured is False:
                    raise
                log.info("step trials: the step fails in graph mode; trials compile as model.jit_compile says")
                self._jit = self._configured
                return trial()

    def _trial(self, bucket: Bucket, rows: int) -> Trial:
        import tensorflow as tf

        shaped = dataclasses.replace(bucket, batch_size=rows)
        batch = sample_batch(self._set, self._manifest, shaped)
        self.trials_run += 1
        if self.on_gpu:
            tf.config.experimental.reset_memory_stats("GPU:0")
        try:
            compiled = self._compiled(shaped)
            compiled.warm_up([batch])
            self._jit = compiled.mode == "xla"  # the next trials compile in the mode this one settled
            if self.on_gpu:
                peak = int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
                log.debug("auto rows: bucket %d rows=%d peak_mb=%.0f", bucket.index, rows, peak / 2**20)
                return Trial(rows, True, peak_bytes=peak)
            step_s = self._time(compiled, batch.arrays)
        except Exception as err:
            if is_out_of_memory(err):
                log.info("auto rows: bucket %d does not fit at %d rows (out of memory)", bucket.index, rows)
                return Trial(rows, False)
            raise
        log.debug("auto rows: bucket %d rows=%d step_ms=%.1f", bucket.index, rows, 1000 * step_s)
        return Trial(rows, True, step_s=step_s)

    def time_shapes(self, shapes: Sequence[tuple[Bucket, Sequence[int]]], rounds: int) -> list[float]:
        """Median seconds per step at each ``(bucket, samples)`` shape (its rows; the samples repeated to fill them),
        on any device (``buckets.cost: measured``'s probes): every program compiled and warmed first, then
        ``rounds`` rounds of one step of each in turn, so a change of load on the machine touches every shape
        alike. The variables are restored. Errors propagate."""
        import tensorflow as tf

        from melfeed.consumer.train.outputs import read_outputs

        batches = [read_sample_batch(self._manifest, bucket, samples) for bucket, samples in shapes]
        self.trials_run += len(shapes)

        def warmed() -> list[Any]:
            programs = []
            for (bucket, _), batch in zip(shapes, batches):
                compiled = self._compiled(bucket)
                compiled.warm_up([batch])
                self._jit = compiled.mode == "xla"
                programs.append(compiled)
            return programs

        programs = self._graph_or_configured(warmed)
        tensors = [{k: tf.constant(v) for k, v in batch.arrays.items()} for batch in batches]
        variables = self._step.variables()
        saved = [v.numpy() for v in variables]
        times: list[list[float]] = [[] for _ in shapes]
        try:
            for _ in range(rounds):
                for k, (compiled, arrays) in enumerate(zip(programs, tensors)):
                    t0 = time.perf_counter()
                    read_outputs(compiled.run(0, arrays))
                    times[k].append(time.perf_counter() - t0)
        finally:
            for var, value in zip(variables, saved):
                var.assign(value)
        return [float(statistics.median(t)) for t in times]

    def _compiled(self, shaped: Bucket) -> Any:
        """A program of ``shaped``'s shape and rows in the trials' mode (not compiled until its first step)."""
        from melfeed.consumer.train.step import CompiledStep

        return CompiledStep(
            self._step,
            [shaped.shapes()],
            jit_compile=self._jit,
            factory=self._cfg.model.step,
            remembered="xla" if self._jit == "auto" else None,
            replicas=self._replicas,
            extras=self._manifest.schema.extras,
            mel_dtype=self._cfg.transport.mel_dtype,
        )

    def _time(self, compiled: Any, arrays: dict[str, Any]) -> float:
        """Median seconds of ``_TIMED_STEPS`` steps, each ending in a host read; the variables are restored."""
        import tensorflow as tf

        from melfeed.consumer.train.outputs import read_outputs

        tensors = {k: tf.constant(v) for k, v in arrays.items()}
        variables = self._step.variables()
        saved = [v.numpy() for v in variables]
        times = []
        try:
            for _ in range(_TIMED_STEPS):
                t0 = time.perf_counter()
                read_outputs(compiled.run(0, tensors))
                times.append(time.perf_counter() - t0)
        finally:
            for var, value in zip(variables, saved):
                var.assign(value)
        return float(statistics.median(times))
