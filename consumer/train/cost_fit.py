"""``buckets.cost: measured``'s arithmetic, free of TensorFlow and clocks: the shapes to time and the weights
their times give.

Role: ``probe_shapes`` picks five (T, L) shapes spanning the cache's planned lengths: the corners of the box from a
short corner to the longest frames and tokens, and its centre, each holding real utterances that fit it (the step
runs on real values: a model that asserts positive lengths must not fail on the probes). ``fit_weights`` fits the
step's median seconds at those shapes to the planner's row cost (shared/wire/grid.py), in frames:

    seconds = fixed + k * rows * (T + token_cost * L + attention_cost * T * L)

a linear least-squares fit in (fixed, k, k * token_cost, k * attention_cost) with the last three >= 0 (every
subset of them is fitted, the best non-negative fit kept), then ``token_cost`` and ``attention_cost`` rounded to
the planner's 0.001 steps within the ranges the config allows.
Invariants: pure and deterministic; a step whose time grows with the tokens far more than with the frames gets
weights at the top of their ranges, in proportion; a fit in which nothing grows with the shape (the fixed cost per
step dominates) gives no weights, and the caller keeps the formula's.
Shutdown: nothing to release.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Fit", "Probe", "fit_weights", "probe_shapes", "probe_rows"]

_SHORT_QUANTILE = 0.3  # the short corner's frames: this quantile of the planned utterances' frames
_MAX_TOKEN_COST = 1000.0  # buckets.token_cost's range (shared/config/checks.py)
_MAX_ATTENTION_COST = 1.0  # buckets.attention_cost's range
_MILLI = 1000  # the planner's weights are integer milli-frames (grid.ShapeCost)


@dataclass(frozen=True, slots=True)
class Probe:
    """One shape to time: ``frames`` T x ``tokens`` L, and the utterances (manifest indices) that fit it."""

    frames: int
    tokens: int
    samples: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Fit:
    """The weights (None: the time does not grow with the shape) and how well the model explains the times."""

    token_cost: float | None
    attention_cost: float | None
    worst_error: float  # the largest |fitted - measured| / measured over the probes


def probe_shapes(
    frames: npt.NDArray[np.integer], tokens: npt.NDArray[np.integer], frame_multiple: int
) -> list[Probe] | None:
    """Five probes over the planned utterances' ``frames`` and ``tokens`` (already capped at the plan's longest;
    manifest indices are positions in these arrays, -1 lengths = left out), or None when the lengths span a single
    T x L cell (every weight gives the same one shape: nothing to measure)."""
    index = np.flatnonzero(frames >= 0)
    f = np.asarray(frames, dtype=np.int64)[index]
    t = np.asarray(tokens, dtype=np.int64)[index]
    if f.size == 0:
        return None
    m = frame_multiple
    t_hi_frames = _round_up(int(f.max()), m)
    t_lo_frames = max(_round_up(int(np.quantile(f, _SHORT_QUANTILE, method="lower")), m), _round_up(int(f.min()), m))
    l_hi = int(t.max())
    short = f <= t_lo_frames
    l_lo = int(np.quantile(t[short], 0.5, method="lower"))
    if t_lo_frames >= t_hi_frames or l_lo >= l_hi:
        return None
    t_mid = _round_up((t_lo_frames + t_hi_frames) // 2, m)
    l_mid = (l_lo + l_hi) // 2
    corners = [
        (t_lo_frames, l_lo),
        (t_hi_frames, l_lo),
        (t_lo_frames, l_hi),
        (t_hi_frames, l_hi),
        (t_mid, l_mid),
    ]
    return [Probe(T, L, _fitting(index, f, t, T, L)) for T, L in corners]


def probe_rows(frames: int, batch_size: int | str | None, frame_budget: int | None, cap_rows: int, unit: int) -> int:
    """A probe's rows: ``batch_size`` when fixed, the frame budget's rows at ``frames``, or under ``auto`` the
    config's default 32 (within ``cap_rows``); a multiple of ``unit`` (the model replicas), at least ``unit``."""
    if isinstance(batch_size, int):
        rows = batch_size
    elif frame_budget is not None:
        rows = max(1, frame_budget // frames)
    else:
        rows = min(32, cap_rows)
    return max(unit, rows // unit * unit)


def fit_weights(probes: Sequence[tuple[int, int, int, float]]) -> Fit:
    """The weights from ``(frames, tokens, rows, seconds)`` per probe (see the module docstring)."""
    x = np.array([[1.0, r * T, r * L, r * T * L] for T, L, r, _ in probes], dtype=np.float64)
    y = np.array([s for *_, s in probes], dtype=np.float64)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    best: tuple[float, npt.NDArray[np.float64]] | None = None
    for size in range(4):
        for chosen in itertools.combinations((1, 2, 3), size):
            columns = [0, *chosen]
            solved, *_ = np.linalg.lstsq(x[:, columns] / scale[columns], y, rcond=None)
            coef = np.zeros(4)
            coef[columns] = solved / scale[columns]
            if (coef[1:] < 0).any():
                continue
            residual = float(np.sum((x @ coef - y) ** 2))
            if best is None or residual < best[0] - 1e-18:
                best = (residual, coef)
    assert best is not None  # the intercept alone is always a valid fit
    coef = best[1]
    worst = float(np.max(np.abs(x @ coef - y) / np.maximum(y, 1e-12)))
    # One frame's cost, at least what keeps both weights within their ranges: a step whose time grows with the
    # tokens alone gets the largest token_cost, its attention weight in proportion.
    frame = max(coef[1], coef[2] / _MAX_TOKEN_COST, coef[3] / _MAX_ATTENTION_COST)
    if not frame > 0 or not math.isfinite(frame):
        return Fit(None, None, worst)
    return Fit(_milli(coef[2] / frame), _milli(coef[3] / frame), worst)


def _fitting(
    index: npt.NDArray[np.int64], f: npt.NDArray[np.int64], t: npt.NDArray[np.int64], frames: int, tokens: int
) -> tuple[int, ...]:
    """The utterances that fit ``frames`` x ``tokens``, longest frames first (a probe runs on the longest)."""
    fits = (f <= frames) & (t <= tokens)
    chosen = np.flatnonzero(fits)
    chosen = chosen[np.argsort(-f[chosen], kind="stable")]
    return tuple(int(i) for i in index[chosen])


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def _milli(value: float) -> float:
    return round(max(0.0, value) * _MILLI) / _MILLI
