"""``buckets.cost: measured``: the 2-D planner's weights fitted to the user's compiled step, once per run identity.

Role: ``resolve_costs`` turns a config whose ``buckets.cost`` is measured into one planned with ``cost: formula``
and the fitted ``token_cost`` and ``attention_cost`` (``buckets.with_costs``), before the rows (``auto``) and the
plan follow it. The weights come from the state directory's ``bucket_costs.json`` when it holds an entry for this
identity (``measure_cache.measure_identity``: the step, every bucket setting but the weights and rows, the cache's
fingerprint and the device kind), else from timing the step on five probe shapes over the cache's lengths
(consumer/train/cost_fit.py: probes, rows and the fit; consumer/train/rows_probe.py ``StepTrials.time_shapes``: the
step's median seconds on the probe's own longest utterances, in graph mode on the CPU, as ``model.jit_compile``
says on a GPU); then the entry is written. A resumed run (a checkpoint to resume from) keeps the weights its plan was
built with (``plan_costs``). Lengths that span one T x L cell, or a step whose time does not grow with the shape,
keep the formula's weights (one log line says which). ``melfeed run`` hands the resolved config to its producers; a
producer started on its own with ``cost: measured`` learns the weights in its handshake (docs/design.md "Wire
protocol"). In a multi-worker job every rank measures, then all take rank 0's weights (``Job.agree_costs``).
Invariants: the plan stays a pure function of manifest, config and these weights; the step's variables hold their
values from before the probes. Shutdown: nothing to release.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from melfeed.consumer.train.cost_fit import Probe, fit_weights, probe_rows, probe_shapes
from melfeed.consumer.train.measure_cache import (
    COSTS_FILE,
    cached_entry,
    measure_identity,
    read_measures,
    store_measures,
)
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import PipelineError
from melfeed.shared.wire.buckets import Bucket, BucketSet, build_buckets, learns_costs, one_row_settings, with_costs

if TYPE_CHECKING:
    from melfeed.consumer.job.cluster import Job
    from melfeed.consumer.resume.state import RunState

__all__ = ["CACHE_NAME", "resolve_costs"]

log = logging.getLogger(__name__)

CACHE_NAME = COSTS_FILE  # in the state directory
_WHAT = "bucket cost weights"  # what the cache file's warnings say is measured again
_OUTPUTS = ("cost", "token_cost", "attention_cost", "rows")  # bucket settings the identity leaves out
_ROUNDS = 7  # timed steps per probe, one of each probe per round; the median ignores three outliers


def resolve_costs(
    cfg: PipelineConfig, manifest: Manifest, state: RunState | None, job: Job | None = None
) -> PipelineConfig:
    """``cfg`` planned with measured weights when ``buckets.cost`` is measured (unchanged otherwise). Reads or
    writes ``<state_dir>/bucket_costs.json``; measures without a state directory.

    Raises:
        StepError: the step fails on a probe. ConfigError / JobLostError: another rank refused, or is gone.
    """
    if not learns_costs(cfg.buckets):
        return cfg
    path = state.root / CACHE_NAME if state is not None else None
    costs = _plan_costs(path) if path is not None and state is not None and state.next_batch > 0 else None
    entry: tuple[str, dict[str, Any]] | None = None
    if costs is not None:  # a resumed plan keeps its weights, whatever device it resumes on
        log.info(
            "buckets.cost measured: token_cost %g attention_cost %g from %s (the plan's, resuming; no probes)",
            *costs,
            path,
        )
    else:
        try:
            costs, entry = _measured_or_cached(cfg, manifest, path, state)
        except PipelineError:
            if job is not None:  # the other ranks stop with this one instead of waiting for it
                with suppress(PipelineError):
                    job.agree_costs(None)
            raise
    if job is not None:
        costs = job.agree_costs(costs)
    if path is not None:
        store_measures(path, _WHAT, "plan_costs", list(costs), entry)
    return dataclasses.replace(cfg, buckets=with_costs(cfg.buckets, *costs))


def _plan_costs(path: Path) -> tuple[float, float] | None:
    return _valid_costs(read_measures(path, _WHAT).get("plan_costs"))


def _valid_costs(value: object) -> tuple[float, float] | None:
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        and 0 <= value[0] <= 1000
        and 0 <= value[1] <= 1
    ):
        return float(value[0]), float(value[1])
    return None


def _measured_or_cached(
    cfg: PipelineConfig, manifest: Manifest, path: Path | None, state: RunState | None
) -> tuple[tuple[float, float], tuple[str, dict[str, Any]] | None]:
    """This identity's weights from the file, or measured (then also the entry to store)."""
    from melfeed.consumer.train.auto_rows import device_kind

    kind, on_gpu = device_kind()
    identity = measure_identity(cfg, manifest.fingerprint, kind, _OUTPUTS)
    entry = cached_entry(path, identity, _WHAT)
    cached = _valid_costs(entry.get("costs")) if entry is not None else None
    if cached is not None:
        log.info(
            "buckets.cost measured: token_cost %g attention_cost %g from %s (measured earlier on %s; no probes)",
            *cached,
            path,
            kind,
        )
        return cached, None
    costs, fit = _measured(cfg, manifest, on_gpu, kind, state)
    content = {"costs": list(costs), "device": kind, "fingerprint": manifest.fingerprint, "fit": fit}
    return costs, (identity, content)


def _measured(
    cfg: PipelineConfig, manifest: Manifest, on_gpu: bool, kind: str, state: RunState | None
) -> tuple[tuple[float, float], dict[str, Any]]:
    """Time the probes and fit the weights (the formula's when nothing can be measured), with the fit's record."""
    default = (cfg.buckets.token_cost, cfg.buckets.attention_cost)
    planned = build_buckets(
        manifest.frames,
        manifest.token_counts,
        cfg.n_mels,
        one_row_settings(with_costs(cfg.buckets, *default)),
        manifest.schema,
        mel_dtype=cfg.transport.mel_dtype,
    )
    probes = probe_shapes(*_planned_lengths(planned, manifest), cfg.buckets.frame_multiple)
    if probes is None:
        log.info(
            "buckets.cost measured: the lengths span one T x L cell, so every weight gives one shape; "
            "token_cost %g attention_cost %g kept",
            *default,
        )
        return default, {"probes": []}
    started = time.perf_counter()
    timed = _time_probes(cfg, manifest, planned, probes, on_gpu, state)
    fit = fit_weights(timed)
    record = {"probes": [list(t) for t in timed], "worst_error": round(fit.worst_error, 4)}
    if fit.token_cost is None or fit.attention_cost is None:
        log.warning(
            "buckets.cost measured: the step's time on %s does not grow with the shape (%s); "
            "token_cost %g attention_cost %g kept",
            kind,
            _describe(timed),
            *default,
        )
        return default, record
    log.info(
        "buckets.cost measured: token_cost %g attention_cost %g on %s from %d probe shapes (%s; worst fit error "
        "%.0f %%; %.1f s)",
        fit.token_cost,
        fit.attention_cost,
        kind,
        len(timed),
        _describe(timed),
        100 * fit.worst_error,
        time.perf_counter() - started,
    )
    return (fit.token_cost, fit.attention_cost), record


def _planned_lengths(planned: BucketSet, manifest: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """Each utterance's frames and tokens as its shape holds them (-1: left out of the plan)."""
    assignment = np.asarray(planned.assignment, dtype=np.int64)
    kept = assignment >= 0
    top_t = np.array([b.max_frames for b in planned.buckets], dtype=np.int64)
    top_l = np.array([b.max_tokens for b in planned.buckets], dtype=np.int64)
    slot = np.maximum(assignment, 0)
    frames = np.where(kept, np.minimum(np.asarray(manifest.frames, dtype=np.int64), top_t[slot]), -1)
    tokens = np.where(kept, np.minimum(np.asarray(manifest.token_counts, dtype=np.int64), top_l[slot]), -1)
    return frames, tokens


def _time_probes(
    cfg: PipelineConfig,
    manifest: Manifest,
    planned: BucketSet,
    probes: list[Probe],
    on_gpu: bool,
    state: RunState | None,
) -> list[tuple[int, int, int, float]]:
    """``(T, L, rows, median seconds)`` of the step at each probe's shape."""
    from melfeed.consumer.train.jit import remembered_mode
    from melfeed.consumer.train.rows_probe import StepTrials

    b = cfg.buckets
    unit = cfg.consumer.replica_count
    shapes = [
        _probe_bucket(
            planned.buckets[0],
            k,
            p,
            probe_rows(p.frames, b.batch_size, b.frame_budget, b.max_batch_size, unit),
            manifest,
        )
        for k, p in enumerate(probes)
    ]
    probe_set = BucketSet(
        buckets=tuple(shapes),
        assignment=np.full(len(manifest.frames), -1, dtype=np.int16),
        truncated=0,
        dropped=0,
        real_frames=0,
        outliers=0,
        real_tokens=0,
    )
    trials = StepTrials(
        cfg,
        probe_set,
        manifest,
        on_gpu=on_gpu,
        jit_mode=remembered_mode(state.root) if state is not None else None,
    )
    seconds = trials.time_shapes([(s, p.samples) for s, p in zip(shapes, probes)], _ROUNDS)
    return [(s.max_frames, s.max_tokens, s.batch_size, t) for s, t in zip(shapes, seconds)]


def _probe_bucket(template: Bucket, index: int, probe: Probe, rows: int, manifest: Manifest) -> Bucket:
    """A bucket of the probe's shape: the template's channels, extras and dtype; each sequence extra as long as
    the longest of the probe's samples."""
    seq = []
    schema = manifest.schema
    for spec in schema.extras if schema is not None else ():
        if spec.kind == "sequence":
            lengths = np.asarray(schema.sequence_lengths[spec.name], dtype=np.int64)
            seq.append(max(1, int(lengths[list(probe.samples)].max())))
    return dataclasses.replace(
        template,
        index=index,
        batch_size=rows,
        max_frames=probe.frames,
        max_tokens=probe.tokens,
        seq_lengths=tuple(seq),
    )


def _describe(timed: list[tuple[int, int, int, float]]) -> str:
    return ", ".join(f"{frames}x{tokens} at {rows} rows {1000 * s:.1f} ms" for frames, tokens, rows, s in timed)
