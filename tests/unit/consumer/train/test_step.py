"""CompiledStep warm-up and retrace accounting, step-factory loading, zero-copy hand-off."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.train.handoff import aligned_empty, to_tensors
from melfeed.consumer.train.model import StepSpec, TrainStep, build_reference_step
from melfeed.consumer.train.step import CompiledStep, build_step, load_step_factory
from melfeed.shared.errors import ConfigError, StepError
from tests.steps import _TinyStep, tiny_step

pytestmark = pytest.mark.tf

N_MELS = 16  # small: these tests check compilation and bookkeeping, not learning


def _step(seed: int = 0) -> TrainStep:
    return build_reference_step(
        StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=seed)
    )


def _shapes(rows: int, frames: int, tokens: int) -> dict[str, tuple[int, ...]]:
    return {"mel": (rows, frames, N_MELS), "mel_len": (rows,), "tokens": (rows, tokens), "tok_len": (rows,)}


def _batch(rows: int, frames: int, tokens: int, seed: int = 0) -> dict[str, tf.Tensor]:
    rng = np.random.default_rng(seed)
    tok_len = rng.integers(1, tokens + 1, rows).astype(np.int32)
    return {
        "mel": tf.constant(rng.normal(size=(rows, frames, N_MELS)).astype(np.float32)),
        "mel_len": tf.constant(rng.integers(1, frames + 1, rows).astype(np.int32)),
        "tokens": tf.constant(rng.integers(1, 32, (rows, tokens)).astype(np.int32)),
        "tok_len": tf.constant(tok_len),
    }


# --- load_step_factory ------------------------------------------------------------------------


def test_load_step_factory_returns_the_named_function() -> None:
    assert load_step_factory("melfeed.consumer.train.model:build_reference_step") is build_reference_step


@pytest.mark.parametrize(
    ("dotted", "reason"),
    [
        ("melfeed_no_such_module:build", "cannot import module 'melfeed_no_such_module'"),
        ("melfeed.consumer.train.model:no_such_factory", "has no attribute 'no_such_factory'"),
        ("melfeed.consumer.train.model:__all__", "is a list, not callable"),
        ("melfeed.consumer.train.model", "must look like 'module:function'"),
    ],
)
def test_load_step_factory_reports_bad_names_as_config_errors(dotted: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_step_factory(dotted)
    assert info.value.path == ("model", "step") and info.value.got == dotted
    assert reason in str(info.value) and "\n" not in str(info.value)


def test_load_step_factory_reports_a_module_that_fails_on_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "melfeed_broken_step.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "melfeed_broken_step", raising=False)
    with pytest.raises(ConfigError, match="RuntimeError: boom second line, got"):
        load_step_factory("melfeed_broken_step:build")


_HERE = "tests.unit.consumer.train.test_step"


def raising_factory(spec: StepSpec) -> TrainStep:
    raise KeyError("hidden")  # a user's bug: the line build_step names


class _NoVariables:
    def __call__(self, *arrays: tf.Tensor) -> tf.Tensor:
        return tf.reduce_mean(arrays[0])


def no_variables(spec: StepSpec) -> _NoVariables:
    return _NoVariables()


class _ListsNumbers(_TinyStep):
    def variables(self) -> list[tf.Variable]:
        return [1.0]


@pytest.mark.parametrize(
    ("factory", "says"),
    [
        (
            f"{_HERE}:raising_factory",
            f"the factory raised KeyError: 'hidden' ({__file__}:{raising_factory.__code__.co_firstlineno + 1})",
        ),
        (
            "builtins:print",
            "the factory returned None, not a step: it needs __call__(mel, mel_len, tokens, tok_len) and variables()",
        ),
        (f"{_HERE}:no_variables", "the factory returned a _NoVariables, not a step"),
        (f"{_HERE}:_NoVariables", "the factory raised TypeError: _NoVariables() takes no arguments, got"),  # no line
        (f"{_HERE}:_ListsNumbers", "_ListsNumbers.variables() holds float, not a variable"),
    ],
)
def test_build_step_refuses_a_factory_that_raises_or_returns_no_step_in_one_line(factory: str, says: str) -> None:
    spec = StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0)
    with pytest.raises(ConfigError) as info:
        build_step(factory, spec)
    assert info.value.path == ("model", "step") and info.value.got == factory
    assert says in str(info.value) and "\n" not in str(info.value)


class _TwoArrays(_TinyStep):
    def __call__(self, mel: tf.Tensor, tokens: tf.Tensor) -> tf.Tensor:  # type: ignore[override]
        return tf.reduce_mean(mel)


def test_a_call_that_cannot_take_the_batch_is_refused_before_any_compile() -> None:
    spec = StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0)
    with pytest.raises(ConfigError) as info:
        CompiledStep(_TwoArrays(spec), [_shapes(2, 16, 4)], factory="m:f")  # type: ignore[arg-type]  # the misfit is tested
    assert str(info.value).startswith(
        "model.step: _TwoArrays.__call__(mel, tokens) cannot take the batch: too many "
        "positional arguments; it is called as step(mel, mel_len, tokens, tok_len)"
    )


class _ChecksLengths(_TinyStep):
    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        tf.debugging.assert_positive(mel_len, message="empty utterance")
        return super().__call__(mel, mel_len, tokens, tok_len)


def test_a_step_that_fails_on_the_all_padding_warm_up_batch_is_told_so() -> None:
    spec = StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0)
    with pytest.raises(StepError) as info:
        CompiledStep(_ChecksLengths(spec), [_shapes(2, 16, 4)], jit_compile=False, factory="m:f").warm_up()
    assert str(info.value).startswith(
        "model.step m:f: the step fails in graph mode on the warm-up batch (all "
        "padding: every length 0, as in a padded partial batch): op assert_positive/"
    )


def test_under_auto_a_step_whose_check_fails_only_in_graph_mode_trains_with_xla_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0)
    compiled = CompiledStep(_ChecksLengths(spec), [_shapes(2, 16, 4)], jit_compile="auto", factory="m:f")
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.train.step"):
        compiled.warm_up()  # XLA compiled it (and drops the assertion), graph mode failed
    assert compiled.mode == "xla" and compiled.choice is not None and compiled.choice.mode == "xla"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "jit_compile auto: the step fails in graph mode on the warm-up batch"
    ), warnings
    assert "using XLA, which compiled and ran it" in warnings[0]


class _ForgetsMomentum(_TinyStep):
    def variables(self) -> list[tf.Variable]:
        return [self.w, self.iterations]


class _LazyMomentum(_TinyStep):
    """Creates its momentum on the first call, as a Keras optimizer not built in the factory does."""

    def __init__(self, spec: StepSpec) -> None:
        super().__init__(spec)
        self.lazy: list[tf.Variable] = []

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        if not self.lazy:
            self.lazy.append(tf.Variable(tf.zeros([N_MELS]), name="lazy_momentum"))
        self.lazy[0].assign_add(tf.reduce_mean(mel, axis=[0, 1]) + 1.0)
        return super().__call__(mel, mel_len, tokens, tok_len)

    def variables(self) -> list[tf.Variable]:
        return [*super().variables(), *self.lazy]


@pytest.mark.parametrize(
    ("step", "says"),
    [
        (tiny_step, None),
        (_ForgetsMomentum, "variables() leaves out 1 variable(s) (momentum:0) its step uses"),
        (
            _LazyMomentum,
            "1 variable(s) (lazy_momentum:0) were created while the step was traced, after the factory "
            "returned (build them in the factory",
        ),
    ],
)
def test_variables_warm_up_cannot_put_back_get_one_warning_naming_them(
    step: type, says: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    spec = StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0)
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.train.step"):
        CompiledStep(step(spec), [_shapes(2, 16, 4)], jit_compile=False, factory="m:f").warm_up()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == (0 if says is None else 1) and all(str(says) in line for line in lines)


# --- CompiledStep -----------------------------------------------------------------------------


def test_warm_up_compiles_every_bucket_and_restores_every_variable_bit_exactly() -> None:
    step = tiny_step(StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0))
    step(*_batch(4, 24, 6).values())  # non-zero weights, momentum and iteration count, as after a restore
    before = [v.numpy() for v in step.variables()]
    compiled = CompiledStep(step, [_shapes(4, 24, 6), _shapes(2, 40, 10), _shapes(4, 24, 6)])  # XLA, the default
    assert compiled.warm_up() > 0
    assert compiled.traces == 2 and compiled.compiles_after_ready == 0 and compiled.is_ready
    after = [v.numpy() for v in step.variables()]
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(before, after))
    for bucket, (rows, frames, tokens) in enumerate([(4, 24, 6), (2, 40, 10), (4, 24, 6)]):
        outputs = compiled.run(bucket, _batch(rows, frames, tokens, seed=bucket))
        loss = outputs["loss"]
        assert list(outputs) == ["loss"]  # a bare scalar loss means {"loss": loss}
        assert loss.shape == () and loss.dtype == tf.float32 and float(loss) > 0
    assert compiled.traces == 2 and compiled.compiles_after_ready == 0


def test_new_shape_after_warm_up_is_compiled_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    spec = StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0)
    compiled = CompiledStep(tiny_step(spec), [_shapes(2, 16, 4)], jit_compile=False)  # counting is the same under XLA
    compiled.warm_up()
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.train.step"):
        compiled.run(0, _batch(2, 16, 4))
        assert compiled.compiles_after_ready == 0
        compiled.run(0, _batch(2, 24, 4))
        compiled.run(0, _batch(2, 24, 4, seed=1))  # same new shape: its program is reused
    assert compiled.compiles_after_ready == 1 and compiled.traces == 2
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "after warm-up" in caplog.records[0].getMessage()


def test_compiled_step_rejects_bad_bucket_shapes_and_dtypes() -> None:
    step = tiny_step(StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0))
    with pytest.raises(ValueError, match="inconsistent"):
        CompiledStep(step, [{**_shapes(2, 16, 4), "tok_len": (3,)}])
    with pytest.raises(ValueError, match="keys"):
        CompiledStep(step, [{"mel": (2, 16, N_MELS)}])
    compiled = CompiledStep(step, [_shapes(2, 16, 4)])
    with pytest.raises(TypeError, match="tokens"):
        compiled.run(0, {**_batch(2, 16, 4), "tokens": tf.zeros((2, 4), tf.int64)})


# --- to_tensors / aligned_empty ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8, np.float64])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (4, 33, 7)])
def test_aligned_empty_is_aligned_and_contiguous(shape: tuple[int, ...], dtype: type) -> None:
    arr = aligned_empty(shape, dtype)
    assert arr.shape == shape and arr.dtype == dtype and arr.flags.c_contiguous
    assert arr.ctypes.data % 64 == 0 and arr.flags.writeable
    assert aligned_empty(shape, dtype, alignment=4096).ctypes.data % 4096 == 0
    with pytest.raises(ValueError):
        aligned_empty(shape, dtype, alignment=48)


def test_to_tensors_aliases_aligned_arrays_without_copying() -> None:
    mel = aligned_empty((2, 8, N_MELS), np.float32)
    mel[...] = 1.0
    lens = aligned_empty((2,), np.int32)
    lens[...] = 8
    tensors, copies = to_tensors({"mel": mel, "mel_len": lens})
    assert copies == 0
    mel[1, 3, 5] = 42.0  # written after conversion: an aliased tensor sees it
    lens[0] = 3
    assert float(tensors["mel"][1, 3, 5]) == 42.0 and int(tensors["mel_len"][0]) == 3
    assert tensors["mel"].dtype == tf.float32 and tensors["mel"].shape == (2, 8, N_MELS)


def test_to_tensors_copies_misaligned_strided_and_readonly_arrays() -> None:
    raw = aligned_empty((4 * 64 + 4,), np.uint8)
    misaligned = raw[4:].view(np.float32).reshape(8, 8)  # C-contiguous, address % 64 == 4
    assert misaligned.flags.c_contiguous and misaligned.ctypes.data % 64 == 4
    strided = aligned_empty((8, 8), np.float32)[:, ::2]
    readonly = aligned_empty((8,), np.float32)
    readonly.flags.writeable = False
    for arr in (misaligned, strided):
        arr[...] = 1.0
    tensors, copies = to_tensors({"a": misaligned, "b": strided, "c": readonly})
    assert copies == 3
    misaligned[0, 0] = 42.0
    assert float(tensors["a"][0, 0]) == 1.0  # a copy: later writes do not show
    assert tensors["b"].shape == (8, 4)


def test_compiled_step_runs_on_dlpack_tensors() -> None:
    rows, frames, tokens = 2, 16, 4
    slot = {
        "mel": aligned_empty((rows, frames, N_MELS), np.float32),
        "mel_len": aligned_empty((rows,), np.int32),
        "tokens": aligned_empty((rows, tokens), np.int32),
        "tok_len": aligned_empty((rows,), np.int32),
    }
    for name, value in _batch(rows, frames, tokens).items():
        slot[name][...] = value.numpy()
    reference = float(_step()(*[tf.constant(slot[k]) for k in slot]))  # type: ignore[arg-type]  # a bare loss
    compiled = CompiledStep(_step(), [_shapes(rows, frames, tokens)], jit_compile=False)  # the hand-off is the subject
    compiled.warm_up()
    tensors, copies = to_tensors(slot)
    assert copies == 0
    np.testing.assert_allclose(float(compiled.run(0, tensors)["loss"]), reference, rtol=1e-5)
