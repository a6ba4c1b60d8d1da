"""``bench`` trials in a fresh process: ``python -m melfeed.consumer.bench.trial SPEC_JSON`` prints their JSON lines.

SPEC_JSON is one trial's spec, or a list of specs run in turn in this process (``bench --smoke``), one JSON
line each.

Role: run one system (melfeed on ipc, shared memory or loopback tcp under CURVE with keys made for the
trial, tuned tf.data, the naive loader, tf.data service, or the transport probe) for ``warmup`` + ``batches`` batches
with one step cost and report its figures; a spec with
``"model": "reference"`` is a feed-efficiency trial instead (``consumer/bench/trial_reference.py``). Helpers
(producer group, service servers) are children of this process and are reaped before the CPU of
the children is read (``melfeed.consumer.bench.usage``).
Device-time model: the compiled zero-cost step (``zero_step``: reads one element of each array) runs
for real, then the loop sleeps so a step takes ``step_ms`` in total (``sleep_for_step_s``, with the
zero step's own median time measured here first). A GPU step costs the host no CPU; real compute on
this 2-core machine would steal the producers' core, which a sleep does not.
Stall % = time waiting for the next batch / wall time of the measured batches.
Shutdown: every helper is stopped in ``finally`` with the stop ladder of ``melfeed.shared.service.stop_ladder``
(producers: ``melfeed.consumer.producer_group.stop_producers``; service: ``ServiceProcesses.close``), on SIGTERM too
(``exit_on_sigterm``: the exception unwinds them, exit 143); the tcp trial's keys go in ``work_dir`` (bench's).
Started by bench
(``MELFEED_PARENT_PID``), the trial gets SIGTERM when bench dies, even by SIGKILL (``die_with_named_parent``);
its producers and servers do the same when it dies. Exit 0 after printing, 1 on any failure (one line on stderr;
its JSON line has ``"ok": false`` and that line as ``error``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from melfeed.consumer.bench.stats import gb_per_s, sleep_for_step_s
from melfeed.consumer.bench.usage import UsageWindow
from melfeed.shared.config import PipelineConfig, resolve_checksum
from melfeed.shared.config.loader import config_from_mapping, with_overrides
from melfeed.shared.service.children import child_env
from melfeed.shared.service.lifecycle import die_with_named_parent, exit_on_sigterm

__all__ = ["zero_step", "main"]

log = logging.getLogger(__name__)

_CALIBRATION_CALLS = 30
_MEMCPY_REPEATS = 20
_TCP_PRODUCER = "bench"  # the CURVE key name of the tcp trial's producers (they speak as bench-<index>)


class _ZeroStep:
    """The compiled step reduced to touching the batch: one element of each array, no variables."""

    def __init__(self, spec: object) -> None:
        del spec

    def __call__(self, mel: Any, mel_len: Any, tokens: Any, tok_len: Any) -> Any:
        import tensorflow as tf

        # the cast: a float16 wire (transport.mel_dtype) hands over float16 mel, cast inside the program
        return tf.cast(mel[0, 0, 0], tf.float32) + tf.cast(mel_len[0] + tokens[0, 0] + tok_len[0], tf.float32)

    def variables(self) -> list[Any]:
        return []

    def checkpoint_items(self) -> dict[str, object]:
        return {}  # nothing to save: bench trials never checkpoint


def zero_step(spec: object) -> _ZeroStep:
    """Step factory for ``model.step: melfeed.consumer.bench.trial:zero_step``."""
    return _ZeroStep(spec)


def _calibrate_zero_step_s(bucket_shapes: list[dict[str, tuple[int, ...]]]) -> float:
    """Median seconds of one compiled zero-cost step on the largest bucket (compile excluded)."""
    import tensorflow as tf

    from melfeed.consumer.train.step import CompiledStep

    largest = bucket_shapes[-1]  # buckets grow with their index
    compiled = CompiledStep(_ZeroStep(None), [largest])
    compiled.warm_up()
    batch = {k: tf.zeros(s, tf.float32 if k == "mel" else tf.int32) for k, s in largest.items()}
    times = []
    for _ in range(_CALIBRATION_CALLS):
        t0 = time.perf_counter()
        float(compiled.run(0, batch)["loss"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _result(
    spec: dict[str, Any],
    window: UsageWindow,
    batches: int,
    stall_pct: float,
    copies: float | None,
    zero_s: float,
    sleep_s: float,
) -> dict[str, Any]:
    children = window.children_cpu_s()
    return {
        "system": spec["system"],
        "kind": spec["kind"],
        "round": spec["round"],
        "step_ms": spec["step_ms"],
        "ok": True,
        "batches": batches,
        "wall_s": window.wall_s,
        "batches_per_s": batches / window.wall_s,
        "stall_pct": stall_pct,
        "trainer_cpu_s": window.trainer_cpu_s,
        "helpers_cpu_s": children,
        "trainer_cpu_ms_per_batch": 1000 * window.trainer_cpu_s / batches,
        "total_cpu_ms_per_batch": 1000 * (window.trainer_cpu_s + children) / batches,
        "trainer_rss_mb": window.trainer_rss_mb(),
        "total_rss_mb": window.trainer_rss_mb() + window.helpers_rss_mb,
        "payload_copies": copies,
        "zero_step_ms": 1000 * zero_s,
        "sleep_ms": 1000 * sleep_s,
    }


def _step_hook(window: UsageWindow, warmup: int, batches: int, sleep_s: float) -> Callable[[int], None]:
    def on_step(done: int) -> None:
        if sleep_s:
            time.sleep(sleep_s)  # device time of the step (see the module docstring)
        if done == warmup:
            window.open()
        elif done == warmup + batches:
            window.close()

    return on_step


def _free_loopback_port() -> int:
    """A tcp port free on 127.0.0.1 now (the consumer binds it a moment later; a clash fails the trial)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tcp_with_curve(cfg: PipelineConfig, keys_dir: Path) -> tuple[PipelineConfig, dict[str, Any]]:
    """The consumer's config on loopback tcp under CURVE, and the producers' overrides (their own key).

    crc32 stays as ``transport.checksum`` and ``resolve_checksum`` decide (off under CURVE by default).
    """
    from melfeed.shared.wire.curve import generate_keys

    generate_keys(keys_dir, [_TCP_PRODUCER])
    consumer = with_overrides(
        cfg,
        {
            "transport.endpoint": f"tcp://127.0.0.1:{_free_loopback_port()}",
            "transport.mode": "zmq" if "mode" in cfg.transport.__dataclass_fields__ else None,
            "transport.curve_secret_key": str(keys_dir / "consumer.key_secret"),
            "transport.curve_allowed_dir": str(keys_dir / "producers"),
        },
    )
    return consumer, {
        "transport.curve_secret_key": str(keys_dir / "producers" / f"{_TCP_PRODUCER}.key_secret"),
        "transport.curve_server_key": str(keys_dir / "consumer.key"),
    }


def _run_melfeed(spec: dict[str, Any], cfg: PipelineConfig) -> dict[str, Any]:
    # in bench's work dir for this trial (``work_dir``), which bench removes even if this process is SIGKILLed
    with tempfile.TemporaryDirectory(prefix="melfeed-bench-keys-", dir=spec.get("work_dir")) as keys:
        producer_over: dict[str, Any] = {}
        if spec.get("tcp"):
            cfg, producer_over = _tcp_with_curve(cfg, Path(keys))
        out = _run_melfeed_with(spec, cfg, producer_over)
    if spec.get("tcp"):
        t = cfg.transport
        out.update(endpoint=t.endpoint, curve=True, checksum=resolve_checksum(t.checksum, str(t.endpoint), t.insecure))
    return out


def _run_melfeed_with(spec: dict[str, Any], cfg: PipelineConfig, producer_over: dict[str, Any]) -> dict[str, Any]:
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.producer_group import start_producers, stop_producers
    from melfeed.consumer.train.loop import train

    warmup, batches = spec["warmup"], spec["batches"]
    window = UsageWindow()
    with Consumer(cfg) as consumer:
        shapes = [b.shapes() for b in consumer._bucket_set.buckets]
        zero_s = _calibrate_zero_step_s(shapes)
        sleep_s = sleep_for_step_s(spec["step_ms"], zero_s)
        group = start_producers(with_overrides(cfg, {"transport.endpoint": consumer._endpoint} | producer_over))
        try:
            summary = train(
                cfg,
                consumer,
                threading.Event(),
                process_start_s=time.time(),
                on_step=_step_hook(window, warmup, batches, sleep_s),
            )
        finally:
            stop_producers(group)
    if summary.steps < warmup + batches:
        raise RuntimeError(f"only {summary.steps} of {warmup + batches} batches arrived")
    return _result(spec, window, batches, summary.stall_pct, summary.payload_copies_per_batch, zero_s, sleep_s)


def _run_dataset(spec: dict[str, Any], cfg: PipelineConfig) -> dict[str, Any]:
    from melfeed.consumer.bench import baselines
    from melfeed.consumer.flow.plan import EpochPlan
    from melfeed.shared.cache.features import load_manifest_for
    from melfeed.shared.wire.buckets import build_buckets

    manifest = load_manifest_for(cfg)
    bucket_set = build_buckets(manifest.frames, manifest.token_counts, cfg.n_mels, cfg.buckets, manifest.schema)
    files = baselines.plan_files(
        manifest, EpochPlan(bucket_set, manifest.fingerprint, cfg.seed, cfg.buckets.partial), bucket_set, 1
    )
    shapes = [b.shapes() for b in bucket_set.buckets]
    window = UsageWindow()
    service = baselines.ServiceProcesses(spec["workers"], child_env()) if spec["kind"] == "service" else None
    try:
        from melfeed.consumer.train.step import CompiledStep  # TensorFlow: after the servers started their own import

        zero_s = _calibrate_zero_step_s(shapes)
        sleep_s = sleep_for_step_s(spec["step_ms"], zero_s)
        compiled = CompiledStep(_ZeroStep(None), shapes)
        compiled.warm_up()
        if spec["kind"] == "naive":
            ds = baselines.naive_dataset(files, bucket_set)
        else:
            ds = baselines.tuned_dataset(files, bucket_set, spec.get("parallel_calls"))
        if service is not None:
            ds = service.distribute(ds)
        stall_pct = _drive(iter(ds), compiled, window, spec["warmup"], spec["batches"], sleep_s)
    finally:
        if service is not None:
            service.close()
    return _result(spec, window, spec["batches"], stall_pct, float(baselines.COPIES[spec["kind"]]), zero_s, sleep_s)


def _drive(it: Any, compiled: Any, window: UsageWindow, warmup: int, batches: int, sleep_s: float) -> float:
    """The step loop over a tf.data iterator; returns stall % over the measured batches."""
    waited_s = 0.0
    for done in range(1, warmup + batches + 1):
        t0 = time.perf_counter()
        element = next(it)
        if done > warmup:
            waited_s += time.perf_counter() - t0
        float(compiled.run(int(element["bucket"][0]), element)["loss"])
        if sleep_s:
            time.sleep(sleep_s)
        if done == warmup:
            window.open()
    window.close()
    return 100.0 * waited_s / window.wall_s


def _memcpy_gb_per_s(nbytes: int) -> float | None:
    """numpy copyto of batch-sized buffers: the memory bandwidth the transports are compared with."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(_MEMCPY_REPEATS):
        np.copyto(dst, src)
    return gb_per_s(float(nbytes) * _MEMCPY_REPEATS, time.perf_counter() - t0)


def _run_transport(spec: dict[str, Any], cfg: PipelineConfig) -> dict[str, Any]:
    """Real producers -> real Consumer in library mode, each batch released at once."""
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.producer_group import start_producers, stop_producers

    warmup, batches = spec["warmup"], spec["batches"]
    window = UsageWindow()
    nbytes = 0
    with Consumer(cfg) as feed:
        memcpy = _memcpy_gb_per_s(feed._bucket_set.max_batch_nbytes())
        group = start_producers(with_overrides(cfg, {"transport.endpoint": feed._endpoint}))
        try:
            for done, batch in enumerate(feed.batches(), start=1):
                if done == warmup:
                    window.open()
                elif done > warmup:
                    nbytes += sum(a.nbytes for a in batch.arrays.values())
        finally:
            window.close()
            stop_producers(group)
    out = _result(spec, window, batches, 0.0, None, 0.0, 0.0)
    out.update(gb_per_s=gb_per_s(nbytes, window.wall_s), memcpy_gb_per_s=memcpy, payload_bytes=nbytes)
    return out


_RUNNERS = {
    "melfeed": _run_melfeed,
    "tfdata": _run_dataset,
    "naive": _run_dataset,
    "service": _run_dataset,
    "transport": _run_transport,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=os.environ.get("MELFEED_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s",
    )
    loaded = json.loads(args[0])
    specs: list[dict[str, Any]] = loaded if isinstance(loaded, list) else [loaded]
    failed = False
    with exit_on_sigterm():  # stopped by bench: stop the helpers, close the consumer, remove the keys first
        die_with_named_parent(signal.SIGTERM)  # a bench killed even with SIGKILL takes this trial down
        for spec in specs:  # in turn: one JSON line each (a failed one's line has its error)
            try:
                result = _run_spec(spec)
            except Exception as err:  # top level of the trial: one line for the orchestrator, then the next spec
                log.debug("trial failed", exc_info=True)
                reason = f"bench trial {spec.get('system')}: {type(err).__name__}: {err}"
                print(reason, file=sys.stderr, flush=True)
                result = {k: spec.get(k) for k in ("system", "kind", "round", "step_ms")} | {
                    "ok": False,
                    "error": reason,
                }
                failed = True
            print(json.dumps(result), flush=True)
    return 1 if failed else 0


def _run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    from melfeed.consumer.bench.trial_reference import run_melfeed_reference, run_tfdata_reference

    runners = (
        {"melfeed": run_melfeed_reference, "tfdata": run_tfdata_reference}
        if spec.get("model") == "reference"
        else _RUNNERS
    )
    return runners[spec["kind"]](spec, config_from_mapping(spec["config"]))


if __name__ == "__main__":
    from melfeed.shared.service.lean_tensorflow import quiet_tensorflow_import, skip_optional_imports_of_tensorflow

    skip_optional_imports_of_tensorflow()  # TensorFlow's import without JAX and matplotlib: 1-1.5 s of CPU less
    quiet_tensorflow_import()  # and without its C++ lines below TF_CPP_MIN_LOG_LEVEL
    sys.exit(main())
