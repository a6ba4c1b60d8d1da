"""doctor checks the plan a consumer trains on: the weights and rows it measured, from its state directory."""

from __future__ import annotations

from pathlib import Path

from melfeed.consumer.doctor.command import _as_planned
from melfeed.consumer.train.measure_cache import COSTS_FILE, ROWS_FILE, store_measures
from melfeed.shared.config.loader import config_from_mapping


def test_doctor_plans_with_the_measured_weights_and_rows_of_the_state_directory(tmp_path: Path) -> None:
    store_measures(tmp_path / COSTS_FILE, "w", "plan_costs", [4.0, 0.01])
    store_measures(tmp_path / ROWS_FILE, "rows", "plan_rows", [16, 8])
    settings = {"buckets": {"cost": "measured", "batch_size": "auto"}, "consumer": {"state_dir": str(tmp_path)}}
    planned = _as_planned(config_from_mapping(settings)).buckets
    assert (planned.cost, planned.token_cost, planned.attention_cost, planned.rows) == ("formula", 4.0, 0.01, (16, 8))
    missing = config_from_mapping({**settings, "consumer": {"state_dir": str(tmp_path / "none")}})
    assert _as_planned(missing) == missing
