"""A float16 wire (``transport.mel_dtype: float16``): the step gets float16 mel and casts inside its program.

The reference step on float16 slots (DLPack, no copy) must train exactly as on float32 slots holding the
same (float16-representable) values; a step that does not cast is told so at warm-up, in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.train.handoff import aligned_empty, to_tensors
from melfeed.consumer.train.model import StepSpec, build_reference_step
from melfeed.consumer.train.step import CompiledStep
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import StepError
from tests.steps import _TinyStep, tiny_step

pytestmark = pytest.mark.tf

N_MELS = 8
ROWS, FRAMES, TOKENS = 2, 12, 4
SHAPES = {"mel": (ROWS, FRAMES, N_MELS), "mel_len": (ROWS,), "tokens": (ROWS, TOKENS), "tok_len": (ROWS,)}


def _spec(mel_dtype: str = "float32") -> StepSpec:
    return StepSpec(N_MELS, 32, 1e-2, False, 0, bucket_shapes=(SHAPES,), mel_dtype=mel_dtype)


def _slots(mel_dtype: str, seed: int) -> dict[str, np.ndarray]:
    """Aligned arrays as a ring slot holds them; the mel values are float16-representable in both dtypes."""
    rng = np.random.default_rng(seed)
    slot = {k: aligned_empty(s, mel_dtype if k == "mel" else np.int32) for k, s in SHAPES.items()}
    slot["mel"][...] = rng.normal(size=SHAPES["mel"]).astype(np.float16)
    slot["mel_len"][...] = rng.integers(1, FRAMES + 1, ROWS)
    slot["tokens"][...] = rng.integers(1, 32, (ROWS, TOKENS))
    slot["tok_len"][...] = rng.integers(1, TOKENS + 1, ROWS)
    return slot


def _train(mel_dtype: str, jit_compile: bool, step: object) -> tuple[list[float], list[np.ndarray]]:
    compiled = CompiledStep(step, [SHAPES], jit_compile=jit_compile, mel_dtype=mel_dtype)  # type: ignore[arg-type]
    compiled.warm_up()
    losses = []
    for seed in range(3):
        tensors, copies = to_tensors(_slots(mel_dtype, seed))
        assert copies == 0 and tensors["mel"].dtype == tf.as_dtype(mel_dtype)  # float16 through DLPack too
        losses.append(float(compiled.run(0, tensors)["loss"]))
    return losses, [v.numpy() for v in step.variables()]  # type: ignore[attr-defined]


def test_the_reference_step_on_float16_trains_bit_identically_to_float32_of_the_same_values() -> None:
    wide = _train("float32", False, build_reference_step(_spec()))
    half = _train("float16", False, build_reference_step(_spec("float16")))
    assert half[0] == wide[0] and all(h.tobytes() == w.tobytes() for h, w in zip(half[1], wide[1]))
    assert half[0][0] > 0


class _CastingTiny(_TinyStep):
    """``tiny_step`` as a user would fix it for a float16 wire: one cast, inside the compiled program."""

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        return super().__call__(tf.cast(mel, tf.float32), mel_len, tokens, tok_len)


def test_under_xla_the_cast_runs_inside_the_program_and_a_float32_batch_is_refused() -> None:
    wide = _train("float32", True, _CastingTiny(_spec()))
    half = _train("float16", True, _CastingTiny(_spec("float16")))
    assert half[0] == wide[0] and all(h.tobytes() == w.tobytes() for h, w in zip(half[1], wide[1]))
    compiled = CompiledStep(_CastingTiny(_spec("float16")), [SHAPES], jit_compile=True, mel_dtype="float16")
    with pytest.raises(TypeError, match="batch\\['mel'\\] has dtype float32, want float16"):
        compiled.run(0, to_tensors(_slots("float32", 0))[0])


def test_a_step_that_does_not_cast_is_told_to_in_one_line() -> None:
    compiled = CompiledStep(
        tiny_step(_spec("float16")), [SHAPES], jit_compile=False, factory="tests.steps:tiny_step", mel_dtype="float16"
    )
    with pytest.raises(StepError) as info:
        compiled.warm_up()
    message = str(info.value)
    assert message.startswith("model.step tests.steps:tiny_step: the step fails in graph mode: ")
    assert message.endswith(
        "(mel is float16 here, transport.mel_dtype: float16: cast it in the step, "
        "tf.cast(mel, tf.float32); docs/guide/your-model.md)"
    )
    assert "\n" not in message


def test_step_spec_tells_the_step_the_wire_dtype() -> None:
    cfg = config_from_mapping({"transport": {"mel_dtype": "float16"}})
    assert StepSpec.from_config(cfg, [SHAPES], None).mel_dtype == "float16"
    assert StepSpec.from_config(config_from_mapping({}), [SHAPES], None).mel_dtype == "float32"
    with pytest.raises(ValueError):
        _spec("bfloat16")


def test_the_resident_limit_uses_the_wire_dtype() -> None:
    from melfeed.consumer.train.device.packed import PackedSteps, RegionLayout
    from melfeed.consumer.train.efficiency import measure_resident_limit, resident_arrays
    from melfeed.shared.wire.layout import ALIGN_BYTES, round_up

    dtypes = {"mel": "float16", "mel_len": "int32", "tokens": "int32", "tok_len": "int32"}
    assert resident_arrays(SHAPES, 32, dtypes)["mel"].dtype == np.float16
    assert resident_arrays(SHAPES, 32)["mel"].dtype == np.float32
    step = _CastingTiny(_spec("float16"))
    compiled = CompiledStep(step, [SHAPES], jit_compile=False, mel_dtype="float16")
    compiled.warm_up()
    rows, offset = [], 0  # the slot layout of the bucket: float16 mel, then the int32 arrays
    for name, shape in SHAPES.items():
        dtype = np.dtype(dtypes[name])
        rows.append((name, offset, shape, dtype))
        offset = round_up(offset + int(np.prod(shape)) * dtype.itemsize, ALIGN_BYTES)
    packed = PackedSteps(compiled, [RegionLayout.of(rows)])
    packed.warm_up(step.variables())
    limit = measure_resident_limit(packed, step.variables(), [SHAPES], 2, 32, [dtypes])
    assert len(limit.step_s) == 1 and limit.step_s[0] > 0
