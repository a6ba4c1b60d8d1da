"""How many rows a bucket gets under ``buckets.batch_size: auto``: the search rules, free of TensorFlow and clocks.

Role: a trial runs the compiled step at some rows and reports its median seconds per step, its peak device memory
(GPU) or that it did not fit (out of memory); the rules here decide which rows to try next and which to keep.
``fastest_rows`` (any device): rows 1, 2, 4, ... up to the cap, stopping once throughput (rows per second; the
bucket's frames per row are fixed) has fallen below the best for ``_PATIENCE`` sizes in a row, or once a step takes
``_LONG_STEP_S`` (its fixed cost per step is amortised: the bound on the search's cost); the choice is the
smallest tried rows that reach ``share`` (0.95) of the best throughput. ``largest_fitting_rows`` (a GPU): double
while the peak stays under the limit, then bisect between the last fit and the first miss until they are within
``tolerance`` (5 %) of each other; the choice is the largest that fit. Every rows count is a multiple of ``unit``
(the model replicas: each takes an equal share).
Invariants: pure and deterministic given the trials' answers; at most log2(cap / unit) + 1 trials to bracket and
log2 of the bracket's width to bisect; a bucket whose smallest rows do not fit yields ``rows`` 0.
Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RowsChoice", "Trial", "candidate_rows", "fastest_rows", "largest_fitting_rows", "pick_fastest"]

_PATIENCE = 2  # sizes in a row below the best throughput before doubling stops (one slow trial is noise)
# A step this long has amortised its fixed cost per step (dispatch, host sync: milliseconds) to well under 1 %, so
# doubling again buys almost nothing and costs the longest trials of the search: doubling stops there.
_LONG_STEP_S = 1.0


@dataclass(frozen=True, slots=True)
class Trial:
    """The compiled step at ``rows``: median seconds per step (None: not timed) and peak bytes (None: not measured)."""

    rows: int
    fits: bool
    step_s: float | None = None
    peak_bytes: int | None = None

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.step_s if self.fits and self.step_s else 0.0


@dataclass(frozen=True, slots=True)
class RowsChoice:
    """The rows kept for one bucket (0: none fits), the trials that chose them and the rule used."""

    rows: int
    trials: tuple[Trial, ...]
    rule: str  # "throughput" or "memory"

    @property
    def largest_fitting(self) -> int:
        """The most rows a trial saw fit (0: none)."""
        return max((t.rows for t in self.trials if t.fits), default=0)


def candidate_rows(cap_rows: int, unit: int = 1, start: int | None = None) -> list[int]:
    """``start`` (default ``unit``), twice that, four times, ... below ``cap_rows``, then the cap itself rounded down
    to ``unit`` (at least ``unit``); ``start`` is a multiple of ``unit``."""
    if unit < 1 or cap_rows < 1:
        raise ValueError("cap_rows and unit must be >= 1")
    cap = max(unit, cap_rows // unit * unit)
    out, rows = [], start or unit
    while rows < cap:
        out.append(rows)
        rows *= 2
    return [*out, cap]


def pick_fastest(trials: list[Trial], share: float = 0.95) -> int:
    """The smallest rows among ``trials`` whose throughput reaches ``share`` of the best (0: none fit)."""
    best = max((t.rows_per_s for t in trials), default=0.0)
    if best <= 0.0:
        return 0
    return min(t.rows for t in trials if t.rows_per_s >= share * best)


def fastest_rows(
    trial: Callable[[int], Trial], cap_rows: int, unit: int = 1, share: float = 0.95, long_step_s: float = _LONG_STEP_S
) -> RowsChoice:
    """Double the rows while throughput still grows (or has fallen behind the best fewer than ``_PATIENCE`` times);
    stop at the cap, at the first trial that does not fit, or after a step of ``long_step_s`` or more; keep
    ``pick_fastest``."""
    trials: list[Trial] = []
    best, behind = 0.0, 0
    for rows in candidate_rows(cap_rows, unit):
        t = trial(rows)
        trials.append(t)
        if not t.fits or (t.step_s or 0.0) >= long_step_s:
            break
        if t.rows_per_s > best:
            best, behind = t.rows_per_s, 0
        else:
            behind += 1
            if behind >= _PATIENCE:
                break
    return RowsChoice(pick_fastest(trials, share), tuple(trials), "throughput")


def largest_fitting_rows(
    trial: Callable[[int], Trial],
    cap_rows: int,
    limit_bytes: int,
    unit: int = 1,
    tolerance: float = 0.05,
    known_fit: int = 0,
) -> RowsChoice:
    """The most rows (a multiple of ``unit``, at most the cap) whose trial fits with a peak under ``limit_bytes``.

    ``known_fit``: rows known to fit without a trial (a longer bucket's choice: a shorter one needs less memory
    per row); doubling starts above it.
    """
    trials: list[Trial] = []

    def fits(rows: int) -> bool:
        t = trial(rows)
        trials.append(t)
        return t.fits and (t.peak_bytes is None or t.peak_bytes <= limit_bytes)

    low, high = known_fit, None  # the largest rows seen to fit, the smallest seen not to (None: none yet)
    sizes = candidate_rows(cap_rows, unit, start=2 * known_fit) if known_fit else candidate_rows(cap_rows, unit)
    for rows in (r for r in sizes if r > known_fit):
        if not fits(rows):
            high = rows
            break
        low = rows
    while high is not None and low > 0 and high - low > unit and high > low * (1 + tolerance):
        mid = (low + high) // 2 // unit * unit
        if fits(mid):
            low = mid
        else:
            high = mid
    return RowsChoice(low, tuple(trials), "memory")
