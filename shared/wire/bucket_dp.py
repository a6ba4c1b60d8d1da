"""Exact 1-D bucket splits: the dynamic programme behind frame boundaries and token sub-buckets.

Role: given sorted candidate bounds with a count of items at each (a length histogram), find for
every k the k upper bounds that minimise the sum over items of the bound they land in (each item
lands in the first bound >= its length). ``derive_boundaries`` applies it to frames; the 2-D planner
(``shared/wire/grid.py``) also applies it to the tokens of one frame band.

Invariants:
    * Integer arithmetic only, so every host computes the same bounds; ties resolve to the
      lowest-index split.
    * The cost with k bounds never exceeds the cost with k - 1 (a split never adds padding).
Shutdown: nothing to release; pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["INF_COST", "SplitTable", "split_table", "frame_histogram", "derive_boundaries", "as_lengths"]

INF_COST = np.int64(1) << np.int64(62)  # > any real padded total; INF + cost stays < 2**63
_DP_CHUNK_CELLS = 1 << 22  # bounds one DP layer's scratch matrix to ~32 MiB of int64


def as_lengths(values: npt.ArrayLike, name: str) -> npt.NDArray[np.int64]:
    """``values`` as a 1-D int64 array of non-negative lengths, or ValueError naming ``name``."""
    arr = np.asarray(values)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1 or (arr.size and arr.min() < 0):
        raise ValueError(f"{name} must be a 1-D array of non-negative lengths")
    return arr


@dataclass(frozen=True, slots=True)
class SplitTable:
    """The optimal splits of one histogram for k = 1 .. len(costs) bounds.

    ``costs[k - 1]`` is the least sum of bounds with k of them (the last bound is always the
    largest candidate); ``positions(k)`` names the chosen candidates (1-based, increasing).
    """

    costs: tuple[int, ...]
    choices: tuple[npt.NDArray[np.int64], ...]  # per layer: best predecessor of each position

    def positions(self, k: int) -> tuple[int, ...]:
        """Candidate positions (1-based, increasing) of the optimal split into ``k`` bounds."""
        if not 1 <= k <= len(self.costs):
            raise ValueError(f"k must be in 1..{len(self.costs)}, got {k}")
        j = int(self.choices[0].size - 1)
        out: list[int] = []
        for arg in reversed(self.choices[:k]):
            out.append(j)
            j = int(arg[j])
        return tuple(reversed(out))


def split_table(bounds: npt.NDArray[np.int64], counts: npt.NDArray[np.int64], max_k: int) -> SplitTable:
    """Optimal splits of a histogram into 1 .. min(max_k, len(bounds)) buckets.

    Args:
        bounds: [n] strictly increasing candidate bounds, n >= 1.
        counts: [n] items at each candidate, >= 0.
        max_k: most buckets, >= 1.

    Returns:
        The table; O(k * n**2) vectorised integer steps.
    """
    if bounds.size < 1 or bounds.shape != counts.shape or max_k < 1:
        raise ValueError("bounds and counts must be equally long and non-empty; max_k >= 1")
    bound = np.concatenate(([0], bounds)).astype(np.int64)  # 1-based like cum
    cum = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    n = bounds.size
    best = np.full(n + 1, INF_COST, dtype=np.int64)
    best[0] = 0
    costs: list[int] = []
    choices: list[npt.NDArray[np.int64]] = []
    for _ in range(min(max_k, n)):
        best, arg = _dp_layer(best, bound, cum)
        costs.append(int(best[n]))
        choices.append(arg)
    return SplitTable(tuple(costs), tuple(choices))


def _dp_layer(
    prev: npt.NDArray[np.int64], bound: npt.NDArray[np.int64], cum: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One more bucket: new[j] = min over i < j of prev[i] + bound[j] * (cum[j] - cum[i])."""
    size = prev.size
    new = np.full(size, INF_COST, dtype=np.int64)
    arg = np.zeros(size, dtype=np.int64)
    i = np.arange(size)
    rows = max(1, _DP_CHUNK_CELLS // size)
    for start in range(1, size, rows):
        j = np.arange(start, min(size, start + rows))
        cost = prev[None, :] + bound[j, None] * (cum[j, None] - cum[None, :])
        cost = np.where((i[None, :] < j[:, None]) & (prev[None, :] < INF_COST), cost, INF_COST)
        arg[j] = np.argmin(cost, axis=1)
        new[j] = cost[np.arange(j.size), arg[j]]
    return new, arg


def frame_histogram(
    lengths: npt.NDArray[np.int64], frame_multiple: int, max_frames: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Candidate frame bounds (occupied multiples of ``frame_multiple`` plus the forced last one),
    the count at each, and each utterance's candidate position (1-based; overlong ones: the last)."""
    top = -(-max_frames // frame_multiple)  # candidate k means bound k * frame_multiple
    slot = np.clip(-(-lengths // frame_multiple), 1, top)
    counts = np.bincount(slot, minlength=top + 1)
    cand = np.flatnonzero(counts)  # slot 0 is never used, so every entry is >= 1
    if cand.size == 0 or cand[-1] != top:
        cand = np.append(cand, top)
    position = np.searchsorted(cand, slot) + 1
    return (cand * frame_multiple).astype(np.int64), counts[cand].astype(np.int64), position.astype(np.int64)


def derive_boundaries(
    frames: npt.NDArray[np.integer], num_buckets: int, frame_multiple: int, max_frames: int
) -> tuple[int, ...]:
    """Choose bucket upper bounds that minimise the total padded frames of one epoch.

    Cost = sum over utterances of the bound of the bucket they land in (batch padding rows are
    ignored). Candidate bounds are multiples of ``frame_multiple``; an exact dynamic programme over
    the candidates that hold at least one utterance (plus the forced last bound) finds the optimum in
    O(num_buckets * candidates**2) vectorised steps. Utterances above ``max_frames`` count as
    members of the last bucket (they are truncated or dropped later; their cost is then constant).

    Args:
        frames: [num_utterances] frames per utterance, >= 0.
        num_buckets: most buckets to return, >= 1.
        frame_multiple: every bound is a multiple of this, >= 1.
        max_frames: the last bound is this rounded up to ``frame_multiple``, >= 1.

    Returns:
        Strictly increasing bounds in frames, at most ``num_buckets`` of them; fewer when fewer
        distinct candidates are occupied. Ties resolve to the lowest-index split (deterministic).

    Raises:
        ValueError: a bad argument.
    """
    lengths = as_lengths(frames, "frames")
    if num_buckets < 1 or frame_multiple < 1 or max_frames < 1:
        raise ValueError("num_buckets, frame_multiple and max_frames must be >= 1")
    bounds, counts, _ = frame_histogram(lengths, frame_multiple, max_frames)
    table = split_table(bounds, counts, num_buckets)  # one more bucket never costs more: use all that exist
    return tuple(int(bounds[p - 1]) for p in table.positions(len(table.costs)))
