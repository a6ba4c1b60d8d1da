"""``CostPlanner``: the shapes a producer under ``buckets.cost: measured`` plans with a consumer's weights are the
ones the consumer plans with them (same lengths, same settings), rows from the WELCOME only when the config learns
them, and a plan it cannot make is a ConfigError naming the setting."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from melfeed.producer.learned_plan import CostPlanner
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import build_buckets, with_costs

_RNG = np.random.default_rng(0)
FRAMES = _RNG.integers(100, 800, size=300)
TOKENS = _RNG.integers(10, 200, size=300)  # frames and tokens independent: the token weight moves the shapes
MEASURED = BucketConfig(cost="measured", batch_size=4, max_shapes=2)
COSTS = (100.0, 0.002)


def _consumer(cfg: BucketConfig) -> list[list[int]]:
    """The consumer's shapes: the same settings, resolved with ``COSTS``."""
    return build_buckets(FRAMES, TOKENS, 80, with_costs(cfg, *COSTS)).as_wire()


def test_the_planned_shapes_are_the_consumers_with_its_weights_and_not_the_default_ones() -> None:
    planner = CostPlanner(FRAMES, TOKENS, 80, MEASURED)
    planned = [b.as_wire() for b in planner(COSTS, [99, 99])]
    assert planned == _consumer(MEASURED)  # own rows (batch_size 4): the WELCOME's are not this config's
    default = build_buckets(FRAMES, TOKENS, 80, dataclasses.replace(MEASURED, cost="formula")).as_wire()
    assert planned != default  # the weights change the shapes: a producer planning with its own would not match
    assert planner(COSTS, [99, 99]) is planner(COSTS, [99, 99])  # the same weights again: the kept plan


def test_a_config_learning_its_rows_takes_the_welcomes_rows() -> None:
    auto = dataclasses.replace(MEASURED, batch_size="auto", max_batch_size=64)
    planner = CostPlanner(FRAMES, TOKENS, 80, auto, mel_dtype="float16")
    planned = planner(COSTS, [16, 8])
    assert [b.batch_size for b in planned] == [16, 8] and {b.mel_dtype for b in planned} == {"float16"}
    shapes = [w[2:] for w in _consumer(dataclasses.replace(auto, batch_size=1))]
    assert [b.as_wire()[2:] for b in planned] == shapes
    assert [b.batch_size for b in planner(COSTS, [32, 4])] == [32, 4]  # other rows: planned again
    assert [b.batch_size for b in planner(COSTS, [16])] == [1, 1]  # another shape count: cannot match, one row each
    with pytest.raises(ConfigError, match=r"buckets.max_batch_size: is below the consumer's 65 rows"):
        planner(COSTS, [65, 8])


def test_settings_that_cannot_plan_with_the_weights_are_a_config_error() -> None:
    three_rows = dataclasses.replace(MEASURED, rows=(4, 4, 4))  # the consumer's weights make two shapes
    with pytest.raises(ConfigError, match=r"buckets.rows: must list one row count per bucket \(2\)"):
        CostPlanner(FRAMES, TOKENS, 80, three_rows)(COSTS, [4, 4])
