"""``TfStageAdapter`` on the CPU: the slot region is wrapped, never declared copied, a step is done when it returns."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.handout import Batch
from melfeed.consumer.train.device.packed import PackedSteps
from melfeed.consumer.train.handoff import TfStageAdapter, model_device
from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.step import CompiledStep
from melfeed.shared.errors import StepError
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.layout import aligned_buffer, batch_layout, layout_views
from tests.steps import _TinyStep, tiny_step

pytestmark = pytest.mark.tf

N_MELS = 8
SHAPES = {"mel": (2, 8, N_MELS), "mel_len": (2,), "tokens": (2, 4), "tok_len": (2,)}


BUCKET = Bucket(0, 2, 8, 4, N_MELS)
_SLOT = aligned_buffer(4096)


def _slot_batch() -> Batch:
    arrays = layout_views(_SLOT, 0, batch_layout(BUCKET))
    arrays["mel"][:] = 1.0
    arrays["mel_len"][:] = 8
    arrays["tokens"][:] = 1
    arrays["tok_len"][:] = 4
    return Batch(PlannedBatch(0, 0, 0, (0, 1)), arrays, slot=0)


def _handoff(step: object, factory: str = "step", on_step: object = None) -> TfStageAdapter:
    compiled = CompiledStep(step, [SHAPES], jit_compile=False, factory=factory)  # type: ignore[arg-type]
    compiled.warm_up()
    packed = PackedSteps.for_buckets(compiled, [BUCKET], None)
    packed.warm_up(step.variables())  # type: ignore[attr-defined]
    return TfStageAdapter(packed, None, on_step=on_step, slot_buffer=lambda slot: _SLOT)  # type: ignore[arg-type]


def test_the_cpu_hand_off_aliases_the_slot_until_the_step_completed_and_reads_nothing_per_step() -> None:
    assert model_device() is None  # this machine has no GPU: the CPU path
    spec = StepSpec(N_MELS, 32, 0.1, False, 0, bucket_shapes=(SHAPES,))
    steps_seen: list[int] = []
    handoff = _handoff(tiny_step(spec), on_step=steps_seen.append)
    batch = _slot_batch()
    staged = handoff.put(batch)
    assert staged.copied is None and staged.host_copies == 0  # the slot stays held until the step completed
    batch.arrays["mel"][0, 0, 0] = 5.0  # zero copy: the staged region shows the slot's bytes
    assert staged.value.dtype == tf.uint8 and staged.value.numpy()[:4].view(np.float32)[0] == 5.0
    done = handoff.step(batch, staged.value)
    assert handoff.is_done(done) and steps_seen == [1] and handoff.wait(done).number == 1
    read = handoff.read()  # the interval's outputs, read once
    assert read.steps == 1 and list(read.last) == ["loss"] and read.last["loss"] > 0


class _LoudStep(_TinyStep):
    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        tf.debugging.assert_less(tf.reduce_max(mel), 2.0, message="mel too loud")  # the line the error names
        return super().__call__(mel, mel_len, tokens, tok_len)


def test_a_step_that_fails_while_training_is_one_line_naming_the_batch_op_and_the_users_line() -> None:
    spec = StepSpec(N_MELS, 32, 0.1, False, 0, bucket_shapes=(SHAPES,))
    handoff = _handoff(_LoudStep(spec), factory="mine:loud")  # zeros pass the assertion
    batch = _slot_batch()
    batch.arrays["mel"][:] = 5.0
    with pytest.raises(StepError) as info:
        handoff.step(batch, handoff.put(batch).value)
    text = str(info.value)
    line = _LoudStep.__call__.__code__.co_firstlineno + 1
    assert text.startswith(
        f"model.step mine:loud: the step failed on batch 0: op assert_less/Assert/AssertGuard/Assert "
        f"({__file__}:{line}): assertion failed: [mel too loud]"
    ), text
    assert "\n" not in text and isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)
