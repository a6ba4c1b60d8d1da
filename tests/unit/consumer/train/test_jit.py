"""The ``model.jit_compile`` decision and the remembered choice (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from melfeed.consumer.train.jit import MEMO_NAME, choose_mode, remember_mode, remembered_mode, setting_name


def test_false_is_graph_and_true_is_xla_without_timing() -> None:
    assert choose_mode(False).mode == "graph"
    assert choose_mode(True).mode == "xla"
    assert choose_mode(True).xla_step_ms is None


def test_true_with_an_xla_failure_is_an_error_never_a_fallback() -> None:
    with pytest.raises(ValueError, match="XLA failed: op x: boom"):
        choose_mode(True, xla_error="op x: boom")


def test_auto_falls_back_to_graph_when_xla_fails_and_says_why() -> None:
    choice = choose_mode("auto", xla_error="op grad/StridedSliceGrad: shape of dy was [2,8] instead of [2,0]")
    assert choice.mode == "graph"
    assert choice.reason == (
        "XLA cannot compile the step: op grad/StridedSliceGrad: shape of dy was [2,8] instead of [2,0]"
    )


@pytest.mark.parametrize(
    ("xla_s", "graph_s", "mode", "xla_ms", "graph_ms"),
    [
        ([0.010, 0.012, 0.011], [0.020, 0.021, 0.019], "xla", 11.0, 20.0),
        ([0.030, 0.001, 0.031], [0.020, 0.021, 0.019], "graph", 30.0, 20.0),  # median, not the lucky minimum
        ([0.050, 0.010, 0.011], [0.012, 0.013, 0.090], "xla", 11.0, 13.0),  # one slow outlier each: ignored
        ([0.020, 0.020, 0.020], [0.020, 0.020, 0.020], "xla", 20.0, 20.0),  # a tie keeps XLA
    ],
)
def test_auto_picks_the_faster_median_and_reports_both_times(
    xla_s: list[float], graph_s: list[float], mode: str, xla_ms: float, graph_ms: float
) -> None:
    choice = choose_mode("auto", xla_times_s=xla_s, graph_times_s=graph_s)
    assert choice.mode == mode
    assert choice.xla_step_ms == pytest.approx(xla_ms) and choice.graph_step_ms == pytest.approx(graph_ms)
    assert f"xla {xla_ms:.1f} ms, graph {graph_ms:.1f} ms" in choice.reason


def test_unknown_setting_is_rejected_and_settings_print_as_in_yaml() -> None:
    with pytest.raises(ValueError, match="unknown"):
        choose_mode("xla")
    assert [setting_name(s) for s in ("auto", True, False)] == ["auto", "true", "false"]


def test_auto_keeps_the_mode_remembered_for_this_run_unless_xla_now_fails(tmp_path: Path) -> None:
    assert remembered_mode(tmp_path) is None
    chosen = choose_mode("auto", xla_times_s=[0.03], graph_times_s=[0.02])
    remember_mode(tmp_path, chosen)
    assert remembered_mode(tmp_path) == "graph"
    kept = choose_mode("auto", remembered="graph", xla_times_s=[0.01], graph_times_s=[0.02])
    assert kept.mode == "graph" and MEMO_NAME in kept.reason  # a restart does not re-time
    assert choose_mode("auto", remembered="xla", xla_error="op x: boom").mode == "graph"
    assert choose_mode(False, remembered="xla").mode == "graph"
    (tmp_path / MEMO_NAME).write_text("{not json")
    assert remembered_mode(tmp_path) is None  # damaged: decide again
