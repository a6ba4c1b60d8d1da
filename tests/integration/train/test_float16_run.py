"""The reference model trains on a float16 wire (``transport.mel_dtype: float16``) in a real run.

`melfeed run` with a producer casting the demo cache's float32 mels to float16 into the
shared-memory slots; the reference step casts back inside its program (graph mode here, to save CPU;
XLA is covered by tests/unit/consumer/train/test_step_float16.py). The loss falls, nothing is rejected
or recompiled, and the audit of the state directory is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests import procs

_STEPS = 40


def test_the_reference_model_trains_on_a_float16_wire_with_an_exact_audit(demo_cache: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(demo_cache),
                "buckets": {"num_buckets": 2, "batch_size": 8},
                "transport": {"mel_dtype": "float16"},
                "consumer": {
                    "warmup_steps": 1,
                    "status_interval_s": 0.5,
                    "state_dir": str(tmp_path / "state"),
                    "feed_efficiency_steps": 0,
                },
                "model": {"jit_compile": False},
            }
        )
    )
    summary = tmp_path / "summary.json"
    proc = procs.run(
        "run", cfg, "--producers", "1", "--steps", str(_STEPS), "--summary-json", str(summary), timeout_s=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == s["batches_applied"] == _STEPS
    assert s["rejects"] == {} and s["duplicates_dropped"] == 0 and s["compiles_after_ready"] == 0
    assert s["final_loss"] < 0.7 * s["first_loss"], (s["first_loss"], s["final_loss"])
    rc, doc, text = procs.run_audit(tmp_path / "state", tmp_path)
    assert rc == 0 and doc["applied"] == _STEPS and doc["content_checked"], text
