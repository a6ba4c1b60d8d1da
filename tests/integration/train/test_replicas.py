"""Several model replicas (tf.distribute.MirroredStrategy) on logical CPU devices: the same arithmetic as
one replica on the whole batch, exact checkpoints, the loop's hand-off feeding each replica its rows on its own
device, no step reading a reused slot, and `run --replicas 2` end to end with an exact audit.

Every check that needs a CPU split into logical devices runs in one interpreter (tests/replica_check.py: one
TensorFlow start), fed by one producer group; each test asserts on its share of the figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from tests import procs
from tests.conftest import REPO

_POISON_STEPS = 40
_ONE, _TWO = "/job:localhost/replica:0/task:0/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:2"
# The interpreter builds the reference step 6 times and trains 3 runs: its own bound, and the first test to ask
# for its figures waits for it (a loaded 2-core machine).
_CHECK_TIMEOUT_S = 540


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}


class _Checks(NamedTuple):
    proc: subprocess.CompletedProcess[str]
    figures: dict[str, Any]

    def of(self, part: str) -> Any:
        """The figures of one part; a part the interpreter did not finish fails with its stderr."""
        assert part in self.figures, f"exit {self.proc.returncode}: {self.proc.stderr[-3000:]}"
        return self.figures[part]


@pytest.fixture(scope="module")
def replica_checks(demo_cache: Path) -> Iterator[_Checks]:
    """tests/replica_check.py once: the arithmetic, the fed path, and the loop on 2 replicas clean, with every
    released slot overwritten, and overwritten with slots released before their steps (MODEs ``clean``,
    ``poisoned``, ``early``, each on its own state directory, one producer group serving the three)."""
    tmp = Path(tempfile.mkdtemp(prefix="mf-", dir="/tmp"))  # short: XDG_RUNTIME_DIR holds the run's sockets
    try:
        configs = {
            name: procs.write_config(
                tmp / f"{name}.yaml",
                demo_cache,
                f"ipc://{tmp}/r.sock",
                tmp / name,
                _POISON_STEPS,
                producer={"count": 2},
                consumer={"replicas": 2, "feed_efficiency_steps": 0},
                buckets={"num_buckets": 1, "batch_size": 16},
                model={"step": "tests.steps:replica_tiny_step"},
            )
            for name in ("clean", "poisoned", "early")
        }
        out = tmp / "replicas.json"
        producers = procs.start("producer", configs["clean"], tmp / "producers.log")
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tests.replica_check",
                    str(out),
                    *(arg for name, config in configs.items() for arg in (name, str(config))),
                ],
                cwd=REPO,
                env=_env(tmp),
                capture_output=True,
                text=True,
                timeout=_CHECK_TIMEOUT_S,
            )
        finally:
            procs.stop(producers)
        yield _Checks(proc, json.loads(out.read_text()) if out.exists() else {})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(600)  # may start the interpreter of replica_checks
def test_two_replicas_match_one_on_the_whole_batch_and_resume_bit_identically(replica_checks: _Checks) -> None:
    r = replica_checks.of("arithmetic")
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


@pytest.mark.timeout(600)  # may start the interpreter of replica_checks
def test_each_replica_gets_its_rows_on_its_device_and_the_outputs_are_summed_there(replica_checks: _Checks) -> None:
    r = replica_checks.of("feed")
    assert r["piece_devices"] == [[_ONE, _TWO]] * 4  # mel, mel_len, tokens, tok_len: own devices
    # the mel and tokens pieces alias the slot; a replica's share of a length array that starts off a 64-byte
    # boundary (4 rows of int32) is a small host copy: 2 per batch here
    assert r["aliases_slot"] == [[True, True], [True, False], [True, True], [True, False]], r["aliases_slot"]
    assert r["host_copies"] == 2 * 3 and r["transfers"] == 8 * 3
    assert r["accumulator_device"] == _ONE
    # nothing of the program is placed on the host's CPU:0: the sums go to the first replica's device
    assert r["explicit_devices"] == [_ONE, _TWO] and _ONE in r["reduce_devices"], r
    assert r["bit_identical"] and r["variables"] > 0  # the same training as the full-batch path
    assert r["fed_losses_sum"] == r["ref_losses_sum"] > 0


@pytest.mark.timeout(600)  # may start the interpreter of replica_checks
def test_with_two_replicas_overwritten_slots_change_nothing_unless_released_before_the_step(
    replica_checks: _Checks,
) -> None:
    """The two-replica form of tests/integration/train/test_staging.py: every released slot is overwritten with
    garbage at once and the run still ends bit-identical to a clean one; slots released before their steps do
    change the variables (the hook bites on replicas too)."""
    runs = replica_checks.of("runs")
    assert list(runs) == ["clean", "poisoned", "early"], runs
    assert runs["clean"]["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert runs["poisoned"]["steps"] == _POISON_STEPS and runs["poisoned"]["overwritten"] >= _POISON_STEPS
    clean, poisoned, early = (runs[name]["variables"] for name in ("clean", "poisoned", "early"))
    assert int.from_bytes(bytes.fromhex(clean["iterations"]), "little") == _POISON_STEPS
    assert clean == poisoned
    assert clean["w"] != early["w"]  # the hook bites on replicas too


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
