"""``buckets.batch_size: auto``: each bucket's rows measured on the user's compiled step, once per run identity.

Role: ``resolve_rows`` turns a config whose ``buckets.batch_size`` is ``auto`` into one with ``buckets.rows`` set,
before the consumer builds its bucket set, plan and ring (all follow the rows). The rows come from the state
directory's ``batch_sizes.json`` when it holds an entry for this identity (the step's settings, the cache's
fingerprint and the device kind; ``rows_identity``), else from a search (consumer/train/rows_search.py, trials in
consumer/train/rows_probe.py): on a GPU the most rows whose peak memory stays under
``consumer.gpu_memory_fraction`` of the device, elsewhere the fewest rows that reach 95 % of the bucket's best
throughput; then the entry is written. A resumed run (a checkpoint to resume from) keeps the rows its plan was
built with (``plan_rows``), on any device. Without a state directory every start searches. The producers ``run``
starts get the resolved config (``buckets.rows``); a producer started on its own whose config says ``auto`` without
``rows`` learns each bucket's rows in the handshake: its HELLO asks with ``LEARN_ROWS``, the WELCOME gives these
(docs/design.md "Wire protocol"), again on every consumer start.
In a multi-worker job every rank resolves its rows, then the ranks take each bucket's smallest (``Job.agree_rows``).
Invariants: the plan stays a pure function of manifest, config and these rows; a bucket that fits no row is one
``ConfigError`` line (exit 78). Shutdown: nothing to release.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from melfeed.consumer.train.measure_cache import (
    ROWS_FILE,
    cached_entry,
    measure_identity,
    read_measures,
    store_measures,
)
from melfeed.consumer.train.rows_search import RowsChoice, Trial, fastest_rows, largest_fitting_rows
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import with_overrides
from melfeed.shared.errors import ConfigError, PipelineError
from melfeed.shared.wire.buckets import BucketSet, build_buckets, one_row_settings

if TYPE_CHECKING:
    from melfeed.consumer.job.cluster import Job
    from melfeed.consumer.resume.state import RunState

__all__ = ["CACHE_NAME", "resolve_rows", "rows_identity", "search_rows"]

log = logging.getLogger(__name__)

_WHAT = "rows"  # what the cache file's warnings say is measured again
CACHE_NAME = ROWS_FILE  # in the state directory


def rows_identity(cfg: PipelineConfig, fingerprint: str, device_kind: str) -> str:
    """A digest of everything the rows depend on (``measure_identity``: every bucket setting but ``rows``)."""
    return measure_identity(cfg, fingerprint, device_kind, ("rows",))


def device_kind() -> tuple[str, bool]:
    """What the rows were measured on ("GPU <name> x<n>" or "CPU <arch> x<cores>") and whether it is a GPU."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "unknown")
        return f"GPU {name} x{len(gpus)}", True
    return f"CPU {platform.machine()} x{os.cpu_count()}", False


def resolve_rows(
    cfg: PipelineConfig, manifest: Manifest, state: RunState | None, job: Job | None = None
) -> PipelineConfig:
    """``cfg`` with ``buckets.rows`` set when ``buckets.batch_size`` is auto (unchanged otherwise, or when rows
    are already given). Reads or writes ``<state_dir>/batch_sizes.json``; searches without a state directory.

    Raises:
        ConfigError: a bucket does not fit the device even at its fewest rows (``buckets.batch_size``).
    """
    if cfg.buckets.batch_size != "auto" or cfg.buckets.rows is not None:
        return cfg
    shapes = _shape_set(cfg, manifest)
    n = len(shapes.buckets)
    path = state.root / CACHE_NAME if state is not None else None
    entry: tuple[str, dict[str, Any]] | None = None
    rows = (
        _valid_rows(read_measures(path, _WHAT).get("plan_rows"), n)
        if path is not None and state and state.next_batch
        else None
    )
    if rows is not None:  # a resumed plan keeps its rows, whatever device it resumes on
        log.info(
            "buckets.batch_size auto: rows by bucket %s from %s (the plan's, resuming at batch %d; no search)",
            rows,
            path,
            state.next_batch if state else 0,
        )
    else:
        try:
            rows, entry = _measured_or_cached(cfg, manifest, shapes, path, state)
        except PipelineError:
            if job is not None:  # the other ranks stop with this one instead of waiting for it
                with suppress(PipelineError):
                    job.agree_rows(None, n)
            raise
    if job is not None:
        rows = job.agree_rows(rows, n)
    if path is not None:
        _store(path, plan_rows=rows, entry=entry)
    return with_overrides(cfg, {"buckets.rows": rows})


def _measured_or_cached(
    cfg: PipelineConfig, manifest: Manifest, shapes: BucketSet, path: Path | None, state: RunState | None
) -> tuple[list[int], tuple[str, dict[str, Any]] | None]:
    """This identity's rows from the file, or searched (then also the entry to store)."""
    kind, on_gpu = device_kind()
    identity = rows_identity(cfg, manifest.fingerprint, kind)
    rows = _cached(path, identity, len(shapes.buckets))
    if rows is not None:
        log.info(
            "buckets.batch_size auto: rows by bucket %s from %s (measured earlier on %s; no search)", rows, path, kind
        )
        return rows, None
    rows = _searched(cfg, manifest, shapes, on_gpu, kind, state)
    return rows, (identity, {"rows": rows, "device": kind, "fingerprint": manifest.fingerprint})


def _searched(
    cfg: PipelineConfig, manifest: Manifest, shapes: BucketSet, on_gpu: bool, kind: str, state: RunState | None
) -> list[int]:
    from melfeed.consumer.train.jit import remembered_mode
    from melfeed.consumer.train.rows_probe import StepTrials

    started = time.perf_counter()
    limit = _memory_limit_bytes(cfg) if on_gpu else None
    if on_gpu and limit is None:
        log.warning(
            "buckets.batch_size auto: the GPU's memory size is unknown (no NVML, no "
            "consumer.gpu_memory_limit_mb): rows chosen by throughput instead"
        )
    trials = StepTrials(
        cfg,
        shapes,
        manifest,
        on_gpu=limit is not None,
        jit_mode=remembered_mode(state.root) if state is not None else None,
    )
    choices = search_rows(trials, shapes, cfg.buckets.max_batch_size, cfg.consumer.replica_count, limit)
    rows = [c.rows for c in choices]
    log.info(
        "buckets.batch_size auto: rows by bucket %s on %s by %s (%d trials, %.1f s)",
        rows,
        kind,
        choices[0].rule,
        trials.trials_run,
        time.perf_counter() - started,
    )
    return rows


def search_rows(
    trial: Any, bucket_set: BucketSet, cap_rows: int, unit: int, limit_bytes: int | None
) -> list[RowsChoice]:
    """Each bucket's choice, longest bucket first (by memory, a shorter bucket fits at least the rows of a longer
    one, so the next search starts above that choice); ``trial(bucket, rows) -> Trial``.

    Raises:
        ConfigError: a bucket fits not even ``unit`` rows.
    """
    out: dict[int, RowsChoice] = {}
    fits = 0
    for bucket in sorted(bucket_set.buckets, key=lambda b: -b.max_frames):

        def one(rows: int, b: Any = bucket) -> Trial:
            return trial(b, rows)  # type: ignore[no-any-return]

        if limit_bytes is None:
            choice = fastest_rows(one, cap_rows, unit)
        else:
            choice = largest_fitting_rows(one, cap_rows, limit_bytes, unit, known_fit=fits)
            fits = choice.rows
        if choice.rows == 0:
            raise ConfigError(
                f"auto: bucket {bucket.index} (T={bucket.max_frames} frames) does not fit the device's "
                f"memory even at {unit} rows",
                path=("buckets", "batch_size"),
                got="auto",
            )
        out[bucket.index] = choice
    return [out[i] for i in range(len(bucket_set.buckets))]


def _shape_set(cfg: PipelineConfig, manifest: Manifest) -> BucketSet:
    """The bucket shapes (rows 1 each; the search sets them) of ``cfg``'s bucket settings."""
    one_row = one_row_settings(cfg.buckets)
    return build_buckets(
        manifest.frames, manifest.token_counts, cfg.n_mels, one_row, manifest.schema, mel_dtype=cfg.transport.mel_dtype
    )


def _memory_limit_bytes(cfg: PipelineConfig) -> int | None:
    """``consumer.gpu_memory_fraction`` of the first GPU's memory: the cap when set, else NVML's total."""
    c = cfg.consumer
    if c.gpu_memory_limit_mb is not None:
        return int(c.gpu_memory_fraction * c.gpu_memory_limit_mb * 2**20)
    from melfeed.consumer.observe.gpu import load_nvml, resolve_gpus, visible_gpu_selectors

    nvml = load_nvml(quiet=True)
    if nvml is None:
        return None
    try:  # NVML numbers every GPU of the host: the first visible one is TensorFlow's GPU:0
        gpus = resolve_gpus(nvml, visible_gpu_selectors(os.environ.get("CUDA_VISIBLE_DEVICES")), quiet=True)
        total = int(nvml.nvmlDeviceGetMemoryInfo(gpus[0].handle).total)
    except Exception as err:  # NVML's own error types, or no GPU it knows: the size stays unknown
        log.debug("NVML memory size: %s", err)
        return None
    return int(c.gpu_memory_fraction * total)


def _valid_rows(value: object, n_buckets: int) -> list[int] | None:
    if isinstance(value, list) and len(value) == n_buckets and all(type(r) is int and r >= 1 for r in value):
        return list(value)
    return None


def _cached(path: Path | None, identity: str, n_buckets: int) -> list[int] | None:
    entry = cached_entry(path, identity, _WHAT)
    return _valid_rows(entry.get("rows"), n_buckets) if entry is not None else None


def _store(path: Path, *, plan_rows: list[int], entry: tuple[str, dict[str, Any]] | None = None) -> None:
    """Record the rows the plan is built with (and a measured ``entry``: identity, content)."""
    store_measures(path, _WHAT, "plan_rows", plan_rows, entry)
