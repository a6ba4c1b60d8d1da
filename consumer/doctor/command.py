"""``melfeed doctor``: measure every stage with the real code, name the bottleneck.

Role: the orchestrator. It runs the probes as real subprocesses (producer/ and consumer/ may not be
imported from shared/): ``python -m melfeed.producer.probe`` alone and N at once (stage 1: cache read +
assembly), ``python -m melfeed.consumer.doctor.probe transport`` with 1 and with N producers (stage 2), and
``python -m melfeed.consumer.doctor.probe device`` (stages 3 and 4: host->device hand-off and the compiled step).
Each probe prints one JSON object; ``melfeed.consumer.doctor.verdict.decide`` turns them into the verdict and
``melfeed.consumer.doctor.report`` prints it. Exit codes: 0 supply >= 1.2 x demand, 3 the data side is the
bottleneck (a verdict), 78 configuration error, 1 a probe failed (one line naming it), ``128 + signal``
after SIGTERM or SIGINT (one line, no report).
Invariants: every probe runs under a timeout; the effective config lives in a private temp
directory removed on exit; stages run one after another so they never compete with each other.
Shutdown: a probe past its timeout is killed (its process group: the transport probe's producers).
No probe outlives doctor (``melfeed.shared.service.children.CommandChildren``): SIGTERM or SIGINT stops the
running probes with their groups (then the stop ladder) and exits without a report; killed with SIGKILL,
doctor takes them down all the same, since each probe, and the producer group a transport probe
starts, gets SIGTERM when its parent dies (``die_with_named_parent``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from melfeed.consumer.doctor.arrangement import advise_data_gpu
from melfeed.consumer.doctor.env import check_environment, gather_facts
from melfeed.consumer.doctor.probe import transport_endpoint
from melfeed.consumer.doctor.report import render
from melfeed.consumer.doctor.verdict import ConfigFacts, Measurements, decide, memory_bound_bytes
from melfeed.consumer.transport.shm_slots import clean_stale, resolve_shm_dir
from melfeed.shared.cache.features import load_manifest_for
from melfeed.shared.config import PipelineConfig, resolve_checksum, resolve_runtime_dir
from melfeed.shared.config.loader import config_to_mapping, with_overrides
from melfeed.shared.errors import EXIT_CONFIG, CacheError, ConfigError
from melfeed.shared.flag_checks import check_number, check_output_file, resolve_path
from melfeed.shared.output_files import write_output
from melfeed.shared.service.children import CommandChildren, Interrupted, child_env, handed_over_config, module_argv
from melfeed.shared.service.cli import config_from_args
from melfeed.shared.service.leftovers import remove_dead_temp_dirs, temp_dir_prefix
from melfeed.shared.service.progress import Progress
from melfeed.shared.service.stop_ladder import GROUP_LADDER, Rung, communicate_or_kill, stop_all
from melfeed.shared.wire.bucket_mix import batch_mix, bucket_grid, bucket_padding
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from melfeed.shared.wire.grid import bucket_count

__all__ = ["main_doctor", "ProbeFailed"]

_PROBE_START_S = 120.0  # importing TensorFlow and compiling tiny steps on a loaded 2-core machine
_START_TOGETHER_S = 1.5  # N stage-1 probes wait for a common start (interpreter start-up is ~0.3 s)
_MAX_SECONDS_PER_STAGE = 3600.0  # an hour per stage; far larger values overflow the probes' timeouts
_STAGES = 5  # build x1, build xN, transport x1, transport xN, device


class ProbeFailed(Exception):
    """A probe exited non-zero; ``exit_code`` is 78 when it reported a configuration error."""

    def __init__(self, name: str, exit_code: int, detail: str) -> None:
        self.exit_code = EXIT_CONFIG if exit_code == EXIT_CONFIG else 1
        super().__init__(f"{name} probe failed (exit {exit_code}): {detail}")


def _probe_env() -> dict[str, str]:
    env = child_env({"MELFEED_LOG_LEVEL": "WARNING"})
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _finish(children: CommandChildren, name: str, proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    try:
        out, err, timed_out = communicate_or_kill(proc, f"{name} probe", timeout_s)
    finally:
        children.finish(proc)  # its group gone, its cleanup run
    children.check()  # SIGTERM/SIGINT stopped this probe: not a result
    if timed_out:
        raise ProbeFailed(name, 1, f"no result within {timeout_s:.0f} s")
    if proc.returncode != 0:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        raise ProbeFailed(name, proc.returncode, lines[-1] if lines else "no message")
    try:
        return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]
    except (ValueError, IndexError) as exc:
        raise ProbeFailed(name, 1, f"printed no JSON result: {out[-200:]!r}") from exc


def _spawn(children: CommandChildren, module: str, *args: str) -> subprocess.Popen[str]:
    """A probe in its own process group (a timeout kills it with its producers), one of doctor's ``children``."""
    return children.spawn(
        module_argv(module, *args), env=_probe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _build_stage(
    children: CommandChildren, config: Path, n: int, seconds: float, delay_ms: float
) -> list[dict[str, Any]]:
    together = ["--start-at", str(time.time() + _START_TOGETHER_S)] if n > 1 else []  # one probe waits for none
    procs = [
        _spawn(
            children,
            "melfeed.producer.probe",
            "--config",
            str(config),
            "--seconds",
            str(seconds),
            "--debug-delay-ms",
            str(delay_ms),
            "--seed",
            str(i),
            *together,
        )
        for i in range(n)
    ]
    try:
        return [_finish(children, f"producer (stage 1, {n} at once)", p, seconds + _PROBE_START_S) for p in procs]
    finally:  # after a failure: the others are no longer needed
        stop_all(procs, f"producer probes (stage 1, {n} at once)", GROUP_LADDER, group=True, first=Rung.KILL)


def _transport_stage(
    children: CommandChildren, config: Path, n: int, seconds: float, delay_ms: float, shm_dir: str | None
) -> dict[str, Any]:
    """The probe's socket and producer config live in a directory of doctor's (``config``'s), removed with the
    slot files of the probe's consumer once its group is gone: after a SIGKILL too."""
    work = config.parent / f"transport-{n}"
    work.mkdir(mode=0o700)
    shm = resolve_shm_dir(shm_dir, transport_endpoint(work))

    def cleanup(pid: int) -> None:
        shutil.rmtree(work, ignore_errors=True)
        clean_stale(shm, pid)

    proc = children.spawn(
        module_argv(
            "melfeed.consumer.doctor.probe",
            "transport",
            "--config",
            str(config),
            "--producers",
            str(n),
            "--seconds",
            str(seconds),
            "--debug-delay-ms",
            str(delay_ms),
            "--work-dir",
            str(work),
        ),
        env=_probe_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cleanup=cleanup,
    )
    return _finish(children, f"transport (stage 2, {n} producer(s))", proc, seconds + 2 * _PROBE_START_S)


def _resolve(args: argparse.Namespace) -> PipelineConfig:
    check_number(args.seconds_per_stage, "--seconds-per-stage", above=True, ceiling=_MAX_SECONDS_PER_STAGE)
    check_output_file(args.output, "--output")  # before the stages (and the demo cache), not after them
    cfg = config_from_args(args)
    if args.demo:
        from melfeed.shared.cache.demo_data import default_demo_dir, write_demo_cache

        cache = Path(cfg.cache_dir) if cfg.cache_dir and args.cache_dir else default_demo_dir(args.demo_utterances)
        write_demo_cache(cache, n_utterances=args.demo_utterances, extras=True)
        cfg = with_overrides(cfg, {"cache_dir": str(cache)})
    if cfg.cache_dir is None:
        raise ConfigError("is required (--cache-dir, --demo, or cache_dir in the config)", path=("cache_dir",))
    cfg = with_overrides(cfg, {"cache_dir": str(resolve_path(cfg.cache_dir, ("cache_dir",)))})
    return _as_planned(cfg)


def _as_planned(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` with the weights and rows the consumer measured (``cost: measured``, ``batch_size: auto``) from its
    state directory, where it has them: doctor then checks the plan that consumer trains on."""
    from melfeed.consumer.train.measure_cache import planned_settings

    state_dir = cfg.consumer.state_dir
    if state_dir is None or not Path(state_dir).is_dir():
        return cfg
    return dataclasses.replace(cfg, buckets=planned_settings(Path(state_dir), cfg.buckets))


def _padding_alternatives(cfg: PipelineConfig, frames: Any, tokens: Any) -> tuple[tuple[int, float], ...]:
    if cfg.buckets.boundaries is not None:
        return ()
    out = []
    count, key = bucket_count(cfg.buckets), _budget_key(cfg)
    for k in sorted({min(16, count + d) for d in (1, 2, 4)} - {count}):
        alt = (
            dataclasses.replace(cfg.buckets, num_buckets=k)
            if key == "num_buckets"
            else dataclasses.replace(cfg.buckets, max_shapes=k)
        )
        out.append((k, build_buckets(frames, tokens, cfg.n_mels, alt).padding_efficiency()))
    return tuple(out)


def _budget_key(cfg: PipelineConfig) -> str:
    """The key that sets how many shapes a derived plan may use (``shared/wire/grid.py``)."""
    return "num_buckets" if cfg.buckets.num_buckets is not None else "max_shapes"


def _facts(cfg: PipelineConfig, bucket_set: BucketSet, alternatives: tuple[tuple[int, float], ...]) -> ConfigFacts:
    t = cfg.transport
    is_tcp = (t.endpoint or "").startswith("tcp://")
    return ConfigFacts(
        cores=len(os.sched_getaffinity(0)),
        producer_count=cfg.producer.count,
        ring_slots=cfg.consumer.ring_slots,
        lease_window=t.lease_window,
        largest_batch_bytes=bucket_set.max_batch_nbytes(),
        padding=bucket_set.padding_efficiency(),
        num_buckets=bucket_count(cfg.buckets) if cfg.buckets.boundaries is None else None,
        budget_key=f"buckets.{_budget_key(cfg)}",
        token_padding=bucket_set.token_padding_efficiency(),
        padding_alternatives=alternatives,
        checksum=resolve_checksum(t.checksum, t.endpoint or "", t.insecure),
        is_tcp=is_tcp,
    )


def _bad_rows(cfg: PipelineConfig, build_1: dict[str, Any]) -> str | None:
    """A note on the rows stage 1 found in bad files (quarantined, so never read: the rate overstates the cache's).

    Raises:
        CacheError: more of them than ``producer.max_quarantined_fraction`` allows: a run would stop on them
            (exit 65), and the figures would measure a cache that is not there.
    """
    read, bad = int(build_1.get("rows_read", 0)), int(build_1.get("rows_quarantined", 0))
    if not bad:
        return None
    cap = cfg.producer.max_quarantined_fraction
    what = (
        f"{bad} of the {read} rows stage 1 read are in bad cache files (e.g. {build_1.get('quarantine_note')}); "
        f"`melfeed verify-cache --cache-dir {cfg.cache_dir}` lists them"
    )
    if cap < 1.0 and bad > cap * read:
        raise CacheError(
            cfg.cache_dir,
            f"{what}: more than producer.max_quarantined_fraction ({cap:.0%}) allows, so "
            "a run would stop on them (exit 65) and no figure here would be the cache's",
        )
    return f"{what}; they were quarantined, not read, so the build rate is that much too high"


def _measure(
    children: CommandChildren,
    config: Path,
    n: int,
    seconds: float,
    delay_ms: float,
    progress: Progress,
    shm_dir: str | None,
    cfg: PipelineConfig,
) -> dict[str, Any]:
    """Run the five probe rounds in order, one progress step each; a cache too bad to measure stops it after
    stage 1 (``_bad_rows``)."""
    stages: dict[str, Any] = {}
    steps: list[tuple[str, str, Callable[[], Any]]] = [
        (
            "build_1",
            f"stage 1/4: cache read + assembly, 1 producer process ({seconds:g} s)",
            lambda: _build_stage(children, config, 1, seconds, delay_ms),
        ),
        (
            "build_n",
            f"stage 1/4: cache read + assembly, {n} producer processes at once ({seconds:g} s)",
            lambda: _build_stage(children, config, n, seconds, delay_ms),
        ),
        (
            "transport_1",
            f"stage 2/4: transport, 1 producer -> consumer ({seconds:g} s after the first batch)",
            lambda: _transport_stage(children, config, 1, seconds, delay_ms, shm_dir),
        ),
        (
            "transport_n",
            f"stage 2/4: transport, {n} producers -> consumer ({seconds:g} s)",
            lambda: _transport_stage(children, config, n, seconds, delay_ms, shm_dir),
        ),
        (
            "device",
            "stages 3+4/4: host->device hand-off and the compiled step per bucket (compiles first)",
            lambda: _finish(
                children,
                "device (stages 3-4)",
                _spawn(
                    children,
                    "melfeed.consumer.doctor.probe",
                    "device",
                    "--config",
                    str(config),
                    "--seconds",
                    str(seconds),
                ),
                seconds + 3 * _PROBE_START_S,
            ),
        ),
    ]
    for done, (key, text, fn) in enumerate(steps):
        if n == 1 and key.endswith("_n"):  # N = 1: the same measurement again would say nothing new
            stages[key] = stages[key[:-2] + "_1"]
        else:
            progress.note(f"doctor: {text}")
            stages[key] = fn()
        if key == "build_1":
            stages["bad_rows_note"] = _bad_rows(cfg, stages[key][0])
        progress.update(done + 1, 0)
    progress.finish()
    return stages


def _measurements(stages: dict[str, Any], n: int, mix: list[float]) -> Measurements:
    one = stages["build_1"][0]
    dev = stages["device"]["buckets"]
    return Measurements(
        producers=n,
        build_ms_p50=one["build_ms_p50"],
        read_ms_p50=one["read_ms_p50"],
        build_rate_1=one["batches_per_s"],
        build_rate_n=sum(p["batches_per_s"] for p in stages["build_n"]),
        delivered_1=stages["transport_1"]["batches_per_s"],
        delivered_n=stages["transport_n"]["batches_per_s"],
        h2d_ms=tuple(b["h2d_ms_p50"] for b in dev),
        step_ms=tuple(b["step_ms_p50"] for b in dev),
        mix=tuple(mix),
    )


def main_doctor(args: argparse.Namespace) -> int:
    cfg = _resolve(args)
    n = cfg.producer.count
    manifest = load_manifest_for(cfg)
    bucket_set = build_buckets(
        manifest.frames,
        manifest.token_counts,
        cfg.n_mels,
        cfg.buckets,
        manifest.schema,
        mel_dtype=cfg.transport.mel_dtype,
    )
    mix = batch_mix(bucket_set)
    facts = _facts(cfg, bucket_set, _padding_alternatives(cfg, manifest.frames, manifest.token_counts))
    largest = bucket_set.max_batch_nbytes()
    env_facts = gather_facts(
        cfg.consumer.model_gpu,
        cfg.producer.data_gpu,
        resolve_runtime_dir(os.environ),
        cfg.consumer.ring_slots * largest,
        memory_bound_bytes(cfg.consumer.ring_slots, n, cfg.transport.lease_window, largest),
        os.environ,
    )
    remove_dead_temp_dirs("doctor")  # a doctor killed with SIGKILL left its directory
    progress = Progress(_STAGES, sys.stderr, interval_s=10.0, label="doctor", unit="stages", count_skipped=False)
    try:  # the probes stop before their directory goes
        with (
            tempfile.TemporaryDirectory(prefix=temp_dir_prefix("doctor")) as tmp,
            handed_over_config(config_to_mapping(cfg), "doctor.yaml", Path(tmp)) as config,
            CommandChildren("doctor probes") as children,
        ):
            stages = _measure(
                children, config, n, args.seconds_per_stage, args.debug_delay_ms, progress, cfg.transport.shm_dir, cfg
            )
    except ProbeFailed as err:
        print(f"melfeed doctor: {err}", file=sys.stderr)
        return err.exit_code
    except Interrupted as stop:
        progress.note(f"melfeed doctor: {stop}: its probes were stopped, no report written")  # ends a bar
        return 128 + stop.signum
    verdict = decide(_measurements(stages, n, mix), facts)
    advice = advise_data_gpu(
        cfg.consumer.model_gpu,
        cfg.producer.data_gpu,
        env_facts.consumer_gpus,
        env_facts.producer_gpus,
        verdict.supply_per_s,
        verdict.demand_per_s,
        verdict.bound,
    )
    bad_rows = [note] if (note := stages.pop("bad_rows_note", None)) else []
    verdict = dataclasses.replace(
        verdict, changes=[*verdict.changes, *advice.changes], notes=[*bad_rows, *verdict.notes, *advice.notes]
    )
    checks = check_environment(env_facts)
    report = {
        "cache_dir": cfg.cache_dir,
        "memory_bound_now_bytes": env_facts.in_flight_bytes,
        "utterances": len(manifest.frames),
        "producers": n,
        "cores": facts.cores,
        "buckets": [b.as_wire() for b in bucket_set.buckets],
        "mix": mix,
        "padding": bucket_padding(bucket_set, manifest.frames),
        "grid": bucket_grid(bucket_set, manifest.frames),
        "outliers": bucket_set.outliers,
        "stages": stages,
        "config_facts": dataclasses.asdict(facts),
        "verdict": dataclasses.asdict(verdict),
        "environment": [dataclasses.asdict(c) for c in checks],
        "exit_code": verdict.exit_code,
    }
    print(json.dumps(report, indent=2) if args.json else render(report, verdict, checks))
    if args.output:
        try:
            write_output(args.output, json.dumps(report, indent=2) + "\n", what="--output")  # refusals: exit 78
        except OSError as err:  # checked before the stages; a full disk is still one line
            print(f"melfeed doctor: {args.output}: cannot write: {err.strerror or err}", file=sys.stderr)
            return 1
    return verdict.exit_code
