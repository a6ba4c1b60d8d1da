"""A foreign-style model (tests/foreign_model.py) through `melfeed run` under each `model.jit_compile`.

auto: XLA cannot build the gradient of its `tf.cond`, so the run falls back to graph mode with one
WARNING line, trains in the built-in loop and its loss falls; every named scalar reaches the status
line, the metrics file and the summary. true: one line naming the factory and the op, exit 1, and
the summary is still written with the failure.

The auto run also trains on a float16 wire (``transport.mel_dtype: float16``): the producer casts the demo
cache's float32 mels to float16 into the shared-memory slots and the step casts back inside its program; nothing
is rejected or recompiled and the audit of the state directory is exact. (The reference step on float16 slots:
tests/integration/train/test_replicas.py, bit-identical to float32 slots; with XLA:
tests/unit/consumer/train/test_step_float16.py.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from tests import procs

FACTORY = "tests.foreign_model:build_foreign_step"


_AUTO_STEPS = 60


def _run(
    tmp: Path, cache: Path, jit_compile: object, steps: int, mel_dtype: str = "float32"
) -> tuple[subprocess.CompletedProcess[str], Path]:
    cfg = tmp / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(cache),
                "transport": {"mel_dtype": mel_dtype},
                # two shapes: with one bucket of the demo cache XLA does compile this step, and nothing falls back
                "buckets": {"num_buckets": 2, "batch_size": 16},
                "consumer": {
                    "warmup_steps": 2,
                    "status_interval_s": 0.3,
                    "state_dir": str(tmp / "state"),
                    "feed_efficiency_steps": 0,
                },
                "model": {
                    "step": FACTORY,
                    "jit_compile": jit_compile,
                    "learning_rate": 0.02,
                    "params": {"hidden": 16, "stop_weight": 0.5},
                },
            }
        )
    )
    summary = tmp / "summary.json"
    proc = procs.run(
        "run",
        cfg,
        "--producers",
        "1",
        "--steps",
        str(steps),
        "--summary-json",
        str(summary),
        "--metrics-file",
        str(tmp / "metrics.jsonl"),
        timeout_s=400,
    )
    return proc, summary


class _Run(NamedTuple):
    proc: subprocess.CompletedProcess[str]
    summary: Path
    tmp: Path


@pytest.fixture(scope="module")
def auto_run(demo_cache: Path) -> Iterator[_Run]:
    """``melfeed run`` of the foreign step under ``jit_compile: auto`` on a float16 wire (60 steps)."""
    tmp = Path(tempfile.mkdtemp(prefix="mf-", dir="/tmp"))  # short: XDG_RUNTIME_DIR holds the run's sockets
    try:
        proc, summary = _run(tmp, demo_cache, "auto", steps=_AUTO_STEPS, mel_dtype="float16")
        yield _Run(proc, summary, tmp)
    finally:
        procs.reap_started()
        shutil.rmtree(tmp, ignore_errors=True)


def test_auto_falls_back_to_graph_mode_and_trains(auto_run: _Run) -> None:
    proc, summary, tmp_path = auto_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr.splitlines()
    warnings = [line for line in err if " WARNING melfeed.consumer.train" in line]
    assert len(warnings) == 1, warnings  # the fallback is one line, not a traceback
    assert f"XLA cannot compile the step of {FACTORY}, using graph mode: op " in warnings[0]
    assert "StridedSliceGrad" in warnings[0] and "Traceback" not in proc.stderr
    assert any("READY:" in line and "jit_compile=graph" in line for line in err)
    s: dict[str, Any] = json.loads(summary.read_text())
    assert s["steps"] == _AUTO_STEPS and s["jit_compile"] == "graph" and s["error"] is None
    assert "StridedSliceGrad" in s["jit_reason"] and s["compiles_after_ready"] == 0
    assert list(s["final_outputs"]) == ["loss", "mel_l1", "stop_bce"]
    assert s["final_outputs"]["loss"] == s["final_loss"]
    assert s["final_loss"] < 0.7 * s["first_loss"], (s["first_loss"], s["final_loss"])
    assert any("mel_l1" in line and "stop_bce" in line and "batches/s" in line for line in err)  # status line
    snaps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert snaps[-1]["phase"] == "done" and snaps[-1]["jit_compile"] == "graph"
    assert list(snaps[-1]["outputs"]) == ["loss", "mel_l1", "stop_bce"]
    memo = json.loads((tmp_path / "state" / "jit_compile.json").read_text())  # a restart keeps graph mode
    assert memo["mode"] == "graph" and "StridedSliceGrad" in memo["reason"]


def test_the_step_trains_on_a_float16_wire_with_an_exact_audit(auto_run: _Run) -> None:
    proc, summary, tmp_path = auto_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == s["batches_applied"] == _AUTO_STEPS
    assert s["rejects"] == {} and s["duplicates_dropped"] == 0 and s["compiles_after_ready"] == 0
    assert s["final_loss"] < 0.7 * s["first_loss"], (s["first_loss"], s["final_loss"])
    rc, doc, text = procs.run_audit(tmp_path / "state", tmp_path)
    assert rc == 0 and doc["applied"] == _AUTO_STEPS and doc["content_checked"], text


def test_true_exits_1_with_one_line_and_writes_the_summary(demo_cache: Path, tmp_path: Path) -> None:
    proc, summary = _run(tmp_path, demo_cache, True, steps=20)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"melfeed run: model.step {FACTORY}: XLA cannot compile the step (jit_compile: true): op "
    ), last
    assert "StridedSliceGrad" in last and "Traceback" not in proc.stderr
    s = json.loads(summary.read_text())
    assert s["error"] == last.removeprefix("melfeed run: ")
    assert s["steps"] == 0 and s["jit_compile"] is None
