"""``python -m melfeed.consumer.clients.jax_bench``: a JAX step fed by melfeed; feed efficiency, copy overlap, NVML.

Role: the data path measured on a machine that has JAX but no TensorFlow (a GPU machine), through the
library API only: real producer processes, the ``Consumer`` ring, ``Stager`` with ``JaxStageAdapter``
(``jax_feed.py``). Per run:
    * compile: the step once per bucket shape, before anything is timed;
    * resident limit: per bucket, ``--resident-steps`` steps back to back on one batch already on the
      device (the rate no loader can beat); copy: per bucket, one batch's ``device_put`` from pageable
      host memory, waited for (median of 5);
    * fed, once per ``--depths`` value: ``--warmup`` then ``--steps`` steps through the stager at that
      depth. Feed efficiency = the resident time of the measured batches' buckets / the wall time they
      took; copy overlap = the share of the copy time hidden behind steps, (copy + resident step -
      fed period) / copy, clipped to [0, 1]; model-GPU utilisation = the mean of NVML samples
      (``consumer/observe/gpu.py``) taken during the measured steps (None without NVML).
Prints one line per figure and, with ``--json``, writes them all. Exit 0, or 78 for a configuration
error (one line). Shutdown: producers are stopped in ``finally``; the consumer is closed by its block.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from melfeed.shared.service.cli import OneLineParser

__all__ = ["main", "measure"]

log = logging.getLogger(__name__)

_COPY_REPEATS = 5
_NVML_EVERY_S = 0.1


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m melfeed.consumer.clients.jax_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="pipeline YAML (cache_dir, buckets, transport); default: built-in defaults")
    ap.add_argument("--demo", action="store_true", help="the built-in demo cache, written first if missing")
    ap.add_argument("--cache-dir", help="with --demo: where the demo cache lives")
    ap.add_argument("--demo-utterances", type=int, default=2000)
    ap.add_argument("--producers", type=int, help="producer processes (default: producer.count)")
    ap.add_argument("--steps", type=int, default=300, help="measured steps per depth")
    ap.add_argument("--warmup", type=int, default=20, help="unmeasured steps before them, per depth")
    ap.add_argument("--depths", default="1,2", help="stage depths to measure, comma-separated")
    ap.add_argument("--hidden", type=int, default=1024, help="MLP width")
    ap.add_argument("--layers", type=int, default=4, help="hidden layers")
    ap.add_argument("--resident-steps", type=int, default=30, help="resident-limit steps per bucket")
    ap.add_argument("--device", type=int, default=0, help="index into jax.devices()")
    ap.add_argument("--json", help="write every figure here")
    return ap


def _config(args: argparse.Namespace) -> Any:
    from melfeed.shared.config.loader import load_config, with_overrides
    from melfeed.shared.errors import ConfigError
    from melfeed.shared.flag_checks import check_output_file
    from melfeed.shared.service.cli import with_demo_cache

    check_output_file(args.json, "--json")  # before the measurement, not after it
    cfg = with_demo_cache(args, load_config(args.config))
    depths = [int(d) for d in args.depths.split(",") if d.strip()] if args.depths.replace(",", "").isdigit() else []
    if not depths or min(depths) < 1:
        raise ConfigError("must be comma-separated stage depths >= 1", path=("--depths",), got=args.depths)
    for name in ("steps", "warmup", "hidden", "layers", "resident_steps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(
                "must be >= 1" if name != "warmup" else "must be >= 0",
                path=(f"--{name.replace('_', '-')}",),
                got=getattr(args, name),
            )
    over: dict[str, Any] = {
        "consumer.steps": len(depths) * (args.warmup + args.steps),
        "consumer.ring_slots": max(cfg.consumer.ring_slots, max(depths) + 1),
    }
    if args.producers is not None:
        over["producer.count"] = args.producers
    return with_overrides(cfg, over), depths


def _host_zeros(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, Any]) -> dict[str, Any]:
    """A batch's step arrays in 64-byte-aligned host memory, as a ring slot's are (JAX on the CPU then
    aliases them, as it does a slot: no copy, and the copy figure says so)."""
    import numpy as np

    out = {}
    for key in ("mel", "mel_len"):
        dtype = np.dtype(dtypes[key])
        nbytes = int(np.prod(shapes[key])) * dtype.itemsize
        raw = np.zeros(nbytes + 64, np.uint8)
        start = -raw.ctypes.data % 64
        out[key] = raw[start : start + nbytes].view(dtype).reshape(shapes[key])
    out["mel_len"][:] = shapes["mel"][1]
    return out


def _limits(handoff: Any, buckets: Sequence[Any], resident_steps: int) -> tuple[list[float], list[float], float]:
    """Per bucket: resident step seconds and copy seconds; and the compile seconds of every bucket."""
    from melfeed.consumer.clients.jax_feed import block_until_ready, device_batch

    t0 = time.perf_counter()
    hosts = [_host_zeros(b.shapes(), b.dtypes()) for b in buckets]
    for host in hosts:  # compile every shape before anything is timed
        block_until_ready(handoff.step(None, device_batch(host, handoff.device)))
    compile_s = time.perf_counter() - t0
    step_s, copy_s = [], []
    for host in hosts:
        on_device = block_until_ready(device_batch(host, handoff.device))
        start = time.perf_counter()
        for _ in range(resident_steps):
            loss = handoff.step(None, on_device)
        block_until_ready((loss, handoff.params))
        step_s.append((time.perf_counter() - start) / resident_steps)
        copies = []
        for _ in range(_COPY_REPEATS):
            start = time.perf_counter()
            block_until_ready(device_batch(host, handoff.device))
            copies.append(time.perf_counter() - start)
        copy_s.append(statistics.median(copies))
    return step_s, copy_s, compile_s


def _fed(
    feed: Any, handoff: Any, depth: int, warmup: int, steps: int, step_s: list[float], copy_s: list[float], sampler: Any
) -> dict[str, Any]:
    """``warmup`` + ``steps`` steps through the stager at ``depth``; the measured steps' figures."""
    from melfeed.consumer.staging import Stager

    stager = Stager(feed, handoff, depth)
    resident = copy = 0.0
    losses: list[float] = []
    util: list[float] = []
    t_start = t_end = next_sample_s = 0.0
    done = 0
    aliased0 = handoff.aliased
    for completed in stager.run():
        done += 1
        t_end = time.perf_counter()
        if done == warmup:
            t_start = t_end
        elif done > warmup:
            resident += step_s[completed.batch.bucket]
            copy += copy_s[completed.batch.bucket]
            losses.append(float(completed.result))
            if sampler is not None and t_end >= next_sample_s:
                util += [g["util_pct"] for g in sampler.snapshot()[:1]]
                next_sample_s = t_end + _NVML_EVERY_S
        if done == warmup + steps:
            break
    if done < warmup + steps:
        raise RuntimeError(f"the plan ended after {done} of {warmup + steps} steps at depth {depth}")
    wall_s = t_end - t_start if warmup else t_end
    period = wall_s / steps
    mean_step, mean_copy = resident / steps, copy / steps
    overlap = None if mean_copy <= 0 else min(1.0, max(0.0, (mean_copy + mean_step - period) / mean_copy))
    return {
        "depth": depth,
        "fed_steps_per_s": steps / wall_s,
        "feed_efficiency": resident / wall_s,
        "fed_period_ms": 1000 * period,
        "resident_step_ms": 1000 * mean_step,
        "copy_ms": 1000 * mean_copy,
        "copy_overlap": overlap,
        "gpu_util_pct": statistics.mean(util) if util else None,
        "max_in_flight": stager.max_in_flight,
        "slots_held_to_step_end": handoff.aliased - aliased0,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def measure(cfg: Any, depths: Sequence[int], args: argparse.Namespace) -> dict[str, Any]:
    """The whole measurement (see the module); producers started and stopped here."""
    import jax

    from melfeed.consumer.clients.jax_feed import JaxStageAdapter, init_params, mlp_step
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.observe.gpu import GpuSampler
    from melfeed.consumer.producer_group import start_producers, stop_producers
    from melfeed.shared.config.loader import with_overrides

    device = jax.devices()[args.device]
    params = jax.device_put(init_params(cfg.n_mels, args.hidden, args.layers), device)
    handoff = JaxStageAdapter(mlp_step(args.layers), params, device)
    sampler = GpuSampler(interval_s=_NVML_EVERY_S) if device.platform == "gpu" else None
    with Consumer(cfg) as feed:
        step_s, copy_s, compile_s = _limits(handoff, feed._bucket_set.buckets, args.resident_steps)
        group = start_producers(with_overrides(cfg, {"transport.endpoint": feed._endpoint}))
        if sampler is not None:
            sampler.start()
        try:
            runs = [_fed(feed, handoff, d, args.warmup, args.steps, step_s, copy_s, sampler) for d in depths]
        finally:
            if sampler is not None:
                sampler.stop()
            stop_producers(group)
    return {
        "device": str(device),
        "platform": device.platform,
        "jax": jax.__version__,
        "hidden": args.hidden,
        "layers": args.layers,
        "producers": cfg.producer.count,
        "transport": "shm" if feed._shm is not None else "zmq",
        "compile_s": compile_s,
        "resident_step_ms": [1000 * s for s in step_s],
        "copy_ms": [1000 * s for s in copy_s],
        "runs": runs,
        "command": ["python", "-m", "melfeed.consumer.clients.jax_bench", *sys.argv[1:]],
    }


def _print(report: dict[str, Any]) -> None:
    print(
        f"jax_bench: {report['device']} ({report['platform']}, jax {report['jax']}), MLP {report['layers']} x "
        f"{report['hidden']}, {report['producers']} producer(s) over {report['transport']}; compiled in "
        f"{report['compile_s']:.1f} s"
    )
    print("resident step ms per bucket: " + ", ".join(f"{x:.3f}" for x in report["resident_step_ms"]))
    print("copy ms per bucket (device_put, pageable): " + ", ".join(f"{x:.3f}" for x in report["copy_ms"]))
    for r in report["runs"]:
        util = "n/a" if r["gpu_util_pct"] is None else f"{r['gpu_util_pct']:.0f} %"
        overlap = "n/a" if r["copy_overlap"] is None else f"{r['copy_overlap']:.2f}"
        print(
            f"depth {r['depth']}: feed efficiency {r['feed_efficiency']:.3f} ({r['fed_steps_per_s']:.1f} steps/s, "
            f"period {r['fed_period_ms']:.3f} ms vs resident step {r['resident_step_ms']:.3f} ms + copy "
            f"{r['copy_ms']:.3f} ms), copy overlap {overlap}, GPU util {util}, in flight <= {r['max_in_flight']}, "
            f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    from melfeed.shared.errors import EXIT_CONFIG, PipelineError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        import jax  # noqa: F401  (the one dependency beyond melfeed's own)
    except ImportError:
        print("jax_bench: needs JAX (pip install -e '.[jax]', or jax[cuda] on a GPU machine)", file=sys.stderr)
        return EXIT_CONFIG
    try:
        cfg, depths = _config(args)
        report = measure(cfg, depths, args)
    except PipelineError as err:
        print(f"jax_bench: {err}", file=sys.stderr)
        return EXIT_CONFIG
    _print(report)
    if args.json:
        from melfeed.shared.output_files import write_output

        try:
            write_output(args.json, json.dumps(report, indent=1), what="--json")
        except PipelineError as err:  # another user's link or file put there since the check
            print(f"jax_bench: {err}", file=sys.stderr)
            return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
