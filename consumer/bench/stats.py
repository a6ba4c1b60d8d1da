"""Pure arithmetic of ``melfeed bench``: medians per system, ratios, goals, calibration, tables.

Role: everything the benchmark concludes from its raw trial numbers, with no clock, process or
TensorFlow, so tests can check it with hand-made numbers. A trial is a flat JSON-able dict
(``system``, ``kind``, ``round``, ``step_ms``, ``ok`` and the measured figures named in ``METRICS``);
``step_ms == 0`` is the max-rate trial (zero-cost step), others model device time.
Invariants: a median is taken only over trials that finished (``ok``) and reported a finite value;
a ratio is ``None`` whenever either side is missing or the baseline is 0, never a made-up number.
Shutdown: nothing to release.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "METRICS",
    "Goal",
    "median",
    "medians_by_system",
    "best_system",
    "ratios",
    "evaluate_goals",
    "transport_goals",
    "build_goal",
    "sleep_for_step_s",
    "demand_per_s",
    "gb_per_s",
    "format_table",
]

# Figures each trial reports (None where a system cannot measure one).
METRICS = (
    "batches_per_s",
    "stall_pct",
    "trainer_cpu_ms_per_batch",
    "total_cpu_ms_per_batch",
    "trainer_rss_mb",
    "total_rss_mb",
    "payload_copies",
)
_CAPACITY_FACTOR = 1.2  # the stall goal applies when capacity >= this x the step's demand
_STALL_GOAL_PCT = 1.0
_RATE_GOAL = 1.5  # melfeed max rate >= this x the best tuned tf.data
_TRAINER_CPU_GOAL = 0.35  # melfeed trainer CPU per batch <= this x tuned tf.data's
_COPY_GOALS = {"shm": 1.0, "zmq": 3.0, "tcp": 3.0}  # payload copies per batch, at most
# Toward the memory-bandwidth limit, 1 producer (docs/performance.md "Method"): transport -> (rate x, CPU x).
# The payload path's pair (ipc or tcp under CURVE) equals the general goals above; shared memory's is stricter.
_ONE_PRODUCER_GOALS = {
    "shm": (2.5, 0.1),
    "zmq": (_RATE_GOAL, _TRAINER_CPU_GOAL),
    "tcp": (_RATE_GOAL, _TRAINER_CPU_GOAL),
}
_MEMCPY_GOAL = 0.5  # shared-memory transport GB/s >= this x memcpy GB/s (same trial)
_BUILD_CPU_GOAL_MS = 1.3  # producer CPU per batch built (doctor's stage 1), at most


def median(values: Iterable[float | None]) -> float | None:
    """Median of the finite values (mean of the middle two for an even count); None if there are none."""
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def medians_by_system(
    trials: Sequence[Mapping[str, Any]], metrics: Sequence[str] = METRICS
) -> dict[str, dict[int, dict[str, float | None]]]:
    """``{system: {step_ms: {metric: median over rounds, "trials": count}}}`` over the trials that finished."""
    grouped: dict[str, dict[int, list[Mapping[str, Any]]]] = {}
    for t in trials:
        if t.get("ok"):
            grouped.setdefault(str(t["system"]), {}).setdefault(int(t["step_ms"]), []).append(t)
    return {
        system: {
            step: {m: median(t.get(m) for t in ts) for m in metrics} | {"trials": float(len(ts))}
            for step, ts in sorted(by_step.items())
        }
        for system, by_step in grouped.items()
    }


def best_system(meds: Mapping[str, Mapping[int, Mapping[str, float | None]]], systems: Iterable[str]) -> str | None:
    """Among ``systems``, the one with the highest median max rate (step_ms 0); None if none ran."""
    rates = {s: meds.get(s, {}).get(0, {}).get("batches_per_s") for s in systems}
    ranked = [(r, s) for s, r in rates.items() if r is not None]
    return max(ranked)[1] if ranked else None


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def ratios(
    meds: Mapping[str, Mapping[int, Mapping[str, float | None]]], baseline: str | None
) -> dict[str, dict[int, dict[str, float | None]]]:
    """Every median divided by the baseline system's median for the same step cost and metric."""
    base = meds.get(baseline or "", {})
    return {
        system: {
            step: {m: _ratio(v, base.get(step, {}).get(m)) for m, v in figs.items() if m in METRICS}
            for step, figs in by_step.items()
        }
        for system, by_step in meds.items()
    }


def sleep_for_step_s(step_ms: float, zero_step_s: float) -> float:
    """Sleep after the compiled zero-cost step so one step takes ``step_ms`` in total (never negative)."""
    return max(0.0, step_ms / 1000.0 - zero_step_s)


def demand_per_s(step_ms: float) -> float:
    """Batches per second a step of ``step_ms`` consumes (infinite for the zero-cost step)."""
    return math.inf if step_ms <= 0 else 1000.0 / step_ms


def gb_per_s(nbytes: float, seconds: float) -> float | None:
    """Decimal GB/s, None for an empty interval."""
    return nbytes / seconds / 1e9 if seconds > 0 else None


@dataclass(frozen=True, slots=True)
class Goal:
    """One goal of the brief, evaluated on medians: ``passed`` None means it could not be evaluated."""

    name: str
    system: str
    passed: bool | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[self.passed]
        return f"{verdict}  {self.name} [{self.system}]: {self.detail}"


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def evaluate_goals(
    meds: Mapping[str, Mapping[int, Mapping[str, float | None]]], melfeed: Mapping[str, str], baseline: str | None
) -> list[Goal]:
    """The four goals for each melfeed system (``melfeed`` maps system name -> transport)."""
    base = meds.get(baseline or "", {}).get(0, {})
    base_rate, base_cpu = base.get("batches_per_s"), base.get("trainer_cpu_ms_per_batch")
    goals: list[Goal] = []
    for system, transport in melfeed.items():
        by_step = meds.get(system)
        if not by_step:
            goals.append(Goal("runs", system, None, "no finished trial"))
            continue
        top = by_step.get(0, {})
        rate, cpu = top.get("batches_per_s"), top.get("trainer_cpu_ms_per_batch")
        r = _ratio(rate, base_rate)
        goals.append(
            Goal(
                f"max rate >= {_RATE_GOAL} x {baseline}",
                system,
                None if r is None else r >= _RATE_GOAL,
                f"{_fmt(rate)} vs {_fmt(base_rate)} batches/s = {_fmt(r, '.2f')}x",
            )
        )
        c = _ratio(cpu, base_cpu)
        goals.append(
            Goal(
                f"trainer CPU/batch <= {_TRAINER_CPU_GOAL} x {baseline}",
                system,
                None if c is None else c <= _TRAINER_CPU_GOAL,
                f"{_fmt(cpu, '.2f')} vs {_fmt(base_cpu, '.2f')} ms = {_fmt(c, '.2f')}x",
            )
        )
        for step_ms, figs in by_step.items():
            if step_ms > 0:
                goals.append(_stall_goal(system, step_ms, rate, figs.get("stall_pct")))
        copies = top.get("payload_copies")
        limit = _COPY_GOALS.get(transport)
        goals.append(
            Goal(
                f"payload copies <= {limit:g} on {transport}" if limit else "payload copies",
                system,
                None if copies is None or limit is None else copies <= limit,
                f"{_fmt(copies, '.2f')}",
            )
        )
        strict = _ONE_PRODUCER_GOALS.get(transport)
        if strict is not None and system.endswith("-p1") and strict != (_RATE_GOAL, _TRAINER_CPU_GOAL):
            goals.append(
                Goal(
                    f"1 producer: max rate >= {strict[0]} x {baseline}",
                    system,
                    None if r is None else r >= strict[0],
                    f"{_fmt(r, '.2f')}x",
                )
            )
            goals.append(
                Goal(
                    f"1 producer: trainer CPU/batch <= {strict[1]} x {baseline}",
                    system,
                    None if c is None else c <= strict[1],
                    f"{_fmt(c, '.2f')}x",
                )
            )
    return goals


def transport_goals(meds: Mapping[str, Mapping[int, Mapping[str, float | None]]]) -> list[Goal]:
    """Shared-memory transport GB/s against memcpy GB/s measured in the same trials (medians)."""
    goals = []
    for system, by_step in meds.items():
        if not system.startswith("transport-shm") or system.endswith("-f16"):  # goals judge the float32 format
            continue
        figs = by_step.get(0, {})
        ratio = _ratio(figs.get("gb_per_s"), figs.get("memcpy_gb_per_s"))
        goals.append(
            Goal(
                f"GB/s >= {_MEMCPY_GOAL} x memcpy",
                system,
                None if ratio is None else ratio >= _MEMCPY_GOAL,
                f"{_fmt(figs.get('gb_per_s'), '.2f')} vs {_fmt(figs.get('memcpy_gb_per_s'), '.2f')} GB/s = "
                f"{_fmt(ratio, '.2f')}x",
            )
        )
    return goals


def build_goal(builds: Sequence[Mapping[str, Any]]) -> Goal | None:
    """A producer's CPU per batch built (doctor's stage 1, median over rounds); None when none ran."""
    if not builds:
        return None
    cpu = median(b.get("cpu_ms_per_batch") for b in builds if b.get("ok"))
    return Goal(
        f"producer build CPU/batch <= {_BUILD_CPU_GOAL_MS} ms",
        "producer-build",
        None if cpu is None else cpu <= _BUILD_CPU_GOAL_MS,
        f"{_fmt(cpu, '.2f')} ms (median of {sum(1 for b in builds if b.get('ok'))} probe(s))",
    )


def _stall_goal(system: str, step_ms: int, capacity: float | None, stall: float | None) -> Goal:
    demand = demand_per_s(step_ms)
    name = f"stall < {_STALL_GOAL_PCT:g} % at {step_ms} ms"
    if capacity is None or stall is None:
        return Goal(name, system, None, "not measured")
    head = f"capacity {capacity:.1f} b/s vs demand {demand:.1f} b/s ({capacity / demand:.2f}x)"
    if capacity < _CAPACITY_FACTOR * demand:
        return Goal(name, system, None, f"{head} < {_CAPACITY_FACTOR}x: goal does not apply; stall {stall:.2f} %")
    return Goal(name, system, stall < _STALL_GOAL_PCT, f"{head}; stall {stall:.2f} %")


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table: floats with 2 decimals (1 from 100 up), None as '-'."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}"
        return str(v)

    cells = [[str(h) for h in header]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
