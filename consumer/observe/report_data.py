"""Metrics JSONL (the consumer's ``--metrics-file``) -> columns for ``melfeed report``.

Role: pure parsing, no drawing and no matplotlib. ``read_metrics`` reads one snapshot object per
line (format: the metrics snapshot, observe/snapshot.py; docs/guide/watching.md) and turns it into
``RunSeries``: one float array per figure, aligned on ``t_s`` (seconds since the first snapshot).
Invariants:
- Every array has one entry per snapshot; ``null`` becomes ``nan`` so a plot shows a gap, never a
  made-up zero. A producer absent from a snapshot (joined late, left early) is ``nan`` there too.
- GPU series are keyed ``"role:index"`` (``model:0``, ``data:1``) in first-seen order.
- Bad input raises ``ConfigError`` naming ``FILE:LINE`` (one line; the CLI exits 78): a line that is
  not JSON (nesting too deep included), not a snapshot (a field of the schema missing), or whose ``t_unix_s``
  or a numeric field is not a finite number (or null).
  The one exception is an unparseable LAST line, which a run killed mid-write leaves behind: it is
  skipped with a warning.
- The file is read like a config file (``shared/flag_checks.py``): a regular file (a FIFO or
  ``/dev/zero`` is refused, never waited on) of at most ``MAX_METRICS_BYTES``.
Shutdown: nothing to shut down; the file is closed before returning.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.consumer.observe.snapshot import field_names, number_fields
from melfeed.shared.errors import ConfigError
from melfeed.shared.flag_checks import read_regular_file
from melfeed.shared.metrics import PHASE_TRAINING

__all__ = ["RunSeries", "RunTotals", "read_metrics", "parse_lines", "SCALAR_KEYS", "MAX_METRICS_BYTES"]

log = logging.getLogger(__name__)

Floats = npt.NDArray[np.float64]

# ~1.1 KB a snapshot with two producers: about two weeks at the default 5 s status interval. Parsing
# takes several times the file's size in memory; thin a longer run's file first (docs/guide/watching.md).
MAX_METRICS_BYTES = 256 << 20

# The snapshot's numeric fields, one column each (the time axis aside); the report draws some of them.
SCALAR_KEYS = tuple(name for name in number_fields() if name != "t_unix_s")
_LIST_KEYS = ("producers", "gpus")  # the rows read here: producers' batches/s, GPUs' utilisation


@dataclass(frozen=True, slots=True)
class RunTotals:
    """Whole-run figures for the title. ``nan`` when no snapshot had the figure."""

    steps: int  # the last known step count
    batches_per_s_mean: float  # mean of the window rates over "training" snapshots (all, if none)
    stall_pct_mean: float  # same averaging as batches_per_s_mean
    duration_s: float  # first to last snapshot


@dataclass(slots=True)
class RunSeries:
    """One entry per snapshot in every array; ``nan`` = unknown (drawn as a gap)."""

    t_s: Floats  # seconds since the first snapshot's t_unix_s
    phase: list[str]
    scalars: dict[str, Floats]  # SCALAR_KEYS -> values
    producers: dict[str, Floats] = field(default_factory=dict)  # producer id -> batches/s
    gpus: dict[str, Floats] = field(default_factory=dict)  # "role:index" -> util %
    t0_unix_s: float = 0.0  # wall clock of the first snapshot (aligns several runs)
    rank: int | None = None  # the consumer's rank when it was one of a job (world > 1)

    def __len__(self) -> int:
        return len(self.t_s)

    def totals(self) -> RunTotals:
        """Steps, mean batches/s and mean stall % of the run (for the title)."""
        training = np.array([p == PHASE_TRAINING for p in self.phase])
        pick = training if training.any() else np.ones(len(self), dtype=bool)
        steps = self.scalars["step"][~np.isnan(self.scalars["step"])]
        return RunTotals(
            steps=int(steps[-1]) if steps.size else 0,
            batches_per_s_mean=_nanmean(self.scalars["batches_per_s"][pick]),
            stall_pct_mean=_nanmean(self.scalars["stall_pct"][pick]),
            duration_s=float(self.t_s[-1]) if len(self) else 0.0,
        )


def _nanmean(values: Floats) -> float:
    known = values[~np.isnan(values)]
    return float(known.mean()) if known.size else math.nan


def _number(value: Any, key: str, where: str) -> float:
    if value is None:
        return math.nan
    number = _finite(value)
    if number is None:  # the consumer writes with allow_nan=False: NaN or Infinity never come from it
        raise ConfigError(f"{key} must be a finite number or null", path=(where,), got=value)
    return number


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` (not a number, NaN, Infinity, an int past a float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _check_snapshot(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ConfigError("not a JSON object (one metrics snapshot per line)", path=(where,))
    missing = [k for k in field_names() if k not in obj]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""  # one short line
        raise ConfigError(
            f"missing key{'s' if len(missing) > 1 else ''} {', '.join(missing[:3])}{more} "
            "(not a melfeed metrics snapshot?)",
            path=(where,),
        )
    if _finite(obj["t_unix_s"]) is None:
        raise ConfigError("t_unix_s must be a finite number", path=(where,), got=obj["t_unix_s"])
    for key in _LIST_KEYS:
        if not isinstance(obj[key], list) or not all(isinstance(e, dict) for e in obj[key]):
            raise ConfigError(f"{key} must be a list of objects", path=(where,), got=obj[key])
    return obj


def _decode(lines: list[str], name: str) -> list[tuple[str, dict[str, Any]]]:
    """(``FILE:LINE``, snapshot) per non-blank line; an unparseable last line is skipped with a warning."""
    numbered = [(i + 1, text) for i, text in enumerate(lines) if text.strip()]
    out: list[tuple[str, dict[str, Any]]] = []
    for pos, (number, text) in enumerate(numbered):
        where = f"{name}:{number}"
        try:
            obj = json.loads(text)
        except RecursionError:
            raise ConfigError("not JSON (nested too deeply)", path=(where,)) from None
        except ValueError as err:
            if pos == len(numbered) - 1 and pos > 0:
                log.warning("%s: skipping a truncated last line (a run stopped mid-write?): %s", where, err)
                continue
            raise ConfigError(f"not JSON ({err})", path=(where,)) from None
        out.append((where, _check_snapshot(obj, where)))
    return out


def _entity_series(
    rows: list[dict[str, Any]],
    n: int,
    key: str,
    value_key: str,
    name_of: Callable[[dict[str, Any], str], str],
    where: list[str],
) -> dict[str, Floats]:
    """One array per entity (producer or GPU) across the snapshots; ``nan`` where it is absent."""
    series: dict[str, Floats] = {}
    for i, row in enumerate(rows):
        for entry in row[key]:
            label = name_of(entry, where[i])
            column = series.setdefault(label, np.full(n, np.nan))
            column[i] = _number(entry.get(value_key), f"{key}[].{value_key}", where[i])
    return series


def _producer_id(entry: dict[str, Any], where: str) -> str:
    producer_id = entry.get("id")
    if not isinstance(producer_id, str):
        raise ConfigError("producers[].id must be a string", path=(where,), got=producer_id)
    return producer_id


def _gpu_label(entry: dict[str, Any], where: str) -> str:
    role, index = entry.get("role"), entry.get("index")
    if not isinstance(role, str) or isinstance(index, bool) or not isinstance(index, int):
        raise ConfigError("gpus[] needs a string role and an integer index", path=(where,), got=entry)
    return f"{role}:{index}"


def parse_lines(lines: list[str], name: str) -> RunSeries:
    """Columns from the text lines of a metrics JSONL file called ``name`` (used in messages).

    Raises:
        ConfigError: No snapshot, or a line that is not a snapshot (names ``name:LINE``).
    """
    decoded = _decode(lines, name)
    if not decoded:
        raise ConfigError("empty: no metrics snapshots", path=(name,))
    where = [w for w, _ in decoded]
    rows = [obj for _, obj in decoded]
    n = len(rows)
    t_unix = np.array([_number(r["t_unix_s"], "t_unix_s", w) for w, r in decoded])
    scalars = {k: np.array([_number(r[k], k, w) for w, r in decoded]) for k in SCALAR_KEYS}
    last = rows[-1]
    world, rank = last.get("world"), last.get("rank")
    is_rank = type(world) is int and world > 1 and type(rank) is int
    with np.errstate(over="ignore"):
        t_s = t_unix - t_unix[0]
    far = np.flatnonzero(~np.isfinite(t_s))
    if far.size:  # e.g. 1e308 after -1e308: no time axis can hold both
        raise ConfigError("t_unix_s is too far from the first snapshot's", path=(where[far[0]],))
    return RunSeries(
        t_s=t_s,
        phase=[str(r["phase"]) for r in rows],
        scalars=scalars,
        producers=_entity_series(rows, n, "producers", "batches_per_s", _producer_id, where),
        gpus=_entity_series(rows, n, "gpus", "util_pct", _gpu_label, where),
        t0_unix_s=float(t_unix[0]),
        rank=rank if is_rank else None,
    )


def read_metrics(path: str | Path) -> RunSeries:
    """Read a metrics JSONL file.

    Raises:
        ConfigError: The file is missing, unreadable, not a regular file, larger than ``MAX_METRICS_BYTES``,
            empty, or has a bad line (``FILE:LINE``).
    """
    data = read_regular_file(path, MAX_METRICS_BYTES, "metrics file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"cannot read metrics file: not UTF-8 at byte offset {err.start}", path=(str(path),)
        ) from None
    return parse_lines(text.splitlines(), str(path))
