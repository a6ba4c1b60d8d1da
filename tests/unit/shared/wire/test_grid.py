"""Unit tests for the 2-D bucket planner (shared/wire/grid.py) through build_buckets."""

from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from melfeed.shared.config import BucketConfig
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from melfeed.shared.wire.grid import ShapeCost

_LENGTHS = st.lists(st.tuples(st.integers(1, 300), st.integers(0, 60)), min_size=1, max_size=60)


def _cost(bs: BucketSet, cfg: BucketConfig) -> int:
    """The planner's padded cost of a built set over one epoch: each kept utterance's row cost, plus the padding
    rows of each bucket's last, partial batch."""
    kept = bs.assignment[bs.assignment >= 0]
    shape_cost = ShapeCost.of(cfg.token_cost, cfg.attention_cost)
    t = np.array([b.max_frames for b in bs.buckets], dtype=np.int64)
    w = np.array([b.max_tokens for b in bs.buckets], dtype=np.int64)
    counts = np.bincount(kept, minlength=len(bs.buckets))
    pad = sum(
        (-int(n) % b.batch_size) * int(shape_cost.row(t[k], w[k])) for k, (n, b) in enumerate(zip(counts, bs.buckets))
    )
    return int(shape_cost.row(t[kept], w[kept]).sum()) + pad


def _lj_like(n: int = 13_100, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """LJSpeech-like lengths: 1-10 s at ~86 frames/s skewed to long, ~5.5 frames per token +- 10 %."""
    rng = np.random.default_rng(seed)
    frames = np.rint((1 + 9 * rng.beta(2.6, 1.4, n)) * 86.13).astype(np.int64)
    tokens = np.rint(frames / (5.5 * np.exp(rng.normal(0.0, 0.1, n)))).astype(np.int64)
    return frames, tokens


@settings(max_examples=80, deadline=None)
@given(
    pairs=_LENGTHS,
    shapes=st.integers(1, 6),
    token_cost=st.sampled_from([0.0, 1.0, 7.5]),
    attention_cost=st.sampled_from([0.0, 0.01]),
    multiple=st.sampled_from([1, 8]),
    overlong=st.sampled_from(["truncate", "drop"]),
    max_frames=st.one_of(st.none(), st.integers(50, 300)),
    max_fpt=st.one_of(st.none(), st.floats(2.0, 40.0)),
    tolerance=st.sampled_from([0.0, 0.05]),
)
def test_grid_plan_fits_every_utterance_within_budget_and_beats_1d(
    pairs: list[tuple[int, int]],
    shapes: int,
    token_cost: float,
    attention_cost: float,
    multiple: int,
    overlong: str,
    max_frames: int | None,
    max_fpt: float | None,
    tolerance: float,
) -> None:
    frames = np.array([p[0] for p in pairs])
    tokens = np.array([p[1] for p in pairs])
    common = dict(
        token_cost=token_cost,
        attention_cost=attention_cost,
        frame_multiple=multiple,
        overlong=overlong,
        max_frames=max_frames,
        max_frames_per_token=max_fpt,
        batch_size=4,
    )
    cfg = BucketConfig(max_shapes=shapes, cost_tolerance=tolerance, **common)  # type: ignore[arg-type]
    try:
        grid = build_buckets(frames, tokens, 80, cfg)
    except Exception as err:  # every utterance left out: the 1-D plan refuses the same input
        assert type(err).__name__ == "ConfigError"
        return
    one_d = build_buckets(frames, tokens, 80, BucketConfig(num_buckets=shapes, **common))  # type: ignore[arg-type]
    assert 1 <= len(grid.buckets) <= shapes
    keys = [(b.max_frames, b.max_tokens) for b in grid.buckets]
    assert keys == sorted(set(keys)) and all(b.max_frames % multiple == 0 for b in grid.buckets)
    a = grid.assignment
    assert set(np.flatnonzero(a < 0).tolist()) == set(np.flatnonzero(one_d.assignment < 0).tolist())
    assert int((a < 0).sum()) == grid.outliers + grid.dropped
    top = max(b.max_frames for b in grid.buckets)
    cost = ShapeCost.of(token_cost, attention_cost)
    cheapest, banded = [], []
    for i in np.flatnonzero(a >= 0):
        f, t = min(int(frames[i]), top), int(tokens[i])
        fitting = [k for k, (tf, lt) in enumerate(keys) if f <= tf and t <= lt]
        assert a[i] in fitting
        costs = [int(cost.row(np.int64(keys[k][0]), np.int64(keys[k][1]))) for k in fitting]
        cheapest.append(a[i] == fitting[int(np.argmin(costs))])  # lowest index on ties
        banded.append(a[i] == min(k for k, (tf, _) in enumerate(keys) if f <= tf))
    assert all(cheapest) or all(banded)  # settled to the cheapest fitting shape, or the 1-D plan as built
    least = build_buckets(frames, tokens, 80, BucketConfig(max_shapes=shapes, cost_tolerance=0.0, **common))  # type: ignore[arg-type]
    assert _cost(least, cfg) <= _cost(one_d, cfg)  # never costlier than the 1-D plan, partial batches included
    assert _cost(grid, cfg) <= _cost(least, cfg) * (1 + tolerance) + 1e-6  # fewer shapes: within the tolerance
    again = build_buckets(frames, tokens, 80, cfg)
    assert again.as_wire() == grid.as_wire() and np.array_equal(again.assignment, grid.assignment)


def test_num_buckets_keeps_the_1d_plan_and_max_shapes_gives_the_grid() -> None:
    frames, tokens = _lj_like(2000)
    one_d = build_buckets(frames, tokens, 80, BucketConfig(num_buckets=4))
    t = [b.max_frames for b in one_d.buckets]
    assert t == sorted(set(t)) and len(t) == 4
    cfg = BucketConfig(max_shapes=4, token_cost=20.0, cost_tolerance=0.0)
    grid = build_buckets(frames, tokens, 80, cfg)
    assert len({b.max_frames for b in grid.buckets}) < len(grid.buckets) <= 4  # tokens split a frame band
    assert _cost(grid, cfg) < _cost(one_d, cfg)


def test_frames_per_token_outliers_leave_the_plan() -> None:
    frames = np.array([100, 100, 100, 400, 100])
    tokens = np.array([20, 2, 90, 80, 0])  # 5, 50, 1.1, 5, inf frames per token
    bs = build_buckets(frames, tokens, 80, BucketConfig(max_frames_per_token=10.0, min_frames_per_token=2.0))
    assert bs.assignment.tolist()[1:3] == [-1, -1] and bs.assignment[4] == -1 and bs.outliers == 3
    assert max(b.max_tokens for b in bs.buckets) == 80 and (bs.truncated, bs.dropped) == (0, 0)


def test_lj_like_13k_plan_is_bounded_in_time_and_pads_little() -> None:
    frames, tokens = _lj_like()
    cfg = BucketConfig(max_shapes=8, cost_tolerance=0.0)
    start = time.perf_counter()
    grid = build_buckets(frames, tokens, 80, cfg)
    elapsed_s = time.perf_counter() - start
    one_d = build_buckets(frames, tokens, 80, BucketConfig(num_buckets=8))
    print(
        f"lj-like 13k: {elapsed_s * 1e3:.0f} ms, {len(grid.buckets)} shapes, frames "
        f"{grid.padding_efficiency():.3f}, tokens {grid.token_padding_efficiency():.3f}"
    )
    # The plan runs at every start: only an algorithmic regression gets near this bound on a busy machine (its
    # speed is measured in docs/performance.md, "Bucket padding", not here).
    assert elapsed_s < 30.0
    assert len(grid.buckets) <= 8 and _cost(grid, cfg) <= _cost(one_d, cfg)
    assert grid.padding_efficiency() >= 0.92  # 8 frame bands bound it: docs/performance.md, "Bucket padding"
    trimmed = build_buckets(
        frames,
        tokens,
        80,
        BucketConfig(max_shapes=8, max_frames_per_token=6.5, min_frames_per_token=4.5, cost_tolerance=0.0),
    )
    print(
        f"  with 4.5..6.5 frames per token: {trimmed.outliers} outliers, frames "
        f"{trimmed.padding_efficiency():.3f}, tokens {trimmed.token_padding_efficiency():.3f}"
    )
    assert trimmed.token_padding_efficiency() > grid.token_padding_efficiency() + 0.05


def test_the_default_tolerance_spends_a_shape_only_where_it_saves_padding() -> None:
    """Each shape is one compiled program: the default plan is the fewest shapes within 1 % of the least cost."""
    from melfeed.shared.cache.demo_data import _lengths as demo_lengths  # the demo cache's length model

    demo = demo_lengths(2000, np.random.default_rng(0))
    for frames, tokens in (demo, _lj_like(4000)):
        least = build_buckets(frames, tokens, 80, BucketConfig(cost_tolerance=0.0))
        chosen = build_buckets(frames, tokens, 80, BucketConfig())
        cfg = BucketConfig()
        assert len(chosen.buckets) <= len(least.buckets)
        assert _cost(chosen, cfg) <= 1.01 * _cost(least, cfg)
    short = build_buckets(*demo, 80, BucketConfig())
    assert len(short.buckets) < 8, [(b.max_frames, b.max_tokens) for b in short.buckets]


def test_settling_never_makes_the_plan_costlier_than_the_1d_plan_over_an_epoch() -> None:
    # Rows (1, 0) are cheaper in the (2, 1) shape than in (1, 2), but moving them there leaves two partial
    # batches where the 1-D plan has one: the 1-D plan as built is the cheapest over an epoch.
    frames, tokens = np.array([1, 1, 1, 1, 2, 2]), np.array([0, 0, 0, 2, 0, 0])
    common = dict(token_cost=7.5, frame_multiple=1, batch_size=4)
    cfg = BucketConfig(max_shapes=2, cost_tolerance=0.0, **common)  # type: ignore[arg-type]
    grid = build_buckets(frames, tokens, 80, cfg)
    one_d = build_buckets(frames, tokens, 80, BucketConfig(num_buckets=2, **common))  # type: ignore[arg-type]
    assert _cost(grid, cfg) == _cost(one_d, cfg) == 102_000
    assert grid.assignment.tolist() == one_d.assignment.tolist() == [0, 0, 0, 0, 1, 1]
