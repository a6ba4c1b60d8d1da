"""Stages 2-4 of ``melfeed doctor``, measured with the consumer's real code.

``python -m melfeed.consumer.doctor.probe transport --config FILE --producers N --seconds S [--debug-delay-ms D]
[--work-dir DIR]``: a real ``Consumer`` (library mode, every batch released at once, no step) on a private ipc
endpoint in DIR (doctor's, which doctor removes; a temporary directory of its own without it) and a real
producer group (``melfeed producer``, a child process). The clock
starts at the first delivered batch (producer start-up excluded) and runs S seconds:
``{"producers", "batches", "elapsed_s", "batches_per_s", "producers_alive"}``.

``python -m melfeed.consumer.doctor.probe device --config FILE --seconds S``: per bucket, the host->device
hand-off (``to_tensors`` + ``tf.identity`` under ``tf.device`` of the first GPU TensorFlow sees,
else the CPU) and the compiled step (``CompiledStep`` with the configured ``model.step``, on the replicas
``consumer.replicas`` asks for, warmed up and timed on each bucket's warm-up batch: its first full planned
batch, read from the cache as ``run`` does, consumer/train/warm_batches.py):
``{"device", "compile_s", "buckets": [{"index", "h2d_ms_p50", "step_ms_p50", "step_ms_p99", "runs"}]}``.

Each mode prints ONE JSON object on stdout (logs go to stderr). Exit codes: 0 measured, 78
configuration error (one line), 1 runtime failure (one line: e.g. no batch arrived).
Shutdown: the producer group gets the stop ladder (``melfeed.shared.service.children.Child``: SIGTERM, a
bounded wait, then SIGKILL); the consumer is closed (its slot files unlinked), on SIGTERM too
(``exit_on_sigterm``: the exception unwinds them, exit 143). Started by doctor (``MELFEED_PARENT_PID``), the
probe gets SIGTERM when doctor dies, even by SIGKILL, and names itself to its producer group, which then
stops itself when the probe dies.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from melfeed.shared.service.children import Child, child_env, entry_argv, handed_over_config, spawn
from melfeed.shared.service.lifecycle import PARENT_PID_ENV
from melfeed.shared.service.stop_ladder import GROUP_LADDER

__all__ = ["main", "measure_transport", "measure_device", "transport_endpoint"]

_FIRST_BATCH_TIMEOUT_S = 60.0  # producer start-up on a loaded 2-core machine stays well below
_MIN_RUNS = 3  # timed step runs per bucket, whatever the time budget
_MAX_RUNS = 200


def transport_endpoint(work_dir: Path) -> str:
    """The transport probe's consumer endpoint in ``work_dir`` (doctor derives its slot files' directory from it)."""
    return f"ipc://{work_dir}/doctor.sock"


def measure_transport(
    config_path: str, producers: int, seconds: float, debug_delay_ms: float, work_dir: Path | None = None
) -> dict[str, Any]:
    """Delivered batches/s from ``producers`` real producers into a real consumer ring."""
    from melfeed.consumer.feed import Consumer
    from melfeed.shared.config.loader import config_from_mapping, config_to_mapping, load_config, with_overrides
    from melfeed.shared.errors import PipelineError

    with (
        contextlib.nullcontext(str(work_dir))
        if work_dir is not None
        else tempfile.TemporaryDirectory(prefix="melfeed-doctor-")
    ) as tmp:
        data = config_to_mapping(
            with_overrides(
                load_config(config_path),
                {"transport.endpoint": transport_endpoint(Path(tmp)), "producer.count": producers},
            )
        )
        data["consumer"]["steps"] = None  # no end: with_overrides skips None values
        cfg = config_from_mapping(data)
        extra = ["--debug-delay-ms", str(debug_delay_ms)] if debug_delay_ms else []
        with (
            handed_over_config(config_to_mapping(cfg), "producers.yaml", Path(tmp)) as producer_cfg,
            Consumer(cfg) as feed,
        ):
            # PARENT_PID_ENV: the group stops itself when this probe dies, even by SIGKILL (doctor killed)
            proc = spawn(
                entry_argv("producer", "--config", str(producer_cfg), *extra),
                stdout=sys.stderr,
                env=child_env({"XDG_RUNTIME_DIR": tmp, PARENT_PID_ENV: str(os.getpid())}),
            )
            with Child(proc, "producer group", GROUP_LADDER) as group:
                n, elapsed_s = _count_batches(feed, group.proc, seconds)
                alive = feed._receiver.stats().producers_alive
                path = "shm" if feed._shm is not None else "zmq"  # the data path these batches took
    if n < 2:
        raise PipelineError(
            f"only {n} batch(es) arrived from {producers} producer(s) (producer group exit code {proc.returncode})"
        )
    return {
        "producers": producers,
        "batches": n - 1,
        "elapsed_s": elapsed_s,
        "batches_per_s": (n - 1) / elapsed_s,
        "producers_alive": alive,
        "path": path,
    }


def _count_batches(feed: Any, group: subprocess.Popen[Any], seconds: float) -> tuple[int, float]:
    """Batches taken (and released at once) and the seconds from the first to the last one."""
    deadline = time.monotonic() + _FIRST_BATCH_TIMEOUT_S
    n, first_s, last_s = 0, 0.0, 0.0
    while group.poll() is None:
        now = time.monotonic()
        if (n == 0 and now > deadline) or (n > 0 and now - first_s >= seconds):
            break
        batch = feed.next_batch(0.5)
        if batch is None:
            continue
        feed.release(batch)
        last_s = time.monotonic()
        first_s = first_s if n else last_s
        n += 1
    return n, max(last_s - first_s, 1e-9)


def measure_device(config_path: str, seconds: float) -> dict[str, Any]:
    """Host->device hand-off and compiled step time per bucket on its warm-up batch, on the GPU(s)
    ``consumer.model_gpu`` selects (applied before TensorFlow is imported, as ``run`` does)."""
    from dataclasses import replace

    from melfeed.consumer.placement import prepare_tensorflow, step_devices
    from melfeed.shared.config.loader import load_config

    cfg = load_config(config_path)
    # the model GPU as `run` would use it; no cache made inside a state dir the doctor must not create
    prepare_tensorflow(replace(cfg, consumer=replace(cfg.consumer, state_dir=None)))
    import tensorflow as tf

    from melfeed.consumer.train.handoff import to_tensors
    from melfeed.consumer.train.model import StepSpec
    from melfeed.consumer.train.replicas import Replicas, replica_scope
    from melfeed.consumer.train.step import CompiledStep, build_step
    from melfeed.shared.cache.features import load_manifest_for
    from melfeed.shared.wire.buckets import build_buckets

    manifest = load_manifest_for(cfg)
    bucket_set = build_buckets(
        manifest.frames,
        manifest.token_counts,
        cfg.n_mels,
        cfg.buckets,
        manifest.schema,
        mel_dtype=cfg.transport.mel_dtype,
    )
    m = cfg.model
    shapes = [b.shapes() for b in bucket_set.buckets]
    replicas = Replicas.from_config(cfg)  # consumer.replicas: the arrangement `run` would use
    extras = manifest.schema.extras
    with replica_scope(replicas):
        step_fn = build_step(
            m.step,
            StepSpec.from_config(cfg, shapes, batches_per_epoch=None, extras=extras),
            frame_multiple=cfg.buckets.frame_multiple,
        )
    compiled = CompiledStep(
        step_fn,
        shapes,
        jit_compile=m.jit_compile,
        factory=m.step,
        replicas=replicas,
        extras=extras,
        mel_dtype=cfg.transport.mel_dtype,
    )
    from melfeed.consumer.flow.plan import EpochPlan
    from melfeed.consumer.train.warm_batches import warm_batches

    plan = EpochPlan(bucket_set, manifest.fingerprint, cfg.seed, cfg.buckets.partial)
    warm = warm_batches(plan, bucket_set, manifest, 0)  # real batches, as `run` compiles and times on
    compile_s = compiled.warm_up(warm)
    gpus = tf.config.list_logical_devices("GPU")
    device = gpus[0].name if gpus else "/CPU:0"
    budget_s = seconds / max(1, len(bucket_set.buckets))
    out = []
    ran_on: set[str] = set()
    for b in bucket_set.buckets:
        arrays = warm[b.index].arrays  # views of a 64-byte aligned region, as a slot's
        h2d_ms = _time_runs(functools.partial(_hand_off, tf, to_tensors, arrays, device), budget_s / 4)
        tensors, _ = to_tensors(arrays)
        first = compiled.run(b.index, tensors)  # one untimed run: first-call dispatch costs
        float(first["loss"])
        ran_on.update(compiled.devices or step_devices(first))
        step_ms = _time_runs(functools.partial(_step_loss, compiled, b.index, tensors), budget_s)
        out.append(
            {
                "index": b.index,
                "h2d_ms_p50": _pct(h2d_ms, 50),
                "step_ms_p50": _pct(step_ms, 50),
                "step_ms_p99": _pct(step_ms, 99),
                "runs": len(step_ms),
            }
        )
    return {
        "device": device,
        "step_devices": sorted(ran_on),
        "compile_s": compile_s,
        "compiles_after_ready": compiled.compiles_after_ready,
        "buckets": out,
    }


def _hand_off(tf: Any, to_tensors: Any, arrays: dict[str, Any], device: str) -> None:
    tensors, _ = to_tensors(arrays)
    with tf.device(device):
        moved = [tf.identity(t) for t in tensors.values()]
    # host sync: read back the last array; copies to a device run in order on one stream
    tf.reshape(moved[-1], [-1])[:1].numpy()


def _step_loss(compiled: Any, index: int, tensors: Any) -> float:
    """One run of bucket ``index``'s program, its loss read to the host (the wait for the device)."""
    return float(compiled.run(index, tensors)["loss"])


def _time_runs(fn: Callable[[], object], budget_s: float) -> list[float]:
    times_ms: list[float] = []
    started = time.perf_counter()
    while len(times_ms) < _MAX_RUNS and (len(times_ms) < _MIN_RUNS or time.perf_counter() - started < budget_s):
        t0 = time.perf_counter()
        fn()
        times_ms.append(1000 * (time.perf_counter() - t0))
    return times_ms


def _pct(values: list[float], q: float) -> float:
    from melfeed.shared.metrics import percentile

    return percentile(sorted(values), q)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="melfeed.consumer.doctor.probe")
    ap.add_argument("mode", choices=("transport", "device"))
    ap.add_argument("--config", required=True)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--debug-delay-ms", type=float, default=0.0)
    ap.add_argument("--work-dir", type=Path, help="transport: the caller's directory for the socket and config")
    args = ap.parse_args(argv)

    from melfeed.shared.errors import PipelineError
    from melfeed.shared.service.lifecycle import die_with_named_parent, exit_on_sigterm, setup_logging

    setup_logging(os.environ.get("MELFEED_LOG_LEVEL", "WARNING"))
    try:
        with exit_on_sigterm():  # stopped by doctor: close the consumer, stop the producers first
            die_with_named_parent()  # started by doctor: ends with it, even when doctor is SIGKILLed
            if args.mode == "transport":
                result = measure_transport(
                    args.config, args.producers, args.seconds, args.debug_delay_ms, args.work_dir
                )
            else:
                result = measure_device(args.config, args.seconds)
    except PipelineError as err:
        print(f"melfeed.consumer.doctor.probe {args.mode}: {err}", file=sys.stderr)
        return err.exit_code
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from melfeed.shared.service.lean_tensorflow import quiet_tensorflow_import, skip_optional_imports_of_tensorflow

    skip_optional_imports_of_tensorflow()  # TensorFlow's import without JAX and matplotlib: 1-1.5 s of CPU less
    quiet_tensorflow_import()  # and without its C++ lines below TF_CPP_MIN_LOG_LEVEL
    sys.exit(main())
