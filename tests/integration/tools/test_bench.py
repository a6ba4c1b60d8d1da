"""``melfeed bench --smoke`` end to end: real trials, checked for structure, never for speed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from melfeed.shared.config import TransportConfig
from melfeed.shared.service.leftovers import remove_dead_temp_dirs
from tests import procs

REPO = Path(__file__).resolve().parents[3]
HAS_MODE = "mode" in TransportConfig.__dataclass_fields__


def _bench(tmp_path: Path, *flags: str, timeout_s: float = 400) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(
        [sys.executable, "-m", "melfeed", "bench", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_report(doc: dict[str, Any], systems: list[str], max_rate_only: tuple[str, ...] = ()) -> None:
    meds, ratios, base = doc["medians"], doc["ratios"], doc["baseline"]
    assert base == "tfdata-npc8"
    for system in [*systems, *max_rate_only]:
        for step in ("0",) if system in max_rate_only else ("0", "5"):
            figs = meds[system][step]
            for metric in (
                "batches_per_s",
                "trainer_cpu_ms_per_batch",
                "total_cpu_ms_per_batch",
                "trainer_rss_mb",
                "total_rss_mb",
                "payload_copies",
            ):
                assert _positive(figs[metric]), (system, step, metric, figs[metric])
            assert figs["total_cpu_ms_per_batch"] >= figs["trainer_cpu_ms_per_batch"]
            assert figs["total_rss_mb"] >= figs["trainer_rss_mb"]
            assert 0 <= figs["stall_pct"] <= 100
            for metric, value in ratios[system][step].items():
                expected = figs[metric] / meds[base][step][metric] if meds[base][step][metric] else None
                assert value == pytest.approx(expected), (system, step, metric)
    trial_systems = {t["system"] for t in doc["trials"]}
    assert trial_systems == set(systems) | set(max_rate_only)
    assert len(doc["trials"]) == 2 * len(systems) + len(max_rate_only) and all(t["ok"] for t in doc["trials"])
    assert meds["melfeed-zmq-p1"]["0"]["payload_copies"] >= 1
    lines = [g["line"] for g in doc["goals"]]
    assert any(line.startswith(("PASS", "FAIL")) and "max rate" in line for line in lines)
    assert doc["device_model"] and doc["copies_counted"]


@pytest.mark.timeout(400)
def test_bench_smoke_reports_every_system_with_consistent_numbers(demo_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _bench(tmp_path, "--smoke", "--cache-dir", str(demo_cache), "--service-workers", "0", "-o", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    systems = ["melfeed-zmq-p1", "tfdata-npc8", "naive"] + (["melfeed-shm-p1"] if HAS_MODE else [])
    _check_report(doc, systems, max_rate_only=("melfeed-tcp-p1",))  # the payload path on tcp under CURVE
    tcp = next(t for t in doc["trials"] if t["system"] == "melfeed-tcp-p1")
    assert tcp["endpoint"].startswith("tcp://127.0.0.1:") and tcp["curve"] is True and tcp["checksum"] is False
    assert "max rate >= 1.5 x tfdata-npc8 [melfeed-tcp-p1]" in proc.stdout
    assert "transport-tcp" not in proc.stdout  # not in the transport section
    if not HAS_MODE:
        assert "not available in this build" in doc["unavailable"]["melfeed-shm-p1"]
        assert "melfeed-shm-p1: not available in this build" in proc.stdout
    probe = doc["transport_medians"]["transport-zmq-p1"]["0"]
    assert _positive(probe["gb_per_s"]) and _positive(probe["memcpy_gb_per_s"])
    assert "goals (medians of this run):" in proc.stdout and "transport-zmq-p1" in proc.stdout
    assert _positive(doc["build_medians"]["cpu_ms_per_batch"])  # doctor's stage 1, once per round
    for key in ("build_medians_preadv", "build_medians_npy"):  # the packed demo: the pack read, the files
        assert _positive(doc[key]["cpu_ms_per_batch"]), key
    read = {(b["system"], b.get("reader", "").endswith(".pack"), b.get("pack_read")) for b in doc["build_trials"]}
    assert {
        ("producer-build", True, "mapped"),
        ("producer-build-preadv", True, "preadv"),
        ("producer-build-npy", False, None),
    } <= read, read
    assert "float32, pack read with preadv (-preadv)" in proc.stdout
    assert "producer build CPU/batch <= 1.3 ms [producer-build]" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_smoke_with_tf_data_service(demo_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _bench(
        tmp_path, "--smoke", "--cache-dir", str(demo_cache), "--no-transport", "--transports", "zmq,shm", "-o", str(out)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    systems = ["melfeed-zmq-p1", "tfdata-npc8", "naive", "tfdata-service-w1"] + (["melfeed-shm-p1"] if HAS_MODE else [])
    _check_report(doc, systems)
    assert doc["medians"]["tfdata-service-w1"]["0"]["payload_copies"] == 7


def test_a_cache_without_one_full_batch_is_refused_before_any_trial(tmp_path: Path) -> None:
    from melfeed.shared.cache.demo_data import write_demo_cache

    write_demo_cache(tmp_path / "tiny", n_utterances=20)  # batch_size 32: no full batch in any bucket
    proc = _bench(tmp_path, "--smoke", "--cache-dir", str(tmp_path / "tiny"), timeout_s=60)
    assert proc.returncode == 78, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"melfeed bench: cache_dir: {tmp_path / 'tiny'} has 20 utterances, not one "
        "full batch in any bucket (rows per batch: 32); bench compares full batches: use "
        "a larger cache (or bench --demo) or a smaller buckets.batch_size"
    )


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--producer-counts", "two"], "--producer-counts: must be a comma-separated list of integers >= 1"),
        (["--transports", "udp"], "--transports: must be a comma-separated subset of zmq,shm,tcp"),
        (["--step-ms", "0"], "--step-ms: must be a comma-separated list of integers >= 1"),
        (["--smoke", "--producer-counts", "two"], "--producer-counts: must be a comma-separated list of integers >= 1"),
    ],
)
def test_bench_bad_flags_give_one_line_and_exit_78(
    demo_cache: Path, tmp_path: Path, flags: list[str], needle: str
) -> None:
    proc = _bench(tmp_path, "--cache-dir", str(demo_cache), *flags, timeout_s=60)
    assert proc.returncode == 78
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bench_without_cache_names_the_key(tmp_path: Path) -> None:
    proc = _bench(tmp_path, "--cache-dir", str(tmp_path / "missing"), timeout_s=60)
    assert proc.returncode == 78
    assert str(tmp_path / "missing") in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_feed_efficiency_of_the_reference_model_for_melfeed_and_tuned_tf_data(
    demo_cache: Path, tmp_path: Path
) -> None:
    cfg = tmp_path / "two-buckets.yaml"  # two buckets: the reference model compiles twice, not four times
    cfg.write_text("buckets: {num_buckets: 2, batch_size: 16}\n", encoding="utf-8")
    out = tmp_path / "bench.json"
    proc = _bench(
        tmp_path,
        "--efficiency-only",
        "--efficiency-batches",
        "100",
        "--rounds",
        "1",
        "--warmup",
        "2",
        "--transports",
        "zmq",
        "--producer-counts",
        "1",
        "--tfdata-parallel",
        "8",
        "--service-workers",
        "0",
        "--config",
        str(cfg),
        "--cache-dir",
        str(demo_cache),
        "-o",
        str(out),
        timeout_s=880,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = json.loads(out.read_text())["feed_efficiency"]
    assert {t["system"] for t in section["trials"]} == {"melfeed-zmq-p1", "tfdata-npc8"}
    for system in ("melfeed-zmq-p1", "tfdata-npc8"):
        figs = section["medians"][system]["0"]
        # Structure, not speed (as above): 100 batches (the fewest the figure is reported after) on a loaded machine
        # can land above 1.
        assert _positive(figs["feed_efficiency"]) and _positive(figs["resident_steps_per_s"]), (system, figs)
        assert figs["fed_steps_per_s"] == pytest.approx(figs["feed_efficiency"] * figs["resident_steps_per_s"])
        assert 0 < figs["useful_work"] <= figs["feed_efficiency"], (system, figs)  # x padding efficiency (<= 1)
    lines = [g["line"] for g in section["goals"]]
    assert len(lines) == 2 and all(line.startswith(("PASS", "FAIL")) for line in lines)
    assert "feed efficiency >= 0.95 (step on the CPU)" in proc.stdout and "resident steps/s" in proc.stdout
    assert "useful work" in proc.stdout


@pytest.mark.timeout(400)
# SIGKILL is slow-marked: once, on a loaded machine, two of the three descendants outlived a SIGKILLed bench by
# 90 s. Not reproduced since (10/10 beside other integration tests, 42 runs of the same kill under CPU load, 150 of
# the trial -> group -> producer chain); a failure now names each survivor's state and signal masks (describe).
@pytest.mark.parametrize(
    "sig",
    [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGKILL, marks=pytest.mark.slow, id="SIGKILL")],
)
def test_a_bench_stopped_mid_trial_leaves_no_child_behind(demo_cache: Path, tmp_path: Path, sig: int) -> None:
    """SIGTERM: bench stops its trial's group and exits 143 in one line; SIGKILL: the trial and its producers
    notice on their own (die_with_parent). Either way no trial, producer or helper lives on with parent 1, and
    the trial's slot files are gone (its consumer closed as SIGTERM unwound it, or bench removed them). SIGTERM:
    bench's directory (the trial's runtime dir) is gone too; SIGKILL leaves it to the next bench's sweep."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    # A trial of a million batches: it cannot end by itself within the waits below, only be stopped.
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "melfeed",
            "bench",
            "--cache-dir",
            str(demo_cache),
            "--rounds",
            "1",
            "--step-ms",
            "5",
            "--producer-counts",
            "1",
            "--tfdata-parallel",
            "8",
            "--batches",
            "1000000",
            "--warmup",
            "3",
            "--mel-dtypes",
            "float32",
            "--transports",
            "shm",
            "--no-transport",
            "--service-workers",
            "0",
            "--efficiency-batches",
            "0",
            "-o",
            str(tmp_path / "bench.json"),
        ],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    family: list[procs.Tracked] = []
    try:
        deadline = time.monotonic() + 300  # the first trial (melfeed-zmq-p1) imports TensorFlow, compiles
        while time.monotonic() < deadline and bench.poll() is None and len(family) < 3:
            family = procs.descendants(bench.pid)  # the trial, its producer group and a producer: mid-trial
            time.sleep(0.05)
        assert len(family) >= 3, f"no trial with producers seen: {family}, bench exit {bench.poll()}"
        pids = [p.pid for p in family]
        assert procs.slot_files(pids) and procs.temp_dirs("bench", bench.pid)  # made before its producers start
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=120)
        left = procs.wait_gone(family, 90)  # > the stop ladder's SIGTERM wait; << the trial's own length
        assert not left, "bench's children outlived it:\n" + "\n".join(procs.describe(p) for p in left)
        assert procs.slot_files(pids) == []
        assert (procs.temp_dirs("bench", bench.pid) == []) == (sig == signal.SIGTERM)
        if sig == signal.SIGKILL:  # what the next bench does first
            left_dirs = procs.temp_dirs("bench", bench.pid)
            assert set(left_dirs) <= {p.name for p in remove_dead_temp_dirs("bench")}
        if sig == signal.SIGTERM:
            assert bench.returncode == 128 + signal.SIGTERM, err[-2000:]
            assert err.strip().splitlines()[-1] == (
                "melfeed bench: stopped by SIGTERM: its trials were stopped, no report written"
            )
            assert "Traceback" not in err and not (tmp_path / "bench.json").exists()
    finally:
        if bench.poll() is None:
            bench.kill()
        procs.kill_running(family)
