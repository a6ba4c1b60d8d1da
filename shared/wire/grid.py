"""The 2-D bucket planner: at most ``max_shapes`` (T frames, L tokens) shapes with the least padded cost.

Role: pure planning for ``shared/wire/buckets.py``. The cost of one row in shape (T, L) is
``T + token_cost * L + attention_cost * T * L`` frames (``ShapeCost``: integer milli-frames, so every
host plans alike); a plan's cost is the sum over its utterances (batch padding rows are ignored, as
in ``derive_boundaries``). The planner:

1. runs the exact 1-D frame DP (``bucket_dp.split_table``) and keeps every band (consecutive bound
   pair) of its optimum for 1 .. max_shapes buckets: the candidate frame bands;
2. splits each candidate band's tokens exactly into 1 .. max_shapes sub-buckets (the same DP over the
   band's token histogram);
3. tiles the frame axis with candidate bands and shares the shape budget between them by an exact
   DP over (band, sub-buckets), then
4. assigns every utterance to its cheapest fitting shape (``assign_cheapest``; ties: lowest
   (T, L)), drops empty shapes and lowers each L to its longest member, until nothing changes.

``grid_slots`` scores that plan against the frames-only 1-D plan with the same budget, both as
built (each utterance in its frame band) and settled by step 4, by ``epoch_cost`` (rows plus each
shape's partial-batch padding), and keeps the cheapest. The 1-D plan as built is among them, so the
result is never costlier than it over an epoch; settling alone can be (moving one row to a cheaper
shape can leave two partial batches where there was one).

Invariants: shapes come out sorted by (T, L) and unique; each kept utterance fits its shape
(frames clipped to the top band, tokens <= L). Shutdown: nothing to release; pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.bucket_dp import INF_COST, derive_boundaries, frame_histogram, split_table

__all__ = [
    "ShapeCost",
    "plan_grid",
    "assign_cheapest",
    "finalise_shapes",
    "plan_cost",
    "is_grid",
    "bucket_count",
    "top_frames",
    "grid_slots",
    "epoch_cost",
    "batch_rows",
]

Shape = tuple[int, int]  # (T frames, L tokens)
_MILLI = 1000  # cost unit: 1/1000 frame (weights resolve to 0.001)
_MAX_SETTLE_ROUNDS = 32  # assign/shrink rounds; each one strictly lowers the cost, so a few suffice


@dataclass(frozen=True, slots=True)
class ShapeCost:
    """Integer cost of one padded row of shape (T, L), in milli-frames."""

    token_milli: int = _MILLI  # buckets.token_cost x 1000: one token position, in milli-frames
    attention_milli: int = 0  # buckets.attention_cost x 1000: one T x L cell, in milli-frames

    @classmethod
    def of(cls, token_cost: float, attention_cost: float) -> ShapeCost:
        return cls(int(round(token_cost * _MILLI)), int(round(attention_cost * _MILLI)))

    def row(
        self, frames: npt.NDArray[np.int64] | np.int64, tokens: npt.NDArray[np.int64] | np.int64
    ) -> npt.NDArray[np.int64]:
        """Cost of rows of T = ``frames`` and L = ``tokens`` (broadcast), int64 milli-frames."""
        return _MILLI * frames + self.token_milli * tokens + self.attention_milli * frames * tokens


def plan_grid(
    frames: npt.NDArray[np.int64],
    tokens: npt.NDArray[np.int64],
    max_shapes: int,
    frame_multiple: int,
    top_frames: int,
    cost: ShapeCost,
) -> tuple[Shape, ...]:
    """The planner's shapes (steps 1-3 of the module docstring) before ``finalise_shapes``.

    Args:
        frames: [n] frames of the utterances to plan (n >= 1); above ``top_frames`` counts as the top band.
        tokens: [n] tokens of the same utterances.
        max_shapes: the shape budget, >= 1.
        frame_multiple: every T is a multiple of this.
        top_frames: the largest T is this rounded up to ``frame_multiple``.
    """
    bounds, counts, position = frame_histogram(frames, frame_multiple, top_frames)
    table = split_table(bounds, counts, max_shapes)
    bands = sorted(
        {pair for k in range(1, len(table.costs) + 1) for pair in zip((0, *table.positions(k)), table.positions(k))}
    )
    splits = {band: _token_splits(tokens[(position > band[0]) & (position <= band[1])], max_shapes) for band in bands}
    band_cost = {
        band: [
            _band_cost(int(bounds[band[1] - 1]), n, token_sum, cost)
            for n, token_sum in zip(splits[band][0], splits[band][1])
        ]
        for band in bands
    }
    tiling = _best_tiling(bands, band_cost, int(bounds.size), max_shapes)
    return tuple(sorted((int(bounds[b - 1]), width) for (a, b), k in tiling for width in splits[(a, b)][2][k - 1]))


def _band_cost(t_frames: int, count: int, token_sum: int, cost: ShapeCost) -> int:
    """Cost of ``count`` rows of T frames whose token widths sum to ``token_sum``."""
    return _MILLI * t_frames * count + (cost.token_milli + cost.attention_milli * t_frames) * token_sum


def _token_splits(tokens: npt.NDArray[np.int64], max_k: int) -> tuple[list[int], list[int], list[tuple[int, ...]]]:
    """Per k = 1 ..: member count, least sum of token widths, and the widths (L values) themselves."""
    if tokens.size == 0:  # the forced top band may be empty: one placeholder shape, removed later
        return [0], [0], [(1,)]
    values, counts = np.unique(np.maximum(tokens, 1), return_counts=True)  # L >= 1 even for 0 tokens
    table = split_table(values.astype(np.int64), counts.astype(np.int64), max_k)
    widths = [tuple(int(values[p - 1]) for p in table.positions(k)) for k in range(1, len(table.costs) + 1)]
    return [int(tokens.size)] * len(widths), list(table.costs), widths


def _best_tiling(
    bands: list[tuple[int, int]], band_cost: dict[tuple[int, int], list[int]], last: int, budget: int
) -> list[tuple[tuple[int, int], int]]:
    """Bands covering positions 1..last and the sub-buckets of each, least total cost within ``budget``.

    best[(p, s)] = least cost covering positions <= p with s shapes; ties keep the first found.
    """
    best: dict[tuple[int, int], tuple[int, tuple[int, int] | None, int]] = {(0, 0): (0, None, 0)}
    # By end position: every band ending at a was settled before any band starting at a is tried.
    for a, b in sorted(bands, key=lambda band: (band[1], band[0])):
        for k, c in enumerate(band_cost[(a, b)], start=1):
            for s in range(k, budget + 1):
                prev = best.get((a, s - k))
                if prev is None:
                    continue
                total = prev[0] + c
                if total < best.get((b, s), (int(INF_COST), None, 0))[0]:
                    best[(b, s)] = (total, (a, b), k)
    finals = [(best[(last, s)][0], s) for s in range(1, budget + 1) if (last, s) in best]
    _, s = min(finals)
    out: list[tuple[tuple[int, int], int]] = []
    p = last
    while p:
        _, band, k = best[(p, s)]
        assert band is not None  # every (p, s) but (0, 0) was reached through a band
        out.append((band, k))
        p, s = band[0], s - k
    return out


def assign_cheapest(
    frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], shapes: tuple[Shape, ...], cost: ShapeCost
) -> npt.NDArray[np.int64]:
    """Index of each utterance's cheapest fitting shape (ties: the lowest index), -1 where none fits.

    ``frames`` should already be clipped to the top T where overlong utterances are truncated.
    """
    t = np.array([s[0] for s in shapes], dtype=np.int64)
    w = np.array([s[1] for s in shapes], dtype=np.int64)
    fits = (frames[:, None] <= t[None, :]) & (tokens[:, None] <= w[None, :])
    row = np.where(fits, cost.row(t, w)[None, :], INF_COST)
    out = np.argmin(row, axis=1).astype(np.int64)
    return np.where(fits.any(axis=1), out, -1)


def finalise_shapes(
    frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], shapes: tuple[Shape, ...], cost: ShapeCost
) -> tuple[tuple[Shape, ...], npt.NDArray[np.int64]]:
    """Settle a plan (step 4): cheapest fitting shape per utterance, no empty shape, each L its longest member.

    Args:
        frames: [n] frames, clipped to the top T; every utterance must fit some shape.
        tokens: [n] tokens.
        shapes: the candidate shapes.

    Returns:
        Sorted unique shapes and each utterance's index into them.
    """
    current = tuple(sorted(set(shapes)))
    for _ in range(_MAX_SETTLE_ROUNDS):
        assignment = assign_cheapest(frames, tokens, current, cost)
        if (assignment < 0).any():
            raise ValueError("an utterance fits no shape")
        longest = np.zeros(len(current), dtype=np.int64)
        np.maximum.at(longest, assignment, np.maximum(tokens, 1))
        settled = tuple(sorted({(t, int(longest[k])) for k, (t, _) in enumerate(current) if longest[k] > 0}))
        if settled == current:
            return current, assignment
        current = settled
    return current, assign_cheapest(frames, tokens, current, cost)  # fits: L only shrank to members


def plan_cost(frames_shape: npt.NDArray[np.int64], tokens_shape: npt.NDArray[np.int64], cost: ShapeCost) -> int:
    """Total cost (milli-frames) of rows whose shapes are (``frames_shape[i]``, ``tokens_shape[i]``)."""
    return int(cost.row(frames_shape, tokens_shape).sum())


def is_grid(cfg: BucketConfig) -> bool:
    """2-D shapes within ``max_shapes``: neither ``boundaries`` nor ``num_buckets`` set, and token widths
    free (``max_tokens`` unset: a fixed L leaves only frames to choose, the 1-D plan)."""
    return cfg.boundaries is None and cfg.num_buckets is None and cfg.max_tokens is None


def bucket_count(cfg: BucketConfig) -> int:
    """Most buckets of a derived plan: ``num_buckets`` when set, else the shape budget ``max_shapes``."""
    return cfg.num_buckets if cfg.num_buckets is not None else cfg.max_shapes


def top_frames(frames: npt.NDArray[np.int64], cfg: BucketConfig) -> int:
    """The largest derived T before rounding: min(max_frames, longest of ``frames``), at least 1."""
    longest = int(frames.max())
    return max(1, min(longest, cfg.max_frames) if cfg.max_frames is not None else longest)


def grid_slots(
    frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], considered: npt.NDArray[np.bool_], cfg: BucketConfig
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
    """The 2-D plan: each shape's T, each utterance's shape (-1 = left out) and the overlong count.

    Only ``considered`` utterances are planned; overlong ones (frames above the top T) are truncated
    into the top band or dropped (``overlong``). For each budget 1 .. ``max_shapes`` the 1-D plan with that
    many buckets, as built and settled, is also costed and the cheapest plan wins by ``epoch_cost`` (a tie
    keeps the 1-D plan as built, then the one with fewer shapes); of those, the plan with the fewest shapes
    within ``cost_tolerance`` of the least (``_fewest_shapes``).
    """
    m = cfg.frame_multiple
    top = top_frames(frames[considered], cfg)
    top_t = -(-top // m) * m
    over = considered & (frames > top_t)
    planned = considered & ~over if cfg.overlong == "drop" else considered
    if not planned.any():
        raise ConfigError("drops every utterance", path=("buckets", "max_frames"), got=top_t)
    f = np.minimum(frames[planned], top_t)
    t = tokens[planned]
    cost = ShapeCost.of(cfg.token_cost, cfg.attention_cost)

    def plan(budget: int) -> tuple[int, tuple[Shape, ...], npt.NDArray[np.int64]]:
        one_d = _one_d_plan(f, t, budget, m, top)
        plans = [one_d, finalise_shapes(f, t, one_d[0], cost)]
        if _is_within_int64(f, t, top_t, cost):
            plans.append(finalise_shapes(f, t, plan_grid(f, t, budget, m, top, cost), cost))
        scored = [(epoch_cost(f, t, p, cost, cfg), len(p[0]), p) for p in plans]
        total, _, (shapes, assigned) = min(scored, key=lambda x: (x[0], x[1]))
        return total, shapes, assigned

    _, shapes, assigned = _fewest_shapes([plan(b) for b in range(1, cfg.max_shapes + 1)], cfg.cost_tolerance)
    slot = np.full(frames.shape, -1, dtype=np.int64)
    slot[planned] = assigned
    return np.array([s[0] for s in shapes], dtype=np.int64), slot, int(over.sum())


def _fewest_shapes(
    plans: list[tuple[int, tuple[Shape, ...], npt.NDArray[np.int64]]], tolerance: float
) -> tuple[int, tuple[Shape, ...], npt.NDArray[np.int64]]:
    """Of ``plans`` (one per budget 1 .. max_shapes), the one with the fewest shapes whose epoch cost is within
    ``tolerance`` of the least: a shape is one compiled program, so one that saves less padding is not worth it
    (``tolerance`` 0: the least cost, fewest shapes on a tie). Integer arithmetic: every host agrees."""
    least = min(p[0] for p in plans)
    limit = least + least * round(tolerance * _MILLI) // _MILLI
    return min((p for p in plans if p[0] <= limit), key=lambda p: (len(p[1]), p[0]))


def epoch_cost(
    frames: npt.NDArray[np.int64],
    tokens: npt.NDArray[np.int64],
    plan: tuple[tuple[Shape, ...], npt.NDArray[np.int64]],
    cost: ShapeCost,
    cfg: BucketConfig,
) -> int:
    """A plan's cost over one epoch: every utterance's row, plus the padding rows of each shape's last batch
    (``batch_rows``; a small cache's many shapes mostly buy partial batches)."""
    shapes, assigned = plan
    counts = np.bincount(assigned, minlength=len(shapes))
    pad = sum(
        (-int(n) % batch_rows(cfg, shape[0])) * int(cost.row(np.int64(shape[0]), np.int64(shape[1])))
        for n, shape in zip(counts, shapes)
    )
    return _total(frames, tokens, plan, cost) + pad


def batch_rows(cfg: BucketConfig, frames: int) -> int:
    """Rows per batch of a shape of ``frames`` as planned: ``batch_size``, the frame budget's, else 1 (rows measured
    after planning, ``batch_size: auto`` or ``rows``: no partial-batch term)."""
    if isinstance(cfg.batch_size, int) and cfg.rows is None:
        return cfg.batch_size
    if cfg.frame_budget is not None:
        return max(1, cfg.frame_budget // frames)
    return 1


def _one_d_plan(
    frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], count: int, multiple: int, top: int
) -> tuple[tuple[Shape, ...], npt.NDArray[np.int64]]:
    """The frames-only 1-D plan with ``count`` buckets as ``build_buckets`` builds it: each utterance in the
    first frame band that holds it, each L the band's longest member; empty bands left out."""
    bounds = np.array(derive_boundaries(frames, count, multiple, top), dtype=np.int64)
    slot = np.searchsorted(bounds, frames, side="left")
    widths = np.zeros(bounds.size, dtype=np.int64)
    np.maximum.at(widths, slot, np.maximum(tokens, 1))
    occupied = np.flatnonzero(widths > 0)
    renumber = np.full(bounds.size, -1, dtype=np.int64)
    renumber[occupied] = np.arange(occupied.size)
    shapes = tuple((int(bounds[k]), int(widths[k])) for k in occupied)
    return shapes, renumber[slot]


def _total(
    frames: npt.NDArray[np.int64],
    tokens: npt.NDArray[np.int64],
    plan: tuple[tuple[Shape, ...], npt.NDArray[np.int64]],
    cost: ShapeCost,
) -> int:
    shapes, assigned = plan
    t = np.array([s[0] for s in shapes], dtype=np.int64)
    w = np.array([s[1] for s in shapes], dtype=np.int64)
    return plan_cost(t[assigned], w[assigned], cost)


def _is_within_int64(frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], top_t: int, cost: ShapeCost) -> bool:
    """Whether a whole plan's cost fits int64 with room (absurd lengths: only the 1-D plan is kept)."""
    widest = max(1, int(tokens.max(initial=1)))
    return int(cost.row(np.int64(top_t), np.int64(widest))) * max(1, frames.size) < int(INF_COST) // 4
