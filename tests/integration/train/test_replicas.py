"""Several model replicas (tf.distribute.MirroredStrategy) on logical CPU devices: the same arithmetic as
one replica on the whole batch, exact checkpoints, the loop's hand-off feeding each replica its rows on its own
device, and `run --replicas 2` end to end with an exact audit. And no step ever reads a reused slot, on one
replica or two: every released slot is overwritten with garbage at once, and the run still ends bit-identical to
a clean one.

Every check that needs a CPU split into logical devices, and the slot-poison runs, run in one interpreter
(tests/replica_check.py: one TensorFlow start), fed by one producer group; each test asserts on its share of the
figures. The slot-poison runs: the built-in loop (``train``: the ``Stager`` with the TensorFlow hand-off) fed by
real producer processes over shared-memory slots; the tiny step's variables depend on every byte of every batch
and on their order (momentum). The hook (``tests/slot_poison.py``) writes ``0x7F`` over the whole slot inside
``BatchRing.release``, before the slot can be leased again, so a step that still read a released slot would
train on huge values. The control run proves the hook bites: a hand-off that claims its copy is done at once
(``Staged.copied``), so the stager frees the slot before the step that reads it (the ordering bug this guards
against), ends with other variables.
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
_MODES = ("clean", "poisoned", "early")
_ONE, _TWO = "/job:localhost/replica:0/task:0/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:2"
# The interpreter builds the reference step 6 times and trains 3 runs: its own bound, and the first test to ask
# for its figures waits for it (a loaded 2-core machine).
_CHECK_TIMEOUT_S = 540


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}


class _Checks(NamedTuple):
    proc: subprocess.CompletedProcess[str]
    figures: dict[str, Any]
    tmp: Path  # the runs' state directories: tmp/<run>

    def of(self, part: str) -> Any:
        """The figures of one part; a part the interpreter did not finish fails with its stderr."""
        assert part in self.figures, f"exit {self.proc.returncode}: {self.proc.stderr[-3000:]}"
        return self.figures[part]


@pytest.fixture(scope="module")
def replica_checks(demo_cache: Path) -> Iterator[_Checks]:
    """tests/replica_check.py once: the arithmetic, the fed path, and the loop on one replica (runs ``one-*``) and
    on two (``two-*``), each clean, with every released slot overwritten, and overwritten with slots released
    before their steps (MODEs ``clean``, ``poisoned``, ``early``), each on its own state directory, one producer
    group serving the six."""
    tmp = Path(tempfile.mkdtemp(prefix="mf-", dir="/tmp"))  # short: XDG_RUNTIME_DIR holds the run's sockets
    try:
        configs = {
            (mode, f"{name}-{mode}"): procs.write_config(
                tmp / f"{name}-{mode}.yaml",
                demo_cache,
                f"ipc://{tmp}/r.sock",
                tmp / f"{name}-{mode}",
                _POISON_STEPS,
                producer={"count": 2},
                consumer={"replicas": replicas, "feed_efficiency_steps": 0},
                buckets={"num_buckets": 1, "batch_size": 16},  # one program per run: the slots are the subject
                model={"step": step},
            )
            for name, replicas, step in (("one", 1, procs.TINY_STEP), ("two", 2, "tests.steps:replica_tiny_step"))
            for mode in _MODES
        }
        out = tmp / "replicas.json"
        producers = procs.start("producer", next(iter(configs.values())), tmp / "producers.log")
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tests.replica_check",
                    str(out),
                    *(arg for (mode, _), config in configs.items() for arg in (mode, str(config))),
                ],
                cwd=REPO,
                env=_env(tmp),
                capture_output=True,
                text=True,
                timeout=_CHECK_TIMEOUT_S,
            )
        finally:
            procs.stop(producers)
        yield _Checks(proc, json.loads(out.read_text()) if out.exists() else {}, tmp)
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
    assert r["copy_ahead_bit_identical"]  # and with the pieces placed on the hand-off's copy thread
    assert r["fed_losses_sum"] == r["ref_losses_sum"] > 0


def _poison_runs(checks: _Checks, replicas: str) -> tuple[dict[str, Any], ...]:
    """The clean, poisoned and early runs on ``replicas`` ("one", "two"), each trained to its end."""
    runs = checks.of("runs")
    found = tuple(runs[f"{replicas}-{mode}"] for mode in _MODES)
    for run in found:
        assert run["steps"] == _POISON_STEPS and not run["interrupted"], run
    return found


@pytest.mark.timeout(600)  # may start the interpreter of replica_checks
def test_slots_overwritten_on_release_change_nothing_unless_released_before_the_step(replica_checks: _Checks) -> None:
    clean, poisoned, early = _poison_runs(replica_checks, "one")
    assert poisoned["overwritten"] >= _POISON_STEPS
    assert int.from_bytes(bytes.fromhex(clean["variables"]["iterations"]), "little") == _POISON_STEPS
    assert clean["variables"] == poisoned["variables"]
    assert clean["variables"]["w"] != early["variables"]["w"]  # the hook bites when the order is wrong
    for name in ("one-clean", "one-poisoned"):
        rc, doc, text = procs.run_audit(replica_checks.tmp / name, replica_checks.tmp)
        assert rc == 0 and doc["applied"] == _POISON_STEPS, text


@pytest.mark.timeout(600)  # may start the interpreter of replica_checks
def test_with_two_replicas_overwritten_slots_change_nothing_unless_released_before_the_step(
    replica_checks: _Checks,
) -> None:
    clean, poisoned, early = _poison_runs(replica_checks, "two")
    assert clean["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert poisoned["overwritten"] >= _POISON_STEPS
    assert int.from_bytes(bytes.fromhex(clean["variables"]["iterations"]), "little") == _POISON_STEPS
    assert clean["variables"] == poisoned["variables"]
    assert clean["variables"]["w"] != early["variables"]["w"]  # the hook bites on replicas too


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
