"""``melfeed bench``: melfeed against tuned tf.data, the naive loader and tf.data service.

Role: run every system on the same cache, bucket shapes and compiled zero-cost step, each trial a
fresh ``python -m melfeed.consumer.bench.trial`` process (helpers are its children; ``--smoke``: each section's
trials in turn in one, its timeout ``--trial-timeout-s`` times their number), in ``--rounds``
rounds that alternate the systems (the order rotates every round, so drift hits all of them), then
print medians, ratios against the best tuned tf.data and the goals as PASS/FAIL, and write every
raw trial plus the medians with ``--json``. A transport section (or ``--transport-only``) measures
producer -> consumer GB/s on each path against memcpy measured in the same trial. A feed-efficiency
section (``--efficiency-batches``, or ``--efficiency-only``) trains the configured model (the reference
model by default) fed by melfeed and by tuned tf.data, each against its own resident-batch limit
(``consumer/bench/efficiency.py``); its trials share one persistent XLA cache so only the first compiles.
The ``tcp`` system (in ``--transports`` by default) is the payload path a remote producer takes:
loopback tcp under CURVE, one producer count, max rate only, so it adds one trial per round. Each round
also runs doctor's stage 1 (``python -m melfeed.producer.probe --warm``) once: a long-running producer's CPU per batch
built.
The transport section and the build probe also run with ``transport.mel_dtype: float16`` (``--mel-dtypes``):
rows labelled ``-f16``, the cache's mels as they are (float16 files) or cast (float32 files), no goal.
shm rows run only when this build's ``TransportConfig`` has ``mode``; otherwise they are reported
as not available. Exit codes: 0 when every trial ran (goal FAILs are results, not errors), 1 when a
trial failed (its one-line error is printed and kept in the JSON), 78 for a bad flag or cache.
Shutdown: a trial past ``--trial-timeout-s`` is killed with its whole process group. SIGTERM or SIGINT
stops the running trial or probe (its group, with the stop ladder) and exits ``128 + signal`` without a
report (``melfeed.shared.service.children.CommandChildren``); no child outlives bench. A trial stopped by SIGTERM
unwinds (its consumer, producers, keys); bench removes each trial's runtime dir (socket, CURVE keys) once
the trial's group is gone, and the slot files of a trial killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from melfeed.consumer.bench.efficiency import build_efficiency, efficiency_systems
from melfeed.consumer.bench.report import build_report, render
from melfeed.consumer.placement import XLA_CACHE_FLAG
from melfeed.consumer.transport.shm_slots import clean_stale, resolve_shm_dir
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.cache.pack_format import pack_path
from melfeed.shared.config import PipelineConfig, TransportConfig, resolve_runtime_dir
from melfeed.shared.config.loader import config_to_mapping, with_overrides
from melfeed.shared.errors import ConfigError
from melfeed.shared.flag_checks import check_number, check_output_file, resolve_path
from melfeed.shared.metrics import FEED_EFFICIENCY_MIN_STEPS
from melfeed.shared.output_files import write_output
from melfeed.shared.service.children import CommandChildren, Interrupted, child_env, handed_over_config, module_argv
from melfeed.shared.service.cli import loaded_config
from melfeed.shared.service.leftovers import remove_dead_temp_dirs, temp_dir_prefix
from melfeed.shared.service.stop_ladder import communicate_or_kill

__all__ = ["main_bench"]

log = logging.getLogger(__name__)

_ZERO_STEP = "melfeed.consumer.bench.trial:zero_step"
_BUILD_PROBE_S = 5.0  # doctor's stage 1 per round (1 s with --smoke)
_SMOKE = {
    "rounds": 1,
    "step_ms": "5",
    "producer_counts": "1",
    "tfdata_parallel": "8",
    "batches": 10,
    "warmup": 3,
    "demo_utterances": 200,
    "mel_dtypes": "float32",
}
_F16_SUFFIX = {"float32": "", "float16": "-f16"}  # system-name label of a wire format (transport.mel_dtype)
_EFFICIENCY_BATCHES = {False: 100, True: 0}  # --efficiency-batches when not given: full run / --smoke
_MAX_TRIAL_TIMEOUT_S = 86400.0  # a day per trial; far larger values overflow the waits
_MAX_SERVICE_WORKERS = 64  # tf.data service workers: one TensorFlow process each
_CHILDREN = CommandChildren("bench children")  # every trial and probe; SIGTERM/SIGINT stop them, none outlives bench


def _ints(text: str, flag: str, low: int = 0) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise ConfigError(f"must be a comma-separated list of integers >= {low}", path=(flag,), got=text)
    return values


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings; ``--smoke`` replaces the flags it names (``_SMOKE``), which are checked all the same.

    Flags that hold for the whole run are checked first, before any trial: a bad ``--json`` path found
    after the last trial would lose every result.
    """
    _check_run_flags(args)
    own = {k: getattr(args, k) for k in _SMOKE}
    checked = _checked(own, args)  # a bad flag is refused, --smoke or not
    return _checked({**own, **_SMOKE}, args) if args.smoke else checked


def _check_run_flags(args: argparse.Namespace) -> None:
    check_number(args.trial_timeout_s, "--trial-timeout-s", above=True, ceiling=_MAX_TRIAL_TIMEOUT_S)
    if not 0 <= args.service_workers <= _MAX_SERVICE_WORKERS:
        raise ConfigError(
            f"must be in 0..{_MAX_SERVICE_WORKERS} (0 = skip the service)",
            path=("--service-workers",),
            got=args.service_workers,
        )
    for other in ("no_transport", "efficiency_only"):
        if args.transport_only and getattr(args, other):
            raise ConfigError(f"contradicts --{other.replace('_', '-')}: pick one", path=("--transport-only",))
    check_output_file(args.output, "--output")


def _checked(pick: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    mel_dtypes = [t for t in pick["mel_dtypes"].split(",") if t]
    if not mel_dtypes or set(mel_dtypes) - set(_F16_SUFFIX):
        raise ConfigError(
            "must be a comma-separated subset of float32,float16", path=("--mel-dtypes",), got=pick["mel_dtypes"]
        )
    transports = [t for t in args.transports.split(",") if t]
    if not transports or set(transports) - {"zmq", "shm", "tcp"}:
        raise ConfigError(
            "must be a comma-separated subset of zmq,shm,tcp", path=("--transports",), got=args.transports
        )
    parallel = [
        None if p == "autotune" else _ints(p, "--tfdata-parallel", 1)[0]
        for p in pick["tfdata_parallel"].split(",")
        if p
    ]
    if pick["rounds"] < 1 or pick["batches"] < 1 or pick["warmup"] < 1:
        raise ConfigError("must be >= 1", path=("--rounds/--batches/--warmup",))
    return {
        "rounds": pick["rounds"],
        "step_ms": _ints(pick["step_ms"], "--step-ms", 1),
        "producers": _ints(pick["producer_counts"], "--producer-counts", 1),
        "transports": transports,
        "tfdata_parallel": parallel,
        "batches": pick["batches"],
        "warmup": pick["warmup"],
        "demo_utterances": pick["demo_utterances"],
        "service_workers": args.service_workers,
        "mel_dtypes": mel_dtypes,
        "has_mode": "mode" in TransportConfig.__dataclass_fields__,
        "efficiency_batches": _efficiency_batches(args),
        "one_trial_process": bool(args.smoke),  # a structural check: one TensorFlow start per section, not per trial
    }


def _efficiency_batches(args: argparse.Namespace) -> int:
    n = args.efficiency_batches if args.efficiency_batches is not None else _EFFICIENCY_BATCHES[bool(args.smoke)]
    least = FEED_EFFICIENCY_MIN_STEPS  # fewer fed steps never give a figure (docs/design.md "Feed efficiency")
    if n < 0 or (args.efficiency_only and n < 1) or 0 < n < least:
        raise ConfigError(
            f"must be >= {least} (feed efficiency is reported after {least} fed steps), or 0 to skip the "
            "section (not with --efficiency-only)",
            path=("--efficiency-batches",),
            got=n,
        )
    return int(n)


def _cache_config(args: argparse.Namespace, s: dict[str, Any]) -> PipelineConfig:
    cfg = with_overrides(loaded_config(args), {"cache_dir": args.cache_dir})
    if args.demo:
        from melfeed.shared.cache.demo_data import (
            default_demo_dir,  # the same cache `run --demo` uses
            write_demo_cache,
        )
        from melfeed.shared.cache.pack_write import ensure_pack

        cache = Path(args.cache_dir) if args.cache_dir else default_demo_dir(s["demo_utterances"])
        manifest = write_demo_cache(cache, n_utterances=s["demo_utterances"], extras=True)  # packed: float32
        if "float16" in s["mel_dtypes"]:
            ensure_pack(manifest, "float16")  # the -f16 rows read a float16 pack, as a user would write one
        cfg = with_overrides(cfg, {"cache_dir": str(cache)})
    if cfg.cache_dir is None:
        raise ConfigError("is required (--cache-dir, --demo, or cache_dir in the config)", path=("cache_dir",))
    from melfeed.shared.cache.features import load_manifest_for

    _check_full_batch(cfg, load_manifest_for(cfg))  # a missing or bad cache fails here, once, with its path
    return with_overrides(cfg, {"cache_dir": str(resolve_path(cfg.cache_dir, ("cache_dir",)))})


def _check_full_batch(cfg: PipelineConfig, manifest: Manifest) -> None:
    """The tf.data baselines compare full batches only (``melfeed.consumer.bench.baselines``): a cache whose plan has
    none is refused before any trial, not reported as a failed baseline in every round after the rest ran.

    Raises:
        ConfigError: naming ``cache_dir``, its utterance count and the batch sizes.
    """
    from melfeed.consumer.flow.plan import EpochPlan
    from melfeed.shared.wire.buckets import build_buckets

    buckets = build_buckets(manifest.frames, manifest.token_counts, cfg.n_mels, cfg.buckets, manifest.schema)
    plan = EpochPlan(buckets, manifest.fingerprint, cfg.seed, cfg.buckets.partial)
    if not any(len(b.sample_ids) == buckets.buckets[b.bucket].batch_size for b in plan.epoch(0)):
        sizes = sorted({b.batch_size for b in buckets.buckets})
        raise ConfigError(
            f"{manifest.cache_dir} has {len(manifest)} utterances, not one full batch in any bucket "
            f"(rows per batch: {', '.join(map(str, sizes))}); bench compares full batches: use a "
            "larger cache (or bench --demo) or a smaller buckets.batch_size",
            path=("cache_dir",),
        )


def _systems(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Every system of the run: name, kind and its own knobs (``available`` False: reported, not run).

    ``tcp`` is the payload path as a remote producer runs it (loopback tcp, CURVE, crc32 as
    ``resolve_checksum`` decides): one system, the first producer count, the max-rate trial only
    (``steps``), which is what its goals need; the step-cost columns stay the ipc paths'.
    """
    out: list[dict[str, Any]] = []
    for transport in s["transports"]:
        if transport == "tcp":
            count = s["producers"][0]
            out.append(
                {
                    "system": f"melfeed-tcp-p{count}",
                    "kind": "melfeed",
                    "transport": "tcp",
                    "producers": count,
                    "available": True,
                    "tcp": True,
                    "steps": [0],
                }
            )
            continue
        for count in s["producers"]:
            out.append(
                {
                    "system": f"melfeed-{transport}-p{count}",
                    "kind": "melfeed",
                    "transport": transport,
                    "producers": count,
                    "available": transport == "zmq" or s["has_mode"],
                }
            )
    for par in s["tfdata_parallel"]:
        out.append(
            {
                "system": f"tfdata-{'autotune' if par is None else f'npc{par}'}",
                "kind": "tfdata",
                "parallel_calls": par,
                "available": True,
            }
        )
    out.append({"system": "naive", "kind": "naive", "available": True})
    if s["service_workers"] > 0:
        out.append(
            {
                "system": f"tfdata-service-w{s['service_workers']}",
                "kind": "service",
                "parallel_calls": max([p for p in s["tfdata_parallel"] if p] or [8]),
                "workers": s["service_workers"],
                "available": True,
            }
        )
    return out


def _trial_config(cfg: PipelineConfig, system: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    batches = s["efficiency_batches"] if system.get("model") else s["batches"]
    over: dict[str, Any] = {
        "consumer.steps": s["warmup"] + batches,
        "consumer.warmup_steps": s["warmup"],
        "consumer.status_interval_s": 3600.0,
        # feed-efficiency trials train the configured model (the reference one by default)
        "model.step": cfg.model.step if system.get("model") else _ZERO_STEP,
        # XLA, as the calibration and the tf.data baselines compile the zero step
        "model.jit_compile": True,
        "producer.count": system.get("producers", 1),
    }
    mapping = config_to_mapping(with_overrides(cfg, over))
    mapping["consumer"]["state_dir"] = None
    mapping["transport"]["endpoint"] = None  # ipc in the trial's private runtime dir (tcp: set by the trial)
    if s["has_mode"] and "transport" in system:
        mapping["transport"]["mode"] = "zmq" if system.get("tcp") else system["transport"]
    if "mel_dtype" in system:  # the transport section's -f16 rows
        mapping["transport"]["mel_dtype"] = system["mel_dtype"]
    return mapping


def _trial_cleanup(runtime: Path, shm_dir: str | None) -> Callable[[int], None]:
    """What a trial leaves once its group is gone: its runtime dir (socket, keys, configs) and, if it was killed,
    its consumer's slot files (named by its pid) in the directory its endpoint in ``runtime`` resolves to."""
    shm = resolve_shm_dir(shm_dir, f"ipc://{resolve_runtime_dir({'XDG_RUNTIME_DIR': str(runtime)})}/melfeed.sock")

    def cleanup(pid: int) -> None:
        shutil.rmtree(runtime, ignore_errors=True)
        clean_stale(shm, pid)

    return cleanup


def _run_trial(spec: dict[str, Any], timeout_s: float, runtime: Path) -> dict[str, Any]:
    """One trial with ``runtime`` (bench's, made here, removed after it) as its runtime and work directory."""
    return _run_trials([spec], timeout_s, runtime)[0]


def _run_trials(specs: list[dict[str, Any]], timeout_s: float, runtime: Path) -> list[dict[str, Any]]:
    """``specs`` in turn in one trial process with ``runtime`` (as ``_run_trial``); a result per spec, in order.

    A spec the process did not report (it died, or ran past ``timeout_s``) is a failed trial with the reason;
    so is the last one when the process failed after reporting every spec as done.
    """
    extra = {"XDG_RUNTIME_DIR": str(runtime), "TF_CPP_MIN_LOG_LEVEL": "2"}
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(spec.get("model") for spec in specs):  # one compile of the model for all feed-efficiency trials
        cache = runtime.parent / "xla-cache"  # (runtime: <tmp>/e/<n>)
        cache.mkdir(parents=True, exist_ok=True)
        extra["TF_XLA_FLAGS"] = f"{XLA_CACHE_FLAG}={cache}"
    env = child_env(extra, drop=("RUNTIME_DIRECTORY",))
    proc = _CHILDREN.spawn(
        module_argv("melfeed.consumer.bench.trial", json.dumps([spec | {"work_dir": str(runtime)} for spec in specs])),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cleanup=_trial_cleanup(runtime, specs[0]["config"]["transport"].get("shm_dir")),
    )
    what = f"bench trial {specs[0]['system']}" if len(specs) == 1 else f"bench trials ({len(specs)} in one process)"
    try:
        out, err, timed_out = communicate_or_kill(proc, what, timeout_s)
    finally:
        _CHILDREN.finish(proc)
    _CHILDREN.check()  # SIGTERM/SIGINT stopped this trial: not a result
    if timed_out:
        err = f"killed after {timeout_s:.0f} s\n{err}"
    results: list[dict[str, Any]] = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")][: len(specs)]
    if proc.returncode == 0 and len(results) == len(specs):
        return results
    told = {r.get("error") for r in results}  # the failures the process reported itself
    reason = (
        [ln for ln in err.splitlines() if ln.startswith("bench trial") and ln not in told]
        or err.strip().splitlines()
        or [f"exit {proc.returncode}"]
    )[-1]
    if len(results) == len(specs) and all(r["ok"] for r in results):
        results.pop()  # the process failed after its last line

    def failed(spec: dict[str, Any]) -> dict[str, Any]:
        return {k: spec[k] for k in ("system", "kind", "round", "step_ms")} | {"ok": False, "error": reason}

    return results + [failed(spec) for spec in specs[len(results) :]]


def _spec(cfg: PipelineConfig, system: dict[str, Any], s: dict[str, Any], rnd: int, step_ms: int) -> dict[str, Any]:
    return {
        "system": system["system"],
        "kind": system["kind"],
        "round": rnd,
        "step_ms": step_ms,
        "model": system.get("model"),
        "warmup": s["warmup"],
        "tcp": bool(system.get("tcp")),
        "batches": s["efficiency_batches"] if system.get("model") else s["batches"],
        "parallel_calls": system.get("parallel_calls"),
        "workers": system.get("workers", 1),
        "config": _trial_config(cfg, system, s),
    }


def _rounds(
    cfg: PipelineConfig,
    systems: list[dict[str, Any]],
    s: dict[str, Any],
    steps: list[int],
    timeout_s: float,
    workdir: Path,
) -> list[dict[str, Any]]:
    """Every trial of ``systems`` at each of ``steps`` in each round, each in its own process; all of them in one
    process with ``s["one_trial_process"]`` (``--smoke``: one TensorFlow start for the whole section)."""
    runnable = [x for x in systems if x["available"]]
    specs: list[dict[str, Any]] = []
    for rnd in range(s["rounds"]):
        for step_ms in steps:
            k = rnd % max(1, len(runnable))
            for system in runnable[k:] + runnable[:k]:  # rotate: no system is always first
                if step_ms in system.get("steps", steps):
                    specs.append(_spec(cfg, system, s, rnd, step_ms))
    if s.get("one_trial_process") and specs:
        trials = _run_trials(specs, timeout_s * len(specs), workdir / "0")
        for spec, result in zip(specs, trials, strict=True):
            _log_trial(spec, result)
        return trials
    trials = []
    for spec in specs:
        trials.append(_run_trial(spec, timeout_s, workdir / str(len(trials))))
        _log_trial(spec, trials[-1])
    return trials


def _log_trial(spec: dict[str, Any], result: dict[str, Any]) -> None:
    log.info("trial %s round=%d step_ms=%d: %s", spec["system"], spec["round"], spec["step_ms"], _trial_line(result))


def _trial_line(result: dict[str, Any]) -> str:
    if not result["ok"]:
        return str(result["error"])
    if result.get("model"):
        return f"feed efficiency {result['feed_efficiency'] or 0:.3f} stall {result['stall_pct']:.2f} %"
    return f"{result['batches_per_s']:.1f} batches/s stall {result['stall_pct']:.2f} %"


def _build_probes(
    cfg: PipelineConfig, s: dict[str, Any], seconds: float, timeout_s: float, workdir: Path
) -> list[dict[str, Any]]:
    """Doctor's stage 1 once per round, warm (files open, values checked): CPU per batch a producer builds.

    Per wire format as the config reads the cache (its pack when ``producer.pack`` finds one); with a pack
    in use, once more from the ``.npy`` files (``producer-build-npy``, float32, no goal) to show what it saves,
    and once with the pack read by ``preadv`` instead of mapped (``producer-build-preadv``, no goal).
    """
    variants = [(f"producer-build{_F16_SUFFIX[d]}", {"transport.mel_dtype": d}) for d in s["mel_dtypes"]]
    if cfg.producer.pack != "off" and pack_path(str(cfg.cache_dir), "float32").exists():
        variants.append(("producer-build-npy", {"transport.mel_dtype": "float32", "producer.pack": "off"}))
        variants.append(("producer-build-preadv", {"transport.mel_dtype": "float32", "producer.pack": "preadv"}))
    results: list[dict[str, Any]] = []
    for system, over in variants:
        with handed_over_config(config_to_mapping(with_overrides(cfg, over)), f"{system}.yaml", workdir) as config:
            results += _build_probe_rounds(config, s, seconds, timeout_s, system)
    return results


def _build_probe_rounds(
    config: Path, s: dict[str, Any], seconds: float, timeout_s: float, system: str
) -> list[dict[str, Any]]:
    """``--rounds`` warm probes of one config, labelled ``system`` (``producer-build``, ``-f16``)."""
    results: list[dict[str, Any]] = []
    for rnd in range(s["rounds"]):
        proc = _CHILDREN.spawn(
            module_argv(
                "melfeed.producer.probe",
                "--config",
                str(config),
                "--seconds",
                str(seconds),
                "--seed",
                str(rnd),
                "--warm",
            ),
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err, timed_out = communicate_or_kill(proc, "bench producer build probe", timeout_s)
        finally:
            _CHILDREN.finish(proc)
        _CHILDREN.check()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        head = {"system": system, "kind": "build", "round": rnd, "step_ms": 0}
        if proc.returncode == 0 and lines and not timed_out:
            results.append(head | json.loads(lines[-1]) | {"ok": True})
        else:
            reason = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            results.append(head | {"ok": False, "error": f"killed after {timeout_s:.0f} s" if timed_out else reason})
        log.info(
            "%s probe round=%d: %s",
            system,
            rnd,
            f"{results[-1]['cpu_ms_per_batch']:.2f} CPU ms/batch" if results[-1]["ok"] else results[-1]["error"],
        )
    return results


def main_bench(args: argparse.Namespace) -> int:
    s = _settings(args)
    cfg = _cache_config(args, s)
    systems = _systems(s)
    ipc_systems = [x for x in systems if not x.get("tcp")]  # tcp: the max-rate table and its goals only
    efficiency = efficiency_systems(ipc_systems, s["producers"][0]) if s["efficiency_batches"] else []
    if args.transport_only or args.efficiency_only:
        systems = []
    transport = [
        x
        | {
            "system": f"transport-{x['transport']}-p{max(s['producers'])}{_F16_SUFFIX[dtype]}",
            "kind": "transport",
            "producers": max(s["producers"]),
            "mel_dtype": dtype,
        }
        for dtype in s["mel_dtypes"]
        for x in ipc_systems
        if x["kind"] == "melfeed" and x["producers"] == s["producers"][0]
    ]
    try:  # children stop before their directory goes
        remove_dead_temp_dirs("bench")  # a bench killed with SIGKILL left its directory
        with tempfile.TemporaryDirectory(prefix=temp_dir_prefix("bench")) as tmp, _CHILDREN:
            trials = _rounds(cfg, systems, s, [0] + s["step_ms"], args.trial_timeout_s, Path(tmp))
            probes = (
                []
                if args.no_transport or args.efficiency_only
                else _rounds(cfg, transport, s, [0], args.trial_timeout_s, Path(tmp) / "t")
            )
            builds = (
                []
                if args.transport_only or args.efficiency_only
                else _build_probes(cfg, s, 1.0 if args.smoke else _BUILD_PROBE_S, args.trial_timeout_s, Path(tmp))
            )
            fed = _rounds(cfg, efficiency, s, [0], args.trial_timeout_s, Path(tmp) / "e") if efficiency else []
    except Interrupted as stop:
        print(f"melfeed bench: {stop}: its trials were stopped, no report written", file=sys.stderr)
        return 128 + stop.signum
    report = build_report(trials, probes, systems + ([] if args.no_transport else transport), s, builds)
    if efficiency:
        report["feed_efficiency"] = build_efficiency(fed, efficiency)
        report["goals"] += report["feed_efficiency"]["goals"]
        report["failed"] += [
            f"{t['system']} (feed efficiency) round {t['round']}: {t.get('error')}" for t in fed if not t["ok"]
        ]
    report["command"] = list(sys.argv)
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    print(json.dumps(report, indent=1, default=str) if args.json else render(report))
    if args.output:
        try:
            write_output(args.output, json.dumps(report, indent=1, default=str) + "\n", what="--output")
        except OSError as err:  # checked before the trials; a full disk is still one line
            print(f"melfeed bench: {args.output}: cannot write: {err.strerror or err}", file=sys.stderr)
            return 1
    failed = [t for t in trials + probes + builds + fed if not t["ok"]]
    return 1 if failed else 0
