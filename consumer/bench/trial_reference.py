"""The feed-efficiency trials of ``bench``: the reference model fed by melfeed or by tuned tf.data.

Role: the runners that ``consumer/bench/trial.py`` calls for a spec with ``"model": "reference"``. Both
build the configured step (``model.step``, the reference model by default), compile every bucket, measure
the resident-batch limit with ``melfeed.consumer.train.efficiency`` (``consumer.feed_efficiency_steps`` per
bucket, at least 30 in bench) and then train ``warmup`` + ``batches`` batches for real: no modelled device time, no
sleep.
    * melfeed: the built-in loop (``melfeed.consumer.train.loop.train``) with real producers; its summary
      carries the figure.
    * tuned tf.data: the same loop shape over ``baselines.tuned_dataset`` (take the next element, run
      the step, read its outputs), each measured batch stamped with its bucket's resident step time;
      ``melfeed.shared.metrics.StepWindow`` computes the figure exactly as the consumer's meter does.
Invariants: a trial reports only what it measured; fed steps/s = feed efficiency x resident steps/s of
the same window (the summary's own batches_per_s starts one step late). Shutdown: producers are stopped
in ``finally`` (``melfeed.consumer.producer_group.stop_producers``); the tf.data iterator is dropped with the process.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any

import numpy as np

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import with_overrides

__all__ = ["run_melfeed_reference", "run_tfdata_reference"]

_BENCH_LIMIT_STEPS = 30  # resident steps per bucket at least: a 10-step limit (0.15 s a bucket) moved with
# every burst of another process, as much as the differences between systems


def _result(
    spec: dict[str, Any],
    *,
    feed_efficiency: float | None,
    resident_steps_per_s: float | None,
    stall_pct: float,
    step_p50_ms: float | None,
    devices: list[str],
    padding_efficiency: float,
) -> dict[str, Any]:
    fed = (
        feed_efficiency * resident_steps_per_s
        if feed_efficiency is not None and resident_steps_per_s is not None
        else None
    )
    useful = feed_efficiency * padding_efficiency if feed_efficiency is not None else None
    return {
        "system": spec["system"],
        "kind": spec["kind"],
        "round": spec["round"],
        "step_ms": spec["step_ms"],
        "ok": True,
        "model": "reference",
        "batches": spec["batches"],
        "feed_efficiency": feed_efficiency,
        "fed_steps_per_s": fed,
        "resident_steps_per_s": resident_steps_per_s,
        "stall_pct": stall_pct,
        "step_p50_ms": step_p50_ms,
        "padding_efficiency": padding_efficiency,
        "useful_work": useful,
        "devices": devices,
        "on_gpu": any("GPU" in d.upper() for d in devices),
    }


def _with_limit(cfg: PipelineConfig) -> PipelineConfig:
    if cfg.consumer.feed_efficiency_steps >= _BENCH_LIMIT_STEPS:
        return cfg
    return with_overrides(cfg, {"consumer.feed_efficiency_steps": _BENCH_LIMIT_STEPS})


def run_melfeed_reference(spec: dict[str, Any], cfg: PipelineConfig) -> dict[str, Any]:
    """melfeed's own loop, real producers, the reference model; the summary's feed efficiency."""
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.producer_group import start_producers, stop_producers
    from melfeed.consumer.train.loop import train

    cfg = _with_limit(cfg)
    with Consumer(cfg) as consumer:
        group = start_producers(with_overrides(cfg, {"transport.endpoint": consumer._endpoint}))
        try:
            summary = train(cfg, consumer, threading.Event(), process_start_s=time.time())
        finally:
            stop_producers(group)
    if summary.steps < spec["warmup"] + spec["batches"]:
        raise RuntimeError(f"only {summary.steps} of {spec['warmup'] + spec['batches']} batches arrived")
    return _result(
        spec,
        feed_efficiency=summary.feed_efficiency,
        resident_steps_per_s=summary.resident_steps_per_s,
        stall_pct=summary.stall_pct,
        step_p50_ms=summary.step_p50_ms,
        devices=summary.devices,
        padding_efficiency=summary.padding_efficiency,
    )


def run_tfdata_reference(spec: dict[str, Any], cfg: PipelineConfig) -> dict[str, Any]:
    """Tuned tf.data over the same plan's full batches into the same compiled step."""
    from melfeed.consumer.bench import baselines
    from melfeed.consumer.flow.plan import EpochPlan
    from melfeed.consumer.placement import step_devices
    from melfeed.consumer.train.device.packed import PackedSteps
    from melfeed.consumer.train.efficiency import measure_resident_limit, resident_vocab
    from melfeed.consumer.train.handoff import model_device
    from melfeed.consumer.train.model import StepSpec
    from melfeed.consumer.train.outputs import read_outputs
    from melfeed.consumer.train.step import CompiledStep, build_step
    from melfeed.consumer.train.warm_batches import warm_batches
    from melfeed.shared.cache.features import load_manifest_for
    from melfeed.shared.metrics import StepRecord, StepWindow
    from melfeed.shared.wire.buckets import build_buckets

    cfg = _with_limit(cfg)
    manifest = load_manifest_for(cfg)
    bucket_set = build_buckets(manifest.frames, manifest.token_counts, cfg.n_mels, cfg.buckets)
    plan = EpochPlan(bucket_set, manifest.fingerprint, cfg.seed, cfg.buckets.partial)
    files = baselines.plan_files(manifest, plan, bucket_set, 1)
    shapes = [b.shapes() for b in bucket_set.buckets]
    step = build_step(cfg.model.step, StepSpec.from_config(cfg, shapes, plan.batches_per_epoch))
    compiled = CompiledStep(step, shapes, jit_compile=cfg.model.jit_compile, factory=cfg.model.step)
    packed = PackedSteps.for_buckets(compiled, bucket_set.buckets, model_device())  # the programs the loop runs
    # real batches, as `run` compiles and times on; of the base arrays only, as the tf.data pipeline yields them
    warm = warm_batches(plan, bucket_set, dataclasses.replace(manifest, extras=()), 0)
    packed.warm_up(step.variables(), warm)
    limit = measure_resident_limit(
        packed,
        step.variables(),
        shapes,
        cfg.consumer.feed_efficiency_steps,
        resident_vocab(manifest.token_range, cfg.model.vocab_size),
        batches=warm,
    )
    it = iter(baselines.tuned_dataset(files, bucket_set, spec.get("parallel_calls")))
    window = StepWindow(window_s=math.inf)
    devices: list[str] = []
    end_s = 0.0
    real_frames = padded_frames = 0  # of the measured batches, as the loop's summary counts them
    for done in range(1, spec["warmup"] + spec["batches"] + 1):
        t_wait = time.perf_counter()
        element = next(it)
        t0 = time.perf_counter()
        bucket = int(element["bucket"][0])
        raw = compiled.run(bucket, element)
        read_outputs(raw)  # as melfeed's loop: the step has finished with the batch
        end_s = time.perf_counter()
        devices = devices or step_devices(raw)
        if done > spec["warmup"]:
            real_frames += int(np.sum(element["mel_len"]))
            padded_frames += int(element["mel"].shape[0]) * int(element["mel"].shape[1])
            window.add(
                StepRecord(
                    end_s, t0 - t_wait, end_s - t0, int(element["mel_len"].shape[0]), 0, 0, 0, limit.step_s[bucket]
                )
            )
    figures = window.figures(end_s)
    if figures is None or figures.feed_efficiency is None:
        raise RuntimeError("no measured batch")
    return _result(
        spec,
        feed_efficiency=figures.feed_efficiency,
        resident_steps_per_s=figures.batches_per_s / figures.feed_efficiency,
        stall_pct=figures.stall_pct,
        step_p50_ms=1000.0 * figures.step_p50_s,
        devices=devices,
        padding_efficiency=real_frames / padded_frames if padded_frames else 0.0,
    )
