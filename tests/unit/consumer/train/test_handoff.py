"""``TfHandOff`` on the CPU: the slot is wrapped, never declared copied, and a step is done when ``run`` returns."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.handout import Batch
from melfeed.consumer.train.handoff import TfHandOff, model_device
from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.step import CompiledStep
from melfeed.consumer.train.handoff import aligned_empty
from melfeed.shared.errors import StepError
from tests.steps import _TinyStep, tiny_step

N_MELS = 8
SHAPES = {"mel": (2, 8, N_MELS), "mel_len": (2,), "tokens": (2, 4), "tok_len": (2,)}


def _slot_batch() -> Batch:
    arrays = {name: aligned_empty(shape, np.float32 if name == "mel" else np.int32) for name, shape in SHAPES.items()}
    arrays["mel"][:] = 1.0
    arrays["mel_len"][:] = 8
    arrays["tokens"][:] = 1
    arrays["tok_len"][:] = 4
    return Batch(PlannedBatch(0, 0, 0, (0, 1)), arrays, slot=0)


def test_the_cpu_hand_off_aliases_the_slot_until_the_step_completed_and_reads_the_scalars_after() -> None:
    assert model_device() is None                       # this machine has no GPU: the CPU path
    spec = StepSpec(N_MELS, 32, 0.1, False, 0, bucket_shapes=[SHAPES])
    compiled = CompiledStep(tiny_step(spec), [SHAPES], jit_compile=False)
    compiled.warm_up()
    steps_seen: list[int] = []
    handoff = TfHandOff(compiled, None, on_step=steps_seen.append)
    batch = _slot_batch()
    staged = handoff.put(batch)
    assert staged.copied is None and staged.host_copies == 0   # the slot stays held until the step completed
    batch.arrays["mel"][0, 0, 0] = 5.0                  # zero copy: the staged tensor shows the slot's bytes
    assert float(staged.value["mel"][0, 0, 0]) == 5.0
    raw = handoff.step(batch, staged.value)
    assert handoff.is_done(raw) and steps_seen == [1]
    result = handoff.wait(raw)
    assert list(result.outputs) == ["loss"] and result.outputs["loss"] > 0 and result.raw is raw


class _LoudStep(_TinyStep):
    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        tf.debugging.assert_less(tf.reduce_max(mel), 2.0, message="mel too loud")   # the line the error names
        return super().__call__(mel, mel_len, tokens, tok_len)


def test_a_step_that_fails_while_training_is_one_line_naming_the_batch_op_and_the_users_line() -> None:
    spec = StepSpec(N_MELS, 32, 0.1, False, 0, bucket_shapes=[SHAPES])
    compiled = CompiledStep(_LoudStep(spec), [SHAPES], jit_compile=False, factory="mine:loud")
    compiled.warm_up()                                  # zeros pass the assertion
    handoff = TfHandOff(compiled, None)
    batch = _slot_batch()
    batch.arrays["mel"][:] = 5.0
    with pytest.raises(StepError) as info:
        handoff.step(batch, handoff.put(batch).value)
    text = str(info.value)
    line = _LoudStep.__call__.__code__.co_firstlineno + 1
    assert text.startswith(f"model.step mine:loud: the step failed on batch 0: op assert_less/Assert/AssertGuard/Assert "
                           f"({__file__}:{line}): assertion failed: [mel too loud]"), text
    assert "\n" not in text and isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)
