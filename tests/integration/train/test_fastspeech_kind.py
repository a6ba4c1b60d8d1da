"""A FastSpeech-kind model (tests/fastspeech_kind.py: token durations, a length regulator, named losses) trains in
the built-in loop and with Keras ``fit`` (``as_dataset`` + ``FitResume``), under Keras 3 and under tf_keras (Keras 2,
``TF_USE_LEGACY_KERAS=1``), with an exact audit each time. The model checks on every step that its expanded length
equals ``mel_len`` for every real row, warm-up batches included.

Each run is its own process: ``TF_USE_LEGACY_KERAS`` must be set before TensorFlow first imports Keras.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests import procs
from tests.conftest import REPO, token_durations

_STEPS = 30
_TIMEOUT_S = 400.0  # a TensorFlow start, a graph-mode compile and 30 small steps: ~1 min on the 2-core box
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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flavour", sorted(_KERAS))
def test_builtin_loop_trains_it_with_named_losses_and_an_exact_audit(
    durations_cache: Path, tmp_path: Path, flavour: str
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(durations_cache),
                "buckets": {"num_buckets": 1, "batch_size": 16},
                "consumer": {"status_interval_s": 1.0, "state_dir": str(tmp_path / "state")},
                "model": {
                    "step": "tests.fastspeech_kind:make_step",
                    "jit_compile": False,
                    "learning_rate": 0.01,
                    "params": {"keras": _KERAS[flavour][0]},
                },
            }
        )
    )
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "run",
            "--config",
            str(config),
            "--producers",
            "1",
            "--steps",
            str(_STEPS),
            "--summary-json",
            str(summary),
        ],
        cwd=REPO,
        env=_env(tmp_path, flavour),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # no warning from the step's side, in particular not "warm-up changed variables it could not put back" (tf_keras's
    # schedule variable current_learning_rate, outside optimizer.variables(), is in the step's variables())
    assert [line for line in proc.stderr.splitlines() if " WARNING melfeed.consumer.train" in line] == []
    s = json.loads(summary.read_text())
    assert s["steps"] == _STEPS and s["error"] is None and s["compiles_after_ready"] == 0
    assert sorted(s["final_outputs"]) == ["duration_loss", "loss", "mel_loss"]
    assert s["final_loss"] < 0.7 * s["first_loss"], (s["first_loss"], s["final_loss"])
    rc, doc, text = procs.run_audit(tmp_path / "state", tmp_path)
    assert rc == 0 and doc["ok"] and doc["applied"] == _STEPS and doc["checkpoint_next_batch"] == _STEPS, text


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flavour", sorted(_KERAS))
def test_keras_fit_trains_it_with_fit_resume_and_an_exact_audit(
    durations_cache: Path, tmp_path: Path, flavour: str
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fastspeech_kind",
            "--cache-dir",
            str(durations_cache),
            "--state-dir",
            str(tmp_path / "state"),
            "--steps",
            str(_STEPS),
        ],
        cwd=REPO,
        env=_env(tmp_path, flavour),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["keras"].startswith(_KERAS[flavour][0]), doc["keras"]
    losses = [b["loss"] for b in doc["batches"]]
    assert len(losses) == _STEPS and all(np.isfinite(losses))
    assert sorted(doc["batches"][-1]) == ["duration_loss", "loss", "mel_loss"]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    rc, audit, text = procs.run_audit(tmp_path / "state", tmp_path)
    assert rc == 0 and audit["ok"] and audit["applied"] == _STEPS and audit["checkpoint_next_batch"] == _STEPS, text
