"""The ``model.jit_compile`` decision and the one-line description of a TensorFlow error (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tensorflow as tf

from melfeed.consumer.train.jit import (MEMO_NAME, choose_mode, describe_exception, describe_tf_error, remember_mode,
                                remembered_mode, setting_name)


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
    assert choice.reason == ("XLA cannot compile the step: op grad/StridedSliceGrad: "
                             "shape of dy was [2,8] instead of [2,0]")


@pytest.mark.parametrize(("xla_s", "graph_s", "mode", "xla_ms", "graph_ms"), [
    ([0.010, 0.012, 0.011], [0.020, 0.021, 0.019], "xla", 11.0, 20.0),
    ([0.030, 0.001, 0.031], [0.020, 0.021, 0.019], "graph", 30.0, 20.0),   # median, not the lucky minimum
    ([0.050, 0.010, 0.011], [0.012, 0.013, 0.090], "xla", 11.0, 13.0),     # one slow outlier each: ignored
    ([0.020, 0.020, 0.020], [0.020, 0.020, 0.020], "xla", 20.0, 20.0),     # a tie keeps XLA
])
def test_auto_picks_the_faster_median_and_reports_both_times(
        xla_s: list[float], graph_s: list[float], mode: str, xla_ms: float, graph_ms: float) -> None:
    choice = choose_mode("auto", xla_times_s=xla_s, graph_times_s=graph_s)
    assert choice.mode == mode
    assert choice.xla_step_ms == pytest.approx(xla_ms) and choice.graph_step_ms == pytest.approx(graph_ms)
    assert f"xla {xla_ms:.1f} ms, graph {graph_ms:.1f} ms" in choice.reason


def test_unknown_setting_is_rejected_and_settings_print_as_in_yaml() -> None:
    with pytest.raises(ValueError, match="unknown"):
        choose_mode("xla")
    assert [setting_name(s) for s in ("auto", True, False)] == ["auto", "true", "false"]


def test_op_error_names_the_node_and_keeps_the_first_line_only() -> None:
    message = ("shape of dy was [8,64,80] instead of [8,0,80]\n\nStack trace for op definition:\nFile \"x.py\"\n"
               "\t [[{{node gradient_tape/cond/gradients/cond/strided_slice_2_grad/StridedSliceGrad}}]]\n"
               "\ttf2xla conversion failed while converting cond_false_grad")
    err = tf.errors.InvalidArgumentError(None, None, message)
    assert describe_tf_error(err) == ("op gradient_tape/cond/gradients/cond/strided_slice_2_grad/StridedSliceGrad: "
                                      "shape of dy was [8,64,80] instead of [8,0,80]")


def test_wrapped_user_code_error_keeps_its_original_last_line() -> None:
    wrapped = RuntimeError("in user code:\n\n    File \"m.py\", line 3, in step\n        x[0]\n\n"
                           "    TypeError: 'int' object is not subscriptable\n")
    assert describe_tf_error(wrapped) == "TypeError: 'int' object is not subscriptable (m.py:3)"   # the user's line
    assert describe_tf_error(ValueError("plain")) == "ValueError: plain"
    long = describe_tf_error(tf.errors.UnimplementedError(None, None, "x" * 1000))
    assert len(long) == 300 and "\n" not in long



def test_a_failed_run_names_the_op_the_users_line_and_the_reason() -> None:
    message = ("Graph execution error:\n\nDetected at node Gather defined at (most recent call last):\n"
               '  File "/srv/melfeed/run_pipeline.py", line 81, in <module>\n\n'
               '  File "/home/u/tts/model.py", line 11, in __call__\n\n'
               '  File "/usr/lib/python3/site-packages/keras/src/layers/core/embedding.py", line 140, in call\n\n'
               "indices[7,2] = 50 is not in [0, 32)\n\t [[{{node Gather}}]] [Op:__inference_traced_187]")
    err = tf.errors.InvalidArgumentError(None, None, message)
    assert describe_tf_error(err) == "op Gather (/home/u/tts/model.py:11): indices[7,2] = 50 is not in [0, 32)"


def test_a_factory_exception_is_one_line_with_the_line_that_raised_it() -> None:
    def factory() -> None:
        raise KeyError("hidden")    # the user's bug, one line below the def
    with pytest.raises(KeyError) as info:
        factory()
    assert describe_exception(info.value) == f"KeyError: 'hidden' ({__file__}:{factory.__code__.co_firstlineno + 1})"


def test_auto_keeps_the_mode_remembered_for_this_run_unless_xla_now_fails(tmp_path: Path) -> None:
    assert remembered_mode(tmp_path) is None
    chosen = choose_mode("auto", xla_times_s=[0.03], graph_times_s=[0.02])
    remember_mode(tmp_path, chosen)
    assert remembered_mode(tmp_path) == "graph"
    kept = choose_mode("auto", remembered="graph", xla_times_s=[0.01], graph_times_s=[0.02])
    assert kept.mode == "graph" and MEMO_NAME in kept.reason          # a restart does not re-time
    assert choose_mode("auto", remembered="xla", xla_error="op x: boom").mode == "graph"
    assert choose_mode(False, remembered="xla").mode == "graph"
    (tmp_path / MEMO_NAME).write_text("{not json")
    assert remembered_mode(tmp_path) is None                          # damaged: decide again
