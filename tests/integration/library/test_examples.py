"""The examples under docs/examples run as written: the step factory in the built-in loop (``model.step:
step_factory:make_step``, found in the working directory, as the example's own command runs it) with its named
losses and the ``energy`` extra, and the own training loop on ``melfeed.Consumer``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs
from tests.conftest import REPO

_EXAMPLES = REPO / "docs" / "examples"
_STEPS = 30
_TIMEOUT_S = 400.0  # a TensorFlow start, a graph-mode compile and 30 small steps: under a minute on 2 cores


@pytest.mark.timeout(600)
def test_step_factory_example_trains_in_the_built_in_loop_and_reports_its_named_losses(
    durations_cache: Path, tmp_path: Path
) -> None:
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "run",
            "--cache-dir",
            str(durations_cache),  # has energy
            "--steps",
            str(_STEPS),
            "--producers",
            "1",
            "--set",
            "model.step=step_factory:make_step",
            "--set",
            "model.jit_compile=false",
            "--set",
            "buckets.num_buckets=1",
            "--summary-json",
            str(summary),
        ],
        cwd=_EXAMPLES,
        env=procs.env(tmp_path),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "takes extras ['energy']" in proc.stderr
    s = json.loads(summary.read_text())
    assert s["steps"] == _STEPS and s["error"] is None
    assert sorted(s["final_outputs"]) == ["energy_l1", "loss", "mel_l1"]
    assert s["final_loss"] < 0.8 * s["first_loss"], (s["first_loss"], s["final_loss"])


@pytest.mark.timeout(600)
def test_own_loop_example_applies_every_batch_of_the_plan_and_trains(demo_cache: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(_EXAMPLES / "own_loop.py"), "--cache-dir", str(demo_cache), "--steps", str(_STEPS)],
        cwd=REPO,
        env=procs.env(tmp_path),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"applied {_STEPS} batches (0..{_STEPS - 1}); loss "), last
    first, final = map(float, last.split("loss ")[1].split(" -> "))
    assert final < 0.8 * first, last
