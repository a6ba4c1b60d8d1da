"""A FastSpeech-kind model (tests/fastspeech_kind.py: token durations, a length regulator, named losses) trains in
the built-in loop and with Keras ``fit`` (``as_dataset`` + ``FitResume``), under Keras 3 and under tf_keras (Keras 2,
``TF_USE_LEGACY_KERAS=1``), with an exact audit each time. The model checks on every step that its expanded length
equals ``mel_len`` for every real row, warm-up batches included.

Each Keras is its own process (``TF_USE_LEGACY_KERAS`` must be set before TensorFlow first imports Keras), which
trains it both ways: ``melfeed run`` in that process first, then ``fit`` (tests/fastspeech_kind.py ``--run-config``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import yaml

from tests import procs
from tests.conftest import REPO, token_durations

_STEPS = 30
_TIMEOUT_S = 600.0  # a TensorFlow start, two graph-mode compiles and 2 x 30 small steps: ~1.5 min on the 2-core box
_KERAS = {"keras3": ("keras", {}), "tf_keras": ("tf_keras", {"TF_USE_LEGACY_KERAS": "1"})}


def _env(tmp: Path, flavour: str) -> dict[str, str]:
    env = {k: v for k, v in procs.env(tmp).items() if k != "TF_USE_LEGACY_KERAS"}
    return {**env, **_KERAS[flavour][1]}


def test_token_durations_sum_to_the_frames_and_the_regulator_expands_by_them() -> None:
    import tensorflow as tf

    from tests.fastspeech_kind import regulate

    assert token_durations(10, 3).tolist() == [4, 3, 3] and token_durations(871, 190).sum() == 871
    h = tf.constant([[[1.0], [2.0], [3.0]]])
    out = regulate(h, tf.constant([[2, 0, 1]]), tf.constant(5))
    assert out[0, :, 0].numpy().tolist() == [1.0, 1.0, 3.0, 0.0, 0.0]  # a 0-duration token is skipped


class _Trained(NamedTuple):
    """What one process under one Keras left: the built-in run's exit code, stderr and summary, the fit's batch
    logs, and the two state directories."""

    flavour: str
    run_exit: int | None
    run_stderr: str
    summary: dict[str, Any]
    fit: dict[str, Any]
    run_state: Path
    fit_state: Path
    tmp: Path


@pytest.fixture(scope="module", params=sorted(_KERAS))
def trained(request: pytest.FixtureRequest, durations_cache: Path) -> Iterator[_Trained]:
    from tests.fastspeech_kind import RUN_DONE  # imports TensorFlow: not at collection

    flavour = str(request.param)
    tmp = Path(tempfile.mkdtemp(prefix="mf-", dir="/tmp"))  # short: XDG_RUNTIME_DIR holds the run's sockets
    config = tmp / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(durations_cache),
                "buckets": {"num_buckets": 1, "batch_size": 16},
                "consumer": {"status_interval_s": 1.0, "state_dir": str(tmp / "run-state"), "feed_efficiency_steps": 0},
                "model": {
                    "step": "tests.fastspeech_kind:make_step",
                    "jit_compile": False,
                    "learning_rate": 0.01,
                    "params": {"keras": _KERAS[flavour][0]},
                },
            }
        )
    )
    summary = tmp / "summary.json"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.fastspeech_kind",
                "--cache-dir",
                str(durations_cache),
                "--state-dir",
                str(tmp / "fit-state"),
                "--steps",
                str(_STEPS),
                "--run-config",
                str(config),
                "--run-summary",
                str(summary),
            ],
            cwd=REPO,
            env=_env(tmp, flavour),
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert RUN_DONE in proc.stderr, proc.stderr[-3000:]  # what comes before it is the built-in run's
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        yield _Trained(
            flavour,
            doc["run_exit"],
            proc.stderr.split(RUN_DONE)[0],
            json.loads(summary.read_text()) if summary.exists() else {},
            doc,
            tmp / "run-state",
            tmp / "fit-state",
            tmp,
        )
    finally:
        procs.reap_started()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(900)
def test_builtin_loop_trains_it_with_named_losses_and_an_exact_audit(trained: _Trained) -> None:
    assert trained.run_exit == 0, trained.run_stderr[-3000:]
    # no warning from the step's side, in particular not "warm-up changed variables it could not put back" (tf_keras's
    # schedule variable current_learning_rate, outside optimizer.variables(), is in the step's variables())
    assert [line for line in trained.run_stderr.splitlines() if " WARNING melfeed.consumer.train" in line] == []
    s = trained.summary
    assert s["steps"] == _STEPS and s["error"] is None and s["compiles_after_ready"] == 0
    assert sorted(s["final_outputs"]) == ["duration_loss", "loss", "mel_loss"]
    assert s["final_loss"] < 0.7 * s["first_loss"], (s["first_loss"], s["final_loss"])
    rc, doc, text = procs.run_audit(trained.run_state, trained.tmp)
    assert rc == 0 and doc["ok"] and doc["applied"] == _STEPS and doc["checkpoint_next_batch"] == _STEPS, text


@pytest.mark.timeout(900)
def test_keras_fit_trains_it_with_fit_resume_and_an_exact_audit(trained: _Trained) -> None:
    doc = trained.fit
    assert doc["keras"].startswith(_KERAS[trained.flavour][0]), doc["keras"]
    losses = [b["loss"] for b in doc["batches"]]
    assert len(losses) == _STEPS and all(np.isfinite(losses))
    assert sorted(doc["batches"][-1]) == ["duration_loss", "loss", "mel_loss"]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    rc, audit, text = procs.run_audit(trained.fit_state, trained.tmp)
    assert rc == 0 and audit["ok"] and audit["applied"] == _STEPS and audit["checkpoint_next_batch"] == _STEPS, text
