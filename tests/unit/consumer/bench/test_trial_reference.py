"""bench's tuned tf.data trial trains on a cache with extras, as every demo cache has (energy, speaker): its
pipeline yields the base arrays, and its warm-up batches are read the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from melfeed.consumer.bench.trial_reference import run_tfdata_reference
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.metrics import FEED_EFFICIENCY_MIN_STEPS

pytestmark = pytest.mark.tf


def test_the_tf_data_trial_reports_feed_efficiency_on_a_cache_with_extras(tmp_path: Path) -> None:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=40, extras=True)
    assert manifest.extras  # arrays the tf.data pipeline does not yield
    cfg = config_from_mapping(
        {
            "cache_dir": str(tmp_path / "cache"),
            "buckets": {"num_buckets": 1, "batch_size": 4},
            "model": {"step": "tests.steps:tiny_step", "jit_compile": False},
        }
    )
    spec = {
        "system": "tfdata-2",
        "kind": "tfdata",
        "round": 0,
        "step_ms": None,
        "warmup": 2,
        "batches": FEED_EFFICIENCY_MIN_STEPS,
    }
    result = run_tfdata_reference({**spec, "parallel_calls": 2}, cfg)
    assert result["feed_efficiency"] is not None and result["feed_efficiency"] > 0
    assert 0 < result["padding_efficiency"] <= 1
