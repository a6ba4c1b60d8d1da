"""bench arithmetic with hand-made numbers: medians, ratios, goals, calibration, tables."""

from __future__ import annotations

import math
from typing import Any

import pytest

from melfeed.consumer.bench import stats as bs
from melfeed.consumer.bench.report import F16_NOTE, build_report, render


def _trial(system: str, step_ms: int, rnd: int, **figures: float | None) -> dict[str, Any]:
    return {"system": system, "kind": "x", "round": rnd, "step_ms": step_ms, "ok": True, **figures}


def test_median_ignores_missing_and_non_finite_values() -> None:
    assert bs.median([3.0, 1.0, 2.0]) == 2.0
    assert bs.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert bs.median([None, math.nan, 5.0, math.inf]) == 5.0
    assert bs.median([None]) is None


def test_medians_by_system_uses_only_finished_trials() -> None:
    trials = [
        _trial("a", 0, 0, batches_per_s=100.0),
        _trial("a", 0, 1, batches_per_s=300.0),
        _trial("a", 0, 2, batches_per_s=200.0),
        {"system": "a", "kind": "x", "round": 3, "step_ms": 0, "ok": False, "batches_per_s": 1e9},
        _trial("a", 5, 0, batches_per_s=50.0, stall_pct=2.0),
    ]
    meds = bs.medians_by_system(trials)
    assert meds["a"][0]["batches_per_s"] == 200.0
    assert meds["a"][0]["trials"] == 3.0
    assert meds["a"][5] == pytest.approx(
        {**{m: None for m in bs.METRICS}, "batches_per_s": 50.0, "stall_pct": 2.0, "trials": 1.0}
    )


def test_best_system_and_ratios_against_it() -> None:
    meds = bs.medians_by_system(
        [
            _trial("tf-auto", 0, 0, batches_per_s=96.0, trainer_cpu_ms_per_batch=12.0),
            _trial("tf-8", 0, 0, batches_per_s=120.0, trainer_cpu_ms_per_batch=8.0),
            _trial("mf", 0, 0, batches_per_s=300.0, trainer_cpu_ms_per_batch=2.0),
            _trial("mf", 5, 0, batches_per_s=150.0),
        ]
    )
    assert bs.best_system(meds, ["tf-auto", "tf-8"]) == "tf-8"
    assert bs.best_system(meds, ["missing"]) is None
    r = bs.ratios(meds, "tf-8")
    assert r["mf"][0]["batches_per_s"] == pytest.approx(2.5)
    assert r["mf"][0]["trainer_cpu_ms_per_batch"] == pytest.approx(0.25)
    assert r["mf"][5]["batches_per_s"] is None  # the baseline has no 5 ms trial: no made-up ratio
    assert r["tf-8"][0]["batches_per_s"] == 1.0


@pytest.mark.parametrize(("step_ms", "zero_s", "sleep_s"), [(20, 0.0005, 0.0195), (5, 0.0, 0.005), (1, 0.003, 0.0)])
def test_sleep_makes_the_step_take_step_ms(step_ms: int, zero_s: float, sleep_s: float) -> None:
    assert bs.sleep_for_step_s(step_ms, zero_s) == pytest.approx(sleep_s)


def test_demand_and_bandwidth() -> None:
    assert bs.demand_per_s(20) == 50.0
    assert bs.demand_per_s(0) == math.inf
    assert bs.gb_per_s(8e9, 4.0) == 2.0
    assert bs.gb_per_s(1.0, 0.0) is None


def _goal_meds() -> dict[str, Any]:
    return bs.medians_by_system(
        [
            _trial("tf", 0, 0, batches_per_s=100.0, trainer_cpu_ms_per_batch=10.0),
            _trial("mf-shm", 0, 0, batches_per_s=160.0, trainer_cpu_ms_per_batch=3.0, payload_copies=1.0),
            _trial("mf-shm", 5, 0, stall_pct=0.4),  # capacity 160 >= 1.2 x 200? no: not applicable
            _trial("mf-shm", 20, 0, stall_pct=0.5),  # 160 >= 1.2 x 50: applies, passes
            _trial("mf-shm", 50, 0, stall_pct=3.0),  # 160 >= 1.2 x 20: applies, fails
            _trial("mf-zmq", 0, 0, batches_per_s=140.0, trainer_cpu_ms_per_batch=3.6, payload_copies=4.0),
        ]
    )


def test_goals_pass_fail_and_not_applicable() -> None:
    goals = {(g.system, g.name): g for g in bs.evaluate_goals(_goal_meds(), {"mf-shm": "shm", "mf-zmq": "zmq"}, "tf")}
    assert goals[("mf-shm", "max rate >= 1.5 x tf")].passed is True  # 1.6x
    assert goals[("mf-zmq", "max rate >= 1.5 x tf")].passed is False  # 1.4x
    assert goals[("mf-shm", "trainer CPU/batch <= 0.35 x tf")].passed is True  # 0.30x
    assert goals[("mf-zmq", "trainer CPU/batch <= 0.35 x tf")].passed is False  # 0.36x
    assert goals[("mf-shm", "stall < 1 % at 5 ms")].passed is None
    assert goals[("mf-shm", "stall < 1 % at 20 ms")].passed is True
    assert goals[("mf-shm", "stall < 1 % at 50 ms")].passed is False
    assert goals[("mf-shm", "payload copies <= 1 on shm")].passed is True
    assert goals[("mf-zmq", "payload copies <= 3 on zmq")].passed is False
    assert "160.0 vs 100.0 batches/s = 1.60x" in goals[("mf-shm", "max rate >= 1.5 x tf")].line()
    assert goals[("mf-shm", "stall < 1 % at 50 ms")].line().startswith("FAIL")


def test_goals_without_a_baseline_are_not_evaluated() -> None:
    goals = bs.evaluate_goals(_goal_meds(), {"mf-zmq": "zmq", "gone": "zmq"}, None)
    assert [g.passed for g in goals if g.name.startswith(("max rate", "trainer CPU"))] == [None, None]
    assert any(g.system == "gone" and g.passed is None for g in goals)


def test_format_table_aligns_and_marks_missing() -> None:
    text = bs.format_table(["system", "b/s"], [["melfeed", 572.4], ["naive", None], ["x", 4.256]])
    lines = text.splitlines()
    assert lines[0].split() == ["system", "b/s"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["melfeed", "572.4"] and lines[3].split() == ["naive", "-"]
    assert lines[4].split() == ["x", "4.26"]
    assert len({len(line) for line in lines}) == 1


def test_report_ratios_equal_median_quotients_and_render_names_everything() -> None:
    trials = [
        _trial("tfdata-npc8", 0, r, batches_per_s=v, trainer_cpu_ms_per_batch=10.0)
        for r, v in enumerate([90.0, 100.0, 110.0])
    ] + [_trial("melfeed-zmq-p1", 0, 0, batches_per_s=150.0)]
    systems = [
        {"system": "melfeed-zmq-p1", "kind": "melfeed", "transport": "zmq", "available": True},
        {"system": "melfeed-shm-p1", "kind": "melfeed", "transport": "shm", "available": False},
        {"system": "tfdata-npc8", "kind": "tfdata", "available": True},
    ]
    settings = {"rounds": 3, "batches": 10, "warmup": 2, "step_ms": [5]}
    report = build_report(trials, [], systems, settings)
    assert report["baseline"] == "tfdata-npc8"
    assert report["ratios"]["melfeed-zmq-p1"][0]["batches_per_s"] == pytest.approx(1.5)
    assert "melfeed-shm-p1" in report["unavailable"]
    text = render(report)
    for needle in (
        "melfeed-zmq-p1",
        "melfeed-shm-p1: not available in this build",
        "PASS  max rate",
        "sleep after the compiled zero-cost step",
    ):
        assert needle in text


def test_bandwidth_goals_one_producer_shm_transport_and_producer_build() -> None:
    """The stricter goals of the shared-memory path with 1 producer, shm vs memcpy, and the producer's build CPU."""
    trials = (
        [_trial("tfdata-npc8", 0, 0, batches_per_s=100.0, trainer_cpu_ms_per_batch=10.0)]
        + [_trial("melfeed-shm-p1", 0, 0, batches_per_s=260.0, trainer_cpu_ms_per_batch=1.2)]
        + [_trial("melfeed-shm-p2", 0, 0, batches_per_s=200.0, trainer_cpu_ms_per_batch=0.9)]
        + [_trial("melfeed-zmq-p1", 0, 0, batches_per_s=160.0, trainer_cpu_ms_per_batch=3.0)]
    )
    probes = [_trial("transport-shm-p2", 0, r, gb_per_s=g, memcpy_gb_per_s=8.0) for r, g in enumerate([3.0, 4.4, 5.0])]
    builds = [
        {
            "system": "producer-build",
            "round": r,
            "step_ms": 0,
            "ok": True,
            "cpu_ms_per_batch": v,
            "build_ms_p50": 1.5,
            "read_ms_p50": 1.4,
            "batches_per_s": 600.0,
        }
        for r, v in enumerate([1.2, 1.5, 1.4])
    ]
    builds.append({"system": "producer-build", "round": 3, "step_ms": 0, "ok": False, "error": "exit 78"})
    systems = [
        {"system": s, "kind": "melfeed", "transport": s.split("-")[1], "available": True}
        for s in ("melfeed-shm-p1", "melfeed-shm-p2", "melfeed-zmq-p1")
    ]
    systems.append({"system": "tfdata-npc8", "kind": "tfdata", "available": True})
    report = build_report(trials, probes, systems, {"rounds": 3, "batches": 10, "warmup": 2, "step_ms": []}, builds)
    verdict = {(g["system"], g["name"]): g["passed"] for g in report["goals"]}
    assert verdict[("melfeed-shm-p1", "1 producer: max rate >= 2.5 x tfdata-npc8")] is True  # 2.6x
    assert verdict[("melfeed-shm-p1", "1 producer: trainer CPU/batch <= 0.1 x tfdata-npc8")] is False  # 0.12x
    assert not any(name.startswith("1 producer") for system, name in verdict if system != "melfeed-shm-p1")
    assert verdict[("transport-shm-p2", "GB/s >= 0.5 x memcpy")] is True  # 4.4 / 8
    assert verdict[("producer-build", "producer build CPU/batch <= 1.3 ms")] is False  # median 1.4
    assert report["build_medians"]["cpu_ms_per_batch"] == pytest.approx(1.4)
    text = render(report)
    for needle in (
        "FAIL  producer build CPU/batch <= 1.3 ms [producer-build]: 1.40 ms (median of 3 probe(s))",
        "PASS  GB/s >= 0.5 x memcpy [transport-shm-p2]: 4.40 vs 8.00 GB/s = 0.55x",
        "producer build (doctor stage 1",
        "producer-build round 3 step 0 ms: exit 78",
    ):
        assert needle in text


def test_the_tcp_payload_path_is_judged_on_its_max_rate_trial_alone() -> None:
    """Loopback tcp under CURVE (1 producer): the payload path's rate, CPU and copy goals; no stall goals,
    since bench runs it at the zero-cost step only."""
    meds = bs.medians_by_system(
        [
            _trial("tf", 0, 0, batches_per_s=100.0, trainer_cpu_ms_per_batch=10.0),
            _trial("melfeed-tcp-p1", 0, 0, batches_per_s=170.0, trainer_cpu_ms_per_batch=4.0, payload_copies=4.0),
            _trial("melfeed-tcp-p1", 0, 1, batches_per_s=150.0, trainer_cpu_ms_per_batch=3.0, payload_copies=4.0),
        ]
    )
    goals = {g.name: g for g in bs.evaluate_goals(meds, {"melfeed-tcp-p1": "tcp"}, "tf")}
    assert goals["max rate >= 1.5 x tf"].passed is True  # median 160 / 100 = 1.6x
    assert goals["trainer CPU/batch <= 0.35 x tf"].passed is True  # median 3.5 / 10 = 0.35x
    assert goals["payload copies <= 3 on tcp"].passed is False  # 4 copies
    assert not any(name.startswith(("stall", "1 producer")) for name in goals)
    slower = bs.medians_by_system(
        [
            _trial("tf", 0, 0, batches_per_s=100.0, trainer_cpu_ms_per_batch=10.0),
            _trial("melfeed-tcp-p1", 0, 0, batches_per_s=140.0, trainer_cpu_ms_per_batch=3.6),
        ]
    )
    verdict = {g.name: g.passed for g in bs.evaluate_goals(slower, {"melfeed-tcp-p1": "tcp"}, "tf")}
    assert verdict["max rate >= 1.5 x tf"] is False and verdict["trainer CPU/batch <= 0.35 x tf"] is False


def test_float16_rows_are_labelled_shown_beside_float32_and_judged_by_no_goal() -> None:
    probes = [
        _trial(s, 0, r, gb_per_s=g, memcpy_gb_per_s=8.0, batches_per_s=b)
        for r in range(3)
        for s, g, b in (("transport-shm-p1", 4.4, 300.0), ("transport-shm-p1-f16", 0.5, 400.0))
    ]
    builds = [
        {
            "system": s,
            "round": r,
            "step_ms": 0,
            "ok": True,
            "cpu_ms_per_batch": v,
            "build_ms_p50": v,
            "read_ms_p50": 1.0,
            "batches_per_s": 100.0,
        }
        for r in range(3)
        for s, v in (("producer-build", 1.2), ("producer-build-f16", 17.0))
    ]
    report = build_report([], probes, [], {"rounds": 3, "batches": 10, "warmup": 2, "step_ms": []}, builds)
    assert [(g["system"], g["passed"]) for g in report["goals"]] == [
        ("transport-shm-p1", True),
        ("producer-build", True),
    ]
    assert report["build_medians"]["cpu_ms_per_batch"] == 1.2 and report["build_medians_f16"]["cpu_ms_per_batch"] == 17
    text = render(report)
    assert F16_NOTE in text and "float16 wire (-f16)" in text and "transport-shm-p1-f16" in text
    assert "batches/s" in text.split("transport (")[1]
