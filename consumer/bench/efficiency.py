"""The ``bench`` feed-efficiency section: the reference model fed by melfeed and by tuned tf.data.

Role: pure functions over the trials of ``consumer/bench/trial_reference.py`` (no I/O, no clock): which
systems run (each melfeed transport with the first producer count, every tuned tf.data variant), their
medians, the goals as ``stats.Goal`` and the table. Feed efficiency = fed steps/s / steps/s of the same
compiled step on resident batches of the same buckets (``melfeed.shared.metrics``); each trial measures its own
limit after warm-up, so a system is compared with the step it actually fed.
Goals, for each melfeed system: feed efficiency >= ``feed_efficiency_goal`` (0.95 when the step ran on
the CPU, 0.98 on a GPU) and above the best tuned tf.data system's. Invariants: as in
``consumer/bench/stats.py``: medians over finished trials only; a goal that cannot be evaluated is
``None`` ("n/a"), never a made-up verdict. Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from melfeed.consumer.bench import stats as bs
from melfeed.shared.metrics import feed_efficiency_goal

__all__ = ["EFFICIENCY_METRICS", "efficiency_systems", "build_efficiency", "efficiency_goals", "render_efficiency"]

EFFICIENCY_METRICS = (
    "feed_efficiency",
    "useful_work",
    "fed_steps_per_s",
    "resident_steps_per_s",
    "stall_pct",
    "step_p50_ms",
)
_STEP = 0  # medians_by_system groups by step cost; these trials have one (the model's own)


def efficiency_systems(systems: Sequence[Mapping[str, Any]], first_producers: int) -> list[dict[str, Any]]:
    """The systems of the section: runnable melfeed ones with ``first_producers``, and tuned tf.data."""
    return [
        dict(x) | {"model": "reference"}
        for x in systems
        if x["available"] and ((x["kind"] == "melfeed" and x["producers"] == first_producers) or x["kind"] == "tfdata")
    ]


def _efficiency(meds: Mapping[str, Mapping[int, Mapping[str, float | None]]], system: str) -> float | None:
    return meds.get(system, {}).get(_STEP, {}).get("feed_efficiency")


def efficiency_goals(
    meds: Mapping[str, Mapping[int, Mapping[str, float | None]]],
    melfeed: Sequence[str],
    tfdata: Sequence[str],
    on_gpu: bool,
) -> tuple[str | None, list[bs.Goal]]:
    """The best tuned tf.data system by median feed efficiency, and two goals per melfeed system."""
    ranked = [(e, s) for s in tfdata if (e := _efficiency(meds, s)) is not None]
    best, best_eff = (max(ranked)[1], max(ranked)[0]) if ranked else (None, None)
    goal = feed_efficiency_goal(on_gpu)
    where = "GPU" if on_gpu else "CPU"
    goals = []
    for system in melfeed:
        eff = _efficiency(meds, system)
        if eff is None:
            goals.append(bs.Goal("feed efficiency", system, None, "no finished trial"))
            continue
        goals.append(bs.Goal(f"feed efficiency >= {goal:g} (step on the {where})", system, eff >= goal, f"{eff:.3f}"))
        goals.append(
            bs.Goal(
                f"feed efficiency > best tuned tf.data's ({best or 'none finished'})",
                system,
                None if best_eff is None else eff > best_eff,
                f"{eff:.3f} vs {'-' if best_eff is None else format(best_eff, '.3f')}",
            )
        )
    return best, goals


def build_efficiency(trials: Sequence[Mapping[str, Any]], systems: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians, the best tf.data system, whether the step ran on a GPU, goals and the raw trials."""
    meds = bs.medians_by_system(trials, EFFICIENCY_METRICS)
    on_gpu = any(t.get("on_gpu") for t in trials if t.get("ok"))
    best, goals = efficiency_goals(
        meds,
        [x["system"] for x in systems if x["kind"] == "melfeed"],
        [x["system"] for x in systems if x["kind"] == "tfdata"],
        on_gpu,
    )
    return {
        "medians": meds,
        "best_tfdata": best,
        "on_gpu": on_gpu,
        "goals": [g.as_dict() | {"line": g.line()} for g in goals],
        "trials": list(trials),
    }


def render_efficiency(section: Mapping[str, Any]) -> str:
    """The section's table: one row per system, medians over rounds."""
    rows = []
    for system, by_step in section["medians"].items():
        f = by_step.get(_STEP, {})
        rows.append(
            [
                system,
                f.get("feed_efficiency"),
                f.get("useful_work"),
                f.get("fed_steps_per_s"),
                f.get("resident_steps_per_s"),
                f.get("stall_pct"),
                f.get("step_p50_ms"),
                int(f.get("trials") or 0),
            ]
        )
    return bs.format_table(
        ["system", "feed eff", "useful work", "fed steps/s", "resident steps/s", "stall %", "step p50 ms", "n"], rows
    )
