"""Several model replicas (tf.distribute.MirroredStrategy) on logical CPU devices: the same arithmetic as
one replica on the whole batch, exact checkpoints, and `run --replicas 2` end to end with an exact audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests import procs
from tests.conftest import REPO


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_two_replicas_match_one_on_the_whole_batch_and_resume_bit_identically(tmp_path: Path) -> None:
    out = tmp_path / "replicas.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.replica_check", str(out)],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert r["mirrored"] == r["variables"] > 0  # every variable has a copy per replica
    assert r["traces_2"] == 1  # one program per bucket, not one per replica
    # the loss each replica returns is its share of the whole batch's (global valid frames): they sum to it
    for one, two in zip(r["losses_1"], r["losses_2"], strict=True):
        assert abs(one - two) <= 1e-5 * abs(one), (r["losses_1"], r["losses_2"])
    assert r["losses_2"][-1] < r["losses_2"][0]
    assert r["max_abs_var_diff_1_vs_2"] <= 1e-5 * max(1.0, r["max_abs_var_1"]) * 10, r  # summed gradients
    assert r["resumed_bit_identical"] and r["replica_copies_equal"], r
    assert r["losses_resumed"] == r["losses_2"][2:]
    f16 = r["float16"]  # transport.mel_dtype: float16, split and cast on each replica
    assert f16["bit_identical"] and f16["copies"] == 0 and f16["losses"][0] > 0, f16
    assert r["jit_true_error"] == (
        "model.step tiny: XLA cannot compile the step (jit_compile: true): XlaUnavailable: "
        "XLA cannot compile a mirrored step on logical CPU devices: TensorFlow's "
        "MirroredStrategy updates every replica's variables from one program there"
    )


def test_run_with_two_replicas_trains_on_two_devices_and_the_audit_is_exact(demo_cache: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "buckets": {"num_buckets": 1, "batch_size": 16},
                "model": {"step": "tests.steps:replica_tiny_step", "jit_compile": "auto", "learning_rate": 0.05},
                "consumer": {"warmup_steps": 2, "feed_efficiency_steps": 0},
                "transport": {"heartbeat_interval_s": 0.2},
            }
        )
    )
    state, summary = tmp_path / "state", tmp_path / "summary.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "run",
            "--config",
            str(cfg),
            "--cache-dir",
            str(demo_cache),
            "--producers",
            "1",
            "--steps",
            "24",
            "--replicas",
            "2",
            "--state-dir",
            str(state),
            "--summary-json",
            str(summary),
        ],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["replicas"] == 2 and s["devices"] == ["/device:CPU:0", "/device:CPU:1"], s
    # XLA cannot compile a mirrored step on logical CPU devices: auto says so and trains in graph mode
    assert s["jit_compile"] == "graph" and "logical CPU devices" in s["jit_reason"], s["jit_reason"]
    assert s["steps"] == s["batches_applied"] == 24 and s["compiles_after_ready"] == 0
    assert s["final_loss"] < 0.85 * s["first_loss"], (s["first_loss"], s["final_loss"])
    code, audit, text = procs.run_audit(state, tmp_path)
    assert code == 0 and audit["applied"] == 24, text


def test_rows_that_do_not_divide_by_the_replicas_are_one_line_and_exit_78(demo_cache: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "run",
            "--cache-dir",
            str(demo_cache),
            "--batch-size",
            "16",
            "--replicas",
            "3",
        ],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "melfeed run: buckets.batch_size: must divide by the 3 model replicas (consumer.replicas, "
        "consumer.model_gpu): each replica takes an equal share of every batch's rows, got 16"
    )
