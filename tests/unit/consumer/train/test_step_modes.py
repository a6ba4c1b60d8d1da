"""CompiledStep under ``model.jit_compile``: XLA, graph mode, the auto fallback and its one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.step import CompiledStep
from melfeed.consumer.train.xla_attempts import ATTEMPTS_NAME, XlaAttempts
from melfeed.shared.errors import ConfigError, StepError
from tests.foreign_model import build_foreign_step, build_lossless_step
from tests.steps import tiny_step

pytestmark = pytest.mark.tf

N_MELS = 8
FACTORY = "tests.foreign_model:build_foreign_step"
SHAPES = [
    {"mel": (4, 16, N_MELS), "mel_len": (4,), "tokens": (4, 6), "tok_len": (4,)},
    {"mel": (4, 32, N_MELS), "mel_len": (4,), "tokens": (4, 10), "tok_len": (4,)},
]


def _spec() -> StepSpec:
    return StepSpec(N_MELS, 32, 0.02, False, 0, bucket_shapes=tuple(SHAPES), params={"hidden": 8})


def _batch(bucket: int) -> dict[str, tf.Tensor]:
    rows, frames, _ = SHAPES[bucket]["mel"]
    rng = np.random.default_rng(bucket)
    return {
        "mel": tf.constant((rng.normal(size=(rows, frames, N_MELS)) - 3).astype(np.float32)),
        "mel_len": tf.fill([rows], frames - 2),
        "tokens": tf.ones(SHAPES[bucket]["tokens"], tf.int32),
        "tok_len": tf.fill([rows], 3),
    }


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("melfeed.consumer")
    ]


def test_auto_falls_back_to_graph_with_one_warning_naming_the_op(caplog: pytest.LogCaptureFixture) -> None:
    step = build_foreign_step(_spec())
    before = [v.numpy() for v in step.variables()]
    compiled = CompiledStep(step, SHAPES, jit_compile="auto", factory=FACTORY)
    with caplog.at_level(logging.INFO):
        compiled.warm_up()
    assert compiled.mode == "graph" and compiled.choice is not None
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"XLA cannot compile the step of {FACTORY}, using graph mode: op ")
    assert "StridedSliceGrad" in warnings[0] and "StridedSliceGrad" in compiled.choice.reason
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(before, step.variables()))  # warm-up left no trace
    first = compiled.run(1, _batch(1))
    assert list(first) == ["loss", "mel_l1", "stop_bce"]
    for _ in range(15):
        last = compiled.run(1, _batch(1))
    assert float(last["loss"]) < 0.7 * float(first["loss"])
    assert compiled.compiles_after_ready == 0


def test_true_fails_in_one_line_naming_the_factory_and_the_op() -> None:
    compiled = CompiledStep(build_foreign_step(_spec()), SHAPES, jit_compile=True, factory=FACTORY)
    with pytest.raises(StepError) as info:
        compiled.warm_up()
    text = str(info.value)
    assert text.startswith(f"model.step {FACTORY}: XLA cannot compile the step (jit_compile: true): op ")
    assert "StridedSliceGrad" in text and "\n" not in text and not compiled.is_ready


def test_false_is_graph_mode_without_trying_xla(caplog: pytest.LogCaptureFixture) -> None:
    compiled = CompiledStep(build_foreign_step(_spec()), SHAPES, jit_compile=False, factory=FACTORY)
    with caplog.at_level(logging.INFO):
        compiled.warm_up()
    assert compiled.mode == "graph" and compiled.traces == 2 and _warnings(caplog) == []


def test_auto_times_both_modes_when_xla_compiles_and_logs_both(caplog: pytest.LogCaptureFixture) -> None:
    compiled = CompiledStep(tiny_step(_spec()), SHAPES, jit_compile="auto", factory="tests.steps:tiny_step")
    with caplog.at_level(logging.INFO, logger="melfeed.consumer.train.step"):
        compiled.warm_up()
    choice = compiled.choice
    assert choice is not None and choice.xla_step_ms is not None and choice.graph_step_ms is not None
    assert compiled.mode == ("xla" if choice.xla_step_ms <= choice.graph_step_ms else "graph")
    timing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("jit_compile auto:")]
    assert len(timing) == 1 and "xla" in timing[0] and "graph" in timing[0] and compiled.mode in timing[0]
    # Two buckets in XLA, the timed (largest) bucket in graph mode, and the other one if graph won.
    assert compiled.traces == (3 if compiled.mode == "xla" else 4)
    before = compiled.traces
    compiled.run(0, _batch(0))
    compiled.run(1, _batch(1))
    assert compiled.traces == before and compiled.compiles_after_ready == 0


def test_a_step_without_loss_is_a_one_line_config_error() -> None:
    compiled = CompiledStep(build_lossless_step(_spec()), SHAPES, jit_compile="auto", factory=FACTORY)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        compiled.warm_up()
    assert info.value.path == ("model", "step") and info.value.got == FACTORY
    assert "returned no 'loss' (names: mel_l1, stop_bce)" in str(info.value) and "\n" not in str(info.value)


def test_spec_carries_buckets_steps_epoch_and_params_read_only() -> None:
    from melfeed.shared.config.loader import config_from_mapping

    cfg = config_from_mapping(
        {"n_mels": N_MELS, "consumer": {"steps": 120}, "model": {"params": {"hidden": 8, "heads": [1, 2]}}}
    )
    spec = StepSpec.from_config(cfg, SHAPES, batches_per_epoch=37)
    assert (spec.n_mels, spec.total_steps, spec.batches_per_epoch) == (N_MELS, 120, 37)
    assert [dict(b) for b in spec.bucket_shapes] == SHAPES
    assert dict(spec.params) == {"hidden": 8, "heads": [1, 2]}
    with pytest.raises(TypeError):
        spec.params["hidden"] = 9  # type: ignore[index]
    spec.params["heads"].append(3)  # a nested value is the spec's own copy: the config keeps its own
    assert cfg.model.params == {"hidden": 8, "heads": [1, 2]}
    assert build_foreign_step(spec).hidden == 8


def test_auto_with_a_remembered_mode_compiles_only_that_mode(caplog: pytest.LogCaptureFixture) -> None:
    compiled = CompiledStep(
        tiny_step(_spec()), SHAPES, jit_compile="auto", factory="tests.steps:tiny_step", remembered="graph"
    )
    with caplog.at_level(logging.INFO, logger="melfeed.consumer.train.step"):
        compiled.warm_up()
    assert compiled.mode == "graph" and compiled.traces == 2  # no XLA compile, no timing
    assert not any(r.getMessage().startswith("jit_compile auto:") for r in caplog.records)
    ignored = CompiledStep(tiny_step(_spec()), SHAPES, jit_compile=True, remembered="graph")
    ignored.warm_up()
    assert ignored.mode == "xla"  # only "auto" remembers


class _TraceFailingStep:
    """A step whose Keras layer raises a multi-line error whenever it is traced, XLA or graph mode."""

    def __init__(self, spec: StepSpec) -> None:
        import keras

        class Decoder(keras.layers.Layer):  # type: ignore[misc]  # Keras is untyped
            def call(self, x: tf.Tensor) -> tf.Tensor:
                raise ValueError("the decoder needs 80 channels\ngot 8")

        self.decoder, self.w = Decoder(), tf.Variable(0.0)

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(self.decoder(mel)) * self.w

    def variables(self) -> list[tf.Variable]:
        return [self.w]


def test_auto_keeps_xlas_failure_as_the_reason_when_graph_mode_fails_too(caplog: pytest.LogCaptureFixture) -> None:
    compiled = CompiledStep(_TraceFailingStep(_spec()), SHAPES, jit_compile="auto", factory="m:f")
    with caplog.at_level(logging.WARNING), pytest.raises(StepError) as info:
        compiled.warm_up()
    line = _TraceFailingStep.__init__.__code__.co_firstlineno + 5  # the layer's raise
    assert (
        str(info.value) == f"model.step m:f: the step fails in graph mode: ValueError: the decoder needs 80 "
        f"channels got 8 ({__file__}:{line})"
    )
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and warnings[0].startswith(
        "XLA cannot compile the step of m:f, using graph mode: ValueError: the decoder needs 80 channels got 8"
    )
    assert compiled.choice is not None and compiled.choice.reason.startswith("XLA cannot compile the step: ValueError")


def test_a_step_whose_xla_compile_killed_a_start_trains_in_graph_mode_or_stops_under_true(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / ATTEMPTS_NAME).write_text('{"open": {"step": "s", "program": "bucket A"}, "crashed": []}')
    compiled = CompiledStep(
        tiny_step(_spec()),
        SHAPES,
        jit_compile="auto",
        factory="tests.steps:tiny_step",
        remembered="xla",
        attempts=XlaAttempts(tmp_path, "s"),
    )
    with caplog.at_level(logging.WARNING):
        compiled.warm_up()
    assert compiled.mode == "graph" and compiled.traces == 2  # XLA not even traced
    assert compiled.choice is not None and compiled.choice.reason.startswith("XLA not tried: an earlier start died")
    assert len(_warnings(caplog)) == 1 and str(tmp_path / ATTEMPTS_NAME) in _warnings(caplog)[0]
    strict = CompiledStep(tiny_step(_spec()), SHAPES, jit_compile=True, attempts=XlaAttempts(tmp_path, "s"))
    with pytest.raises(StepError, match="jit_compile: true.*an earlier start died compiling it with XLA"):
        strict.warm_up()
