"""The state directory's record of what the consumer measured (consumer/train/measure_cache.py): a run's
measured weights and rows are what a reader of its state plans with, and the record survives damage."""

from __future__ import annotations

import json
from pathlib import Path

from melfeed.consumer.train.measure_cache import (
    COSTS_FILE,
    ROWS_FILE,
    cached_entry,
    planned_settings,
    read_measures,
    store_measures,
)
from melfeed.shared.config import BucketConfig


def test_a_reader_plans_with_the_runs_measured_weights_and_rows(tmp_path: Path) -> None:
    store_measures(tmp_path / COSTS_FILE, "weights", "plan_costs", [0.25, 0.004])
    store_measures(tmp_path / ROWS_FILE, "rows", "plan_rows", [8, 4, 2])
    settings = planned_settings(tmp_path, BucketConfig(cost="measured", batch_size="auto"))
    assert (settings.cost, settings.token_cost, settings.attention_cost) == ("formula", 0.25, 0.004)
    assert settings.rows == (8, 4, 2)
    given = BucketConfig(token_cost=2.0)
    assert planned_settings(tmp_path, given) == given  # nothing was the consumer's to measure


def test_without_the_files_the_settings_stay_as_they_are(tmp_path: Path) -> None:
    measured = BucketConfig(cost="measured")
    assert planned_settings(tmp_path, measured) == measured
    (tmp_path / COSTS_FILE).write_text("[1, 2")  # damaged: read as empty
    assert planned_settings(tmp_path, measured) == measured and read_measures(tmp_path / COSTS_FILE, "w") == {}


def test_entries_accumulate_by_identity_and_the_plan_value_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / COSTS_FILE
    store_measures(path, "w", "plan_costs", [1.0, 0.0], ("a", {"costs": [1.0, 0.0]}))
    store_measures(path, "w", "plan_costs", [0.5, 0.0], ("b", {"costs": [0.5, 0.0]}))
    data = json.loads(path.read_text())
    assert data["plan_costs"] == [0.5, 0.0] and set(data["entries"]) == {"a", "b"}
    assert cached_entry(path, "a", "w") == {"costs": [1.0, 0.0]} and cached_entry(path, "c", "w") is None
    assert oct(path.stat().st_mode & 0o777) == "0o640"
