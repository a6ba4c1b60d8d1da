"""A Tacotron-kind step (tests/tts_models.py) through `melfeed run`: a BiLSTM encoder masked to the batch's longest
row (``token_axis = "longest"``), r = 3 frames per decoder step (``frame_multiple = 3``, ``buckets.frame_multiple:
3``) and a guided-attention loss on a matrix extra adopted with ``index --extra attn:matrix/3=DIR``. It trains in
graph mode with no compile after READY, and the audit of the applied batches is exact."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests import procs
from tests.attention_data import attention_cache

_STEPS = 16


def test_a_tacotron_kind_step_trains_on_the_longest_token_cut_with_a_matrix_extra_and_audits_exact(
    demo_cache: Path, tmp_path: Path
) -> None:
    cache = attention_cache(demo_cache, tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(cache),
                "buckets": {  # one bucket: the cut's width still varies from batch to batch
                    "num_buckets": 1,
                    "batch_size": 8,
                    "frame_multiple": 3,
                    "max_frames": 300,
                    "partial": "drop",
                },
                "consumer": {
                    "warmup_steps": 1,
                    "status_interval_s": 0.5,
                    "state_dir": str(tmp_path / "state"),
                    "feed_efficiency_steps": 0,
                },
                "model": {"step": "tests.tts_models:tacotron_step", "jit_compile": False, "learning_rate": 0.01},
            }
        )
    )
    summary = tmp_path / "summary.json"
    proc = procs.run(
        "run", cfg, "--producers", "1", "--steps", str(_STEPS), "--summary-json", str(summary), timeout_s=400
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "takes extras ['attn']" in proc.stderr
    s = json.loads(summary.read_text())
    assert s["steps"] == _STEPS and s["error"] is None and s["jit_compile"] == "graph"
    assert s["compiles_after_ready"] == 0  # the cut width varies per batch: no retrace
    assert list(s["final_outputs"]) == ["loss", "guided_attn", "mel_l1"] and s["final_outputs"]["guided_attn"] > 0
    rc, doc, text = procs.run_audit(tmp_path / "state", tmp_path)
    assert rc == 0 and doc["applied"] == _STEPS and doc["content_checked"], text
