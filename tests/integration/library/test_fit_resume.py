"""Keras ``fit`` that resumes exactly (docs/examples/keras_fit.py, run as written): SIGKILLed after a checkpoint and
started again, it ends where an uninterrupted run ends (bit-identical weights) and ``melfeed audit`` finds every
batch applied once, in plan order; the uninterrupted run's TensorBoard feed figures read back as scalars."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.board_events import read_scalars
from tests.cli_run import REPO

_EXAMPLE = REPO / "docs" / "examples" / "keras_fit.py"
_STEPS = 60  # a checkpoint every 5: the kill lands well inside the run (about 0.1 s a step)
_TIMEOUT_S = 240.0  # a Keras start and 60 tiny steps take ~20 s; only a hang gets near it


def _fit(demo_cache: Path, state: Path, weights: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(_EXAMPLE),
            "--cache-dir",
            str(demo_cache),
            "--state-dir",
            str(state),
            "--steps",
            str(_STEPS),
            "--save-weights",
            str(weights),
            *extra,
        ],
        cwd=REPO,
        # its own runtime directory: the example's default endpoint, not another run's beside it
        env={**os.environ, "XDG_RUNTIME_DIR": str(state.parent)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=_TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:]
    return out


def _first_checkpoint(state: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while not any(p.name.startswith("ckpt-") and "." not in p.name for p in state.glob("ckpt-*")):
        assert proc.poll() is None, "the fit ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_a_fit_killed_mid_run_and_started_again_ends_with_the_uninterrupted_weights_and_an_exact_audit(
    demo_cache: Path, tmp_path: Path
) -> None:
    _finish(_fit(demo_cache, tmp_path / "straight", tmp_path / "straight.npz", "--tensorboard", str(tmp_path / "tb")))
    scalars = read_scalars(tmp_path / "tb" / "feed")
    assert scalars["feed/batches_per_s"] and all(v > 0 for _, v in scalars["feed/batches_per_s"]), scalars
    assert max(step for step, _ in scalars["feed/batches_per_s"]) <= _STEPS
    killed = _fit(demo_cache, tmp_path / "state", tmp_path / "resumed.npz")
    _first_checkpoint(tmp_path / "state", killed)
    os.killpg(killed.pid, signal.SIGKILL)  # the fit and its producers: no handler runs
    killed.communicate(timeout=_TIMEOUT_S)
    out = _finish(_fit(demo_cache, tmp_path / "state", tmp_path / "resumed.npz"))
    start = int(out.split("starts at batch ")[1].split()[0])
    assert 0 < start < _STEPS, out[-2000:]  # it resumed mid-run, not from 0
    straight, resumed = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    assert straight.files == resumed.files
    assert all(np.array_equal(straight[k], resumed[k]) for k in straight.files)
    audit = subprocess.run(
        [sys.executable, "-m", "melfeed", "audit", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert f"{_STEPS} batches applied by 2 consumer start(s); plan 0..{_STEPS - 1}" in audit.stdout
