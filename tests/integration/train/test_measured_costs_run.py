"""``buckets.cost: measured`` in a real run (`melfeed run`, a real producer): the consumer times its step on the
probe shapes, fits the planner's weights, plans with them (its producer builds the same plan, else the handshake
refuses it with exit 78), keeps them in the state directory, and a resumed run keeps the plan it started with; the
audit checks every batch's content against that plan."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from melfeed.shared.cache.manifest import load_manifest
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.wire.buckets import build_buckets, with_costs
from tests import procs

_FITTED = re.compile(r"buckets\.cost measured: token_cost ([0-9.]+) attention_cost ([0-9.]+) on CPU ")


@pytest.fixture(scope="module")
def runs(demo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run of 4 batches that measures, then the same config resumed to 8 batches."""
    tmp = tmp_path_factory.mktemp("measured")
    state = tmp / "state"
    settings = {
        "cache_dir": str(demo_cache),
        "buckets": {"cost": "measured", "batch_size": 4, "max_shapes": 4},
        "consumer": {"warmup_steps": 1, "state_dir": str(state), "feed_efficiency_steps": 0},
        "model": {"step": "tests.steps:token_heavy_step", "jit_compile": False},
    }
    cfg = tmp / "run.yaml"
    cfg.write_text(yaml.safe_dump(settings))
    summary = tmp / "summary.json"
    first = procs.run("run", cfg, "--producers", "1", "--steps", "4", "--summary-json", str(summary), timeout_s=300)
    costs_after_first = json.loads((state / "bucket_costs.json").read_text())
    resumed = procs.run("run", cfg, "--producers", "1", "--steps", "8", "--summary-json", str(summary), timeout_s=300)
    audit = procs.run_audit(state, tmp)
    return {
        "settings": settings,
        "first": first,
        "costs": costs_after_first,
        "resumed": resumed,
        "summary": json.loads(summary.read_text()) if summary.exists() else {},
        "audit": audit,
    }


def test_the_consumer_fits_the_weights_to_its_step_and_keeps_them(runs: dict[str, Any]) -> None:
    first = runs["first"]
    assert first.returncode == 0, first.stderr[-3000:]
    fitted = _FITTED.search(first.stderr)
    assert fitted is not None, first.stderr[-3000:]
    weights = [float(fitted[1]), float(fitted[2])]
    assert runs["costs"]["plan_costs"] == weights
    (entry,) = runs["costs"]["entries"].values()
    assert entry["costs"] == weights and len(entry["fit"]["probes"]) == 5
    # token_heavy_step's time grows with the tokens and hardly with the frames: tokens are far dearer
    assert weights[0] >= 10, weights


def test_the_run_trains_on_the_plan_of_the_fitted_weights(runs: dict[str, Any]) -> None:
    weights = runs["costs"]["plan_costs"]
    cfg = config_from_mapping(runs["settings"])
    assert cfg.cache_dir is not None
    manifest = load_manifest(cfg.cache_dir, cfg.n_mels)
    planned = build_buckets(
        manifest.frames, manifest.token_counts, cfg.n_mels, with_costs(cfg.buckets, *weights), manifest.schema
    )
    trained = [(b["frames"], b["tokens"]) for b in runs["summary"]["buckets"]]
    assert trained == [(b.max_frames, b.max_tokens) for b in planned.buckets]


def test_a_resumed_run_keeps_its_plans_weights_and_the_audit_is_exact(runs: dict[str, Any]) -> None:
    resumed = runs["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(the plan's, resuming; no probes)" in resumed.stderr, resumed.stderr[-3000:]
    assert runs["summary"]["steps"] == 4 and runs["summary"]["next_batch"] == 8  # this start applied 4 more
    code, doc, text = runs["audit"]
    assert code == 0 and "plan content checked" in text, text
