"""``buckets.partial: drop`` in a real run (`melfeed run`, real producers): no partial batch reaches the
step (its ``row_mask`` is all real rows), the summary counts the samples dropped per epoch, and the audit of the
applied batches is exact against the drop plan across an epoch boundary."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from melfeed.consumer.flow.plan import EpochPlan
from melfeed.shared.cache.manifest import load_manifest
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.wire.buckets import build_buckets
from tests import procs

_BUCKETS = {"num_buckets": 2, "batch_size": 16, "partial": "drop"}


def test_drop_run_applies_only_full_batches_counts_the_dropped_samples_and_audits_exact(
    demo_cache: Path, tmp_path: Path
) -> None:
    manifest = load_manifest(demo_cache)
    buckets = config_from_mapping({"cache_dir": str(demo_cache), "buckets": _BUCKETS}).buckets
    plan = EpochPlan(
        build_buckets(manifest.frames, manifest.token_counts, 80, buckets), manifest.fingerprint, 0, "drop"
    )
    assert plan.samples_dropped_per_epoch > 0, "the demo cache must leave partial batches"
    steps = plan.batches_per_epoch + 3  # into the second epoch
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(demo_cache),
                "buckets": _BUCKETS,
                "consumer": {
                    "warmup_steps": 1,
                    "status_interval_s": 0.2,
                    "state_dir": str(tmp_path / "state"),
                    "metrics_window_s": 1.0,
                },
                "model": {"step": "tests.steps:rows_step", "jit_compile": False},
            }
        )
    )
    summary = tmp_path / "summary.json"
    proc = procs.run(
        "run",
        cfg,
        "--producers",
        "2",
        "--steps",
        str(steps),
        "--summary-json",
        str(summary),
        "--metrics-file",
        str(tmp_path / "metrics.jsonl"),
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == steps and s["partial"] == "drop"
    assert s["samples_dropped_per_epoch"] == plan.samples_dropped_per_epoch
    assert s["samples"] == steps * 16  # every applied batch was full
    snaps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    means = [snap["outputs"] for snap in snaps if snap.get("outputs")]
    assert means and all(m["padding_rows"] == 0.0 and m["rows"] == 16.0 for m in means)
    rc, doc, text = procs.run_audit(tmp_path / "state", tmp_path)
    assert rc == 0 and doc["applied"] == steps and doc["content_checked"], text
