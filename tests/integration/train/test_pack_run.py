"""A real run reads the packed cache end to end, and ends bit-identical to the same run reading the files.

`melfeed run` on the demo cache (which comes packed, ``shared/cache/demo_data.py``) with one
producer process: under the default ``producer.pack: auto`` the producer says it reads the pack, the
audit of the state directory is exact; the same run with ``producer.pack: "off"`` reads the ``.npy``
files and ends with the same final variables (the tiny step's depend on every byte of every batch and
on their order) and the same first and final loss. Both runs are the command's main in this process, which
reads the checkpoints with TensorFlow anyway (imported first: the runs' placement then sets no environment);
their producers are real child processes, whose log lines are read from this process's captured stderr.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import yaml

from tests import procs

_STEPS = 24


def _final_variables(state: Path) -> dict[str, np.ndarray]:
    from melfeed.consumer.resume.checkpoint import latest_checkpoint

    found = latest_checkpoint(state)
    assert found is not None, state
    reader = tf.train.load_checkpoint(str(found[0] / "vars"))
    return {name: reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE") for name in ("w", "momentum", "iterations")}


def _train(
    demo_cache: Path, tmp_path: Path, name: str, pack: str, capfd: pytest.CaptureFixture[str]
) -> tuple[dict[str, Any], str]:
    """One ``run`` of ``_STEPS`` steps with ``producer.pack: pack``; its summary and what its producer logged."""
    from melfeed import cli

    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(demo_cache),
                "buckets": {"num_buckets": 1, "batch_size": 8},
                "producer": {"pack": pack},
                "consumer": {
                    "warmup_steps": 1,
                    "status_interval_s": 0.5,
                    "state_dir": str(tmp_path / name),
                    "feed_efficiency_steps": 0,
                    "checkpoint_every_steps": _STEPS,
                },
                "model": {"step": procs.TINY_STEP, "jit_compile": False},
            }
        )
    )
    summary = tmp_path / f"{name}.json"
    capfd.readouterr()  # what came before is not this run's
    code = cli.main(
        ["run", "--config", str(cfg), "--producers", "1", "--steps", str(_STEPS), "--summary-json", str(summary)]
    )
    err = capfd.readouterr().err
    assert code == 0, err[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == s["batches_applied"] == _STEPS and s["rejects"] == {}, s
    rc, doc, text = procs.run_audit(tmp_path / name, tmp_path)
    assert rc == 0 and doc["applied"] == _STEPS and doc["content_checked"], text
    return s, err


def test_a_run_reads_the_pack_and_ends_bit_identical_to_a_run_reading_the_files(
    demo_cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the runs' sockets, as procs.env gives a child
    monkeypatch.setattr("melfeed.shared.service.lifecycle.setup_logging", lambda *args, **kwargs: None)
    packed, err = _train(demo_cache, tmp_path, "packed", "auto", capfd)
    assert f"reading the packed cache {demo_cache / 'melfeed-float32.pack'} (mapped; 0 rows listed bad)" in err, err[
        -3000:
    ]
    files, err = _train(demo_cache, tmp_path, "files", "off", capfd)
    assert "packed cache" not in err, err[-3000:]
    a, b = _final_variables(tmp_path / "packed"), _final_variables(tmp_path / "files")
    assert int(a["iterations"]) == _STEPS
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert (packed["first_loss"], packed["final_loss"]) == (files["first_loss"], files["final_loss"])
