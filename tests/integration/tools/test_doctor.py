"""``melfeed doctor`` end to end: real probes, real producers, real consumer ring, real TensorFlow.

Slowed producers (``--debug-delay-ms``) must give the data-bound verdict (exit 3) naming the producers;
a slow step (``tests.steps:slow_step``) with fast producers must give exit 0 naming the step. A doctor
stopped (SIGTERM) or killed (SIGKILL) while its transport probe runs leaves no probe or producer behind, and no
slot file; SIGTERM leaves no temporary directory either (SIGKILL: the next doctor's sweep removes it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from melfeed.shared.service.leftovers import remove_dead_temp_dirs
from tests import procs
from tests.conftest import REPO


def _doctor_argv(tmp_path: Path, cache: Path, step: str, *extra: str) -> list[str]:
    cfg = tmp_path / "doctor.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(cache),
                "buckets": {"num_buckets": 2, "batch_size": 8},
                # graph mode: the verdict, not the compile mode, is the subject (auto would also compile with XLA)
                "model": {"step": step, "jit_compile": False},
            }
        )
    )
    return [sys.executable, "-m", "melfeed", "doctor", "--config", str(cfg), "--seconds-per-stage", "1", *extra]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}


def _doctor(
    tmp_path: Path, cache: Path, step: str, *extra: str, timeout_s: float = 110
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _doctor_argv(tmp_path, cache, step, *extra),
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_slowed_producers_are_named_as_the_bottleneck_and_exit_3(demo_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    proc = _doctor(
        tmp_path, demo_cache, "tests.steps:tiny_step", "--producers", "1", "--debug-delay-ms", "200", "-o", str(out)
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    assert "bound by producers (cache read / assembly)" in proc.stdout
    assert (
        f"reads the packed cache {demo_cache / 'melfeed-float32.pack'}, mapped)" in proc.stdout
    )  # the demo comes packed
    report = json.loads(out.read_text())
    v = report["verdict"]
    assert v["supply_per_s"] < 1.2 * v["demand_per_s"]
    assert report["stages"]["build_1"][0]["build_ms_p50"] >= 200  # the delay is inside the build
    assert v["producers_needed"] > 1
    assert "producer.count: 1 -> " in proc.stdout  # more producers recommended
    assert any(c["key"] == "producer.count" and int(c["new"]) > 1 for c in v["changes"])
    assert "doctor: stage 1/4" in proc.stderr  # progress per stage
    assert "Traceback" not in proc.stderr


def test_slow_step_with_fast_producers_names_the_step_and_exits_0(demo_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    proc = _doctor(tmp_path, demo_cache, "tests.steps:slow_step", "--producers", "2", "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "bound by the training step (the GPU is the bottleneck; data keeps up)" in proc.stdout
    report = json.loads(out.read_text())
    v = report["verdict"]
    assert v["exit_code"] == 0 and v["supply_per_s"] >= 1.2 * v["demand_per_s"] > 0
    stages = report["stages"]
    assert len(stages["build_n"]) == 2 and stages["transport_n"]["producers_alive"] == 2
    assert [b["index"] for b in stages["device"]["buckets"]] == [0, 1]
    assert stages["device"]["compiles_after_ready"] == 0
    assert stages["device"]["device"] in proc.stdout  # says which device (CPU here)
    assert {c["name"] for c in report["environment"]} >= {"model vs data GPU", "memory", "socket directory"}
    assert "bucket  T frames  L tokens  rows" in proc.stdout and "in-flight bound" in proc.stdout
    assert [r["frames"] for r in report["grid"]] == [b[2] for b in report["buckets"]]


def test_config_errors_are_one_line_and_exit_78(demo_cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("consumer:\n  ring_slots: 1\n")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed", "doctor", "--config", str(bad), "--cache-dir", str(demo_cache)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 78
    assert proc.stderr.strip().splitlines()[-1] == "melfeed doctor: consumer.ring_slots: must be in 3..256, got 1"
    proc = _doctor(tmp_path, tmp_path / "nocache", "tests.steps:tiny_step", timeout_s=60)
    assert proc.returncode == 78 and "nocache" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--seconds-per-stage", "nan"), "--seconds-per-stage: must be a finite number > 0, got nan"),
        (("--seconds-per-stage", "-1"), "--seconds-per-stage: must be a finite number > 0, got -1.0"),
        (("--seconds-per-stage", "1e300"), "--seconds-per-stage: must be <= 3600, got 1e+300"),
        (
            ("--debug-delay-ms", "nan"),
            "argument --debug-delay-ms: must be a finite number >= 0, got 'nan' (see --help)",
        ),
        (("-o", "{tmp}"), "--output: is a directory; name a file to write, got '{tmp}'"),
        (
            ("-o", "{tmp}/missing/doctor.json"),
            "--output: directory {tmp}/missing does not exist, got '{tmp}/missing/doctor.json'",
        ),
    ],
)
def test_bad_flags_are_refused_before_any_stage(
    demo_cache: Path, tmp_path: Path, extra: tuple[str, ...], needle: str
) -> None:
    extra = tuple(e.format(tmp=tmp_path) for e in extra)
    proc = _doctor(tmp_path, demo_cache, "tests.steps:tiny_step", *extra, timeout_s=60)  # last flag wins
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"melfeed doctor: {needle.format(tmp=tmp_path)}"]
    assert "stage" not in proc.stdout


def _stop_doctor_and_check(
    tmp_path: Path, doctor: subprocess.Popen[str], levels: int, sig: int, bound_s: float
) -> None:
    """Signal ``doctor`` once ``levels`` generations of descendants run; all must be gone within ``bound_s``."""
    family: list[procs.Tracked] = []
    try:
        deadline = time.monotonic() + procs.WAIT_S
        while time.monotonic() < deadline and doctor.poll() is None and len(family) < levels:
            family = procs.descendants(doctor.pid)
            time.sleep(0.05)
        assert len(family) >= levels, f"probes not seen: {family}, doctor exit {doctor.poll()}"
        pids = [p.pid for p in family]
        assert procs.temp_dirs("doctor", doctor.pid)
        doctor.send_signal(sig)
        out, err = doctor.communicate(timeout=procs.WAIT_S)
        left = procs.wait_gone(family, bound_s)
        assert not left, "doctor's probes outlived it:\n" + "\n".join(procs.describe(p) for p in left)
        assert procs.slot_files(pids) == []  # a transport probe's consumer: unlinked as SIGTERM unwound it
        left_dirs = procs.temp_dirs("doctor", doctor.pid)  # its config, a transport probe's socket dir
        assert (left_dirs == []) == (sig == signal.SIGTERM)
        if sig == signal.SIGKILL:  # what the next doctor does first
            assert set(left_dirs) <= {p.name for p in remove_dead_temp_dirs("doctor")}
        if sig == signal.SIGTERM:
            assert doctor.returncode == 128 + signal.SIGTERM, err[-2000:]
            assert err.strip().splitlines()[-1] == (
                "melfeed doctor: stopped by SIGTERM: its probes were stopped, no report written"
            )
            assert "Traceback" not in err and not (tmp_path / "doctor.json").exists() and "verdict" not in out
    finally:
        if doctor.poll() is None:
            doctor.kill()
        procs.kill_running(family)


def _start_doctor(tmp_path: Path, cache: Path, seconds_per_stage: str) -> subprocess.Popen[str]:
    # --debug-delay-ms: every batch takes >= 10 ms, so a probe runs its whole --seconds-per-stage (not
    # melfeed.producer.probe's cap of 100000 batches, which a fast cache reaches in seconds).
    return subprocess.Popen(
        _doctor_argv(
            tmp_path,
            cache,
            "tests.steps:tiny_step",
            "--producers",
            "1",
            "--seconds-per-stage",
            seconds_per_stage,
            "--debug-delay-ms",
            "10",
            "-o",
            str(tmp_path / "doctor.json"),
        ),
        cwd=REPO,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_doctor_stopped_while_its_probe_runs_leaves_no_probe_behind(
    demo_cache: Path, tmp_path: Path, sig: int
) -> None:
    """SIGTERM: doctor stops its probe's group and exits 143 in one line, no report; SIGKILL: the probe notices on
    its own (die_with_named_parent). Stage 1's probe builds for 600 s: it cannot end by itself within the bound."""
    _stop_doctor_and_check(tmp_path, _start_doctor(tmp_path, demo_cache, "600"), 1, sig, procs.WAIT_S)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_doctor_stopped_mid_transport_stage_leaves_no_probe_or_producer_behind(
    demo_cache: Path, tmp_path: Path, sig: int
) -> None:
    """Stage 2's family, signalled once its producer is forked: the transport probe, the producer group it started,
    and a producer. SIGKILL: the probe dies with doctor and the group with the probe (it names itself as their
    parent). Slow: stage 1 takes the 30 s first; the probe would measure 30 s after its first batch, longer than
    the 20 s bound (> the group's own ladder)."""
    _stop_doctor_and_check(tmp_path, _start_doctor(tmp_path, demo_cache, "30"), 3, sig, 20.0)
