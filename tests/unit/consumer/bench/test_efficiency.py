"""bench's feed-efficiency section with hand-made trials: which systems run, medians, PASS/FAIL."""

from __future__ import annotations

from typing import Any

import pytest

from melfeed.consumer.bench.efficiency import build_efficiency, efficiency_goals, efficiency_systems, render_efficiency
from melfeed.consumer.bench.stats import medians_by_system

_SYSTEMS: list[dict[str, Any]] = [
    {"system": "melfeed-zmq-p1", "kind": "melfeed", "transport": "zmq", "producers": 1, "available": True},
    {"system": "melfeed-zmq-p2", "kind": "melfeed", "transport": "zmq", "producers": 2, "available": True},
    {"system": "melfeed-shm-p1", "kind": "melfeed", "transport": "shm", "producers": 1, "available": False},
    {"system": "tfdata-autotune", "kind": "tfdata", "parallel_calls": None, "available": True},
    {"system": "tfdata-npc8", "kind": "tfdata", "parallel_calls": 8, "available": True},
    {"system": "naive", "kind": "naive", "available": True},
]


def _trial(
    system: str, kind: str, rnd: int, eff: float | None, on_gpu: bool = False, ok: bool = True
) -> dict[str, Any]:
    return {
        "system": system,
        "kind": kind,
        "round": rnd,
        "step_ms": 0,
        "ok": ok,
        "feed_efficiency": eff,
        "fed_steps_per_s": None if eff is None else 10.0 * eff,
        "resident_steps_per_s": 10.0,
        "stall_pct": 0.5,
        "step_p50_ms": 90.0,
        "on_gpu": on_gpu,
    }


def test_the_section_runs_available_melfeed_with_the_first_producer_count_and_every_tuned_tfdata() -> None:
    chosen = efficiency_systems(_SYSTEMS, first_producers=1)
    assert [x["system"] for x in chosen] == ["melfeed-zmq-p1", "tfdata-autotune", "tfdata-npc8"]
    assert all(x["model"] == "reference" for x in chosen)


@pytest.mark.parametrize(
    ("mf", "tf", "on_gpu", "verdicts"),
    [
        (0.97, 0.90, False, [True, True]),  # >= 0.95 on CPU and above tf.data
        (0.94, 0.90, False, [False, True]),  # below the CPU goal, still above tf.data
        (0.96, 0.97, False, [True, False]),  # the goal, but tf.data fed the step better
        (0.97, 0.90, True, [False, True]),  # on a GPU the goal is 0.98
        (0.98, 0.90, True, [True, True]),  # exactly the goal passes
    ],
)
def test_goals_pass_or_fail_by_device_and_against_the_best_tfdata(
    mf: float, tf: float, on_gpu: bool, verdicts: list[bool]
) -> None:
    meds = medians_by_system(
        [
            _trial("melfeed-zmq-p1", "melfeed", 0, mf),
            _trial("tfdata-npc8", "tfdata", 0, tf),
            _trial("tfdata-autotune", "tfdata", 0, tf - 0.1),
        ],
        ("feed_efficiency",),
    )
    best, goals = efficiency_goals(meds, ["melfeed-zmq-p1"], ["tfdata-autotune", "tfdata-npc8"], on_gpu)
    assert best == "tfdata-npc8"
    assert [g.passed for g in goals] == verdicts
    assert (
        goals[0].name == f"feed efficiency >= {0.98 if on_gpu else 0.95:g} (step on the {'GPU' if on_gpu else 'CPU'})"
    )
    assert goals[1].detail == f"{mf:.3f} vs {tf:.3f}"


def test_missing_figures_are_not_applicable_never_a_verdict() -> None:
    meds = medians_by_system([_trial("melfeed-zmq-p1", "melfeed", 0, 0.99)], ("feed_efficiency",))
    best, goals = efficiency_goals(meds, ["melfeed-zmq-p1", "melfeed-shm-p1"], ["tfdata-npc8"], on_gpu=False)
    assert best is None
    assert [g.passed for g in goals] == [True, None, None]  # no tf.data figure; shm never finished
    assert goals[2].line().startswith("n/a ") and "no finished trial" in goals[2].line()


def test_build_uses_medians_over_finished_rounds_and_the_device_the_step_ran_on() -> None:
    trials = [_trial("melfeed-zmq-p1", "melfeed", r, e, on_gpu=True) for r, e in enumerate((0.99, 0.97, 0.985))]
    trials += [_trial("tfdata-npc8", "tfdata", 0, 0.5), _trial("tfdata-npc8", "tfdata", 1, 2.0, ok=False)]
    section = build_efficiency(trials, efficiency_systems(_SYSTEMS, 1))
    assert section["medians"]["melfeed-zmq-p1"][0]["feed_efficiency"] == pytest.approx(0.985)
    assert section["medians"]["tfdata-npc8"][0]["feed_efficiency"] == 0.5  # the failed round is ignored
    assert section["on_gpu"] is True and section["best_tfdata"] == "tfdata-npc8"
    assert [g["passed"] for g in section["goals"]] == [True, True]
    table = render_efficiency(section)
    assert table.splitlines()[0].split()[:3] == ["system", "feed", "eff"]
    assert "melfeed-zmq-p1" in table and "0.98" in table
