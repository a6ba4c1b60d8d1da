"""One uint8 region per batch: the program takes only it, cuts it into the arrays, and trains bit-identically."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.handout import Batch
from melfeed.consumer.train.device.packed import PackedSteps
from melfeed.consumer.train.handoff import TfStageAdapter
from melfeed.consumer.train.model import StepSpec, build_reference_step
from melfeed.consumer.train.step import CompiledStep
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.layout import aligned_buffer, batch_layout, layout_nbytes, layout_views
from melfeed.shared.wire.schema import ExtraSpec

pytestmark = pytest.mark.tf

N_MELS = 16
_STEPS = 4


def _bucket(mel_dtype: str = "float32", extras: tuple[ExtraSpec, ...] = ()) -> Bucket:
    return Bucket(
        0,
        4,
        24,
        8,
        N_MELS,
        extras=extras,
        seq_lengths=(3,) * sum(e.kind == "sequence" for e in extras),
        mel_dtype=mel_dtype,
    )


def _fill(views: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    for name, view in views.items():
        if name == "mel" or view.dtype.kind == "f":
            view[...] = rng.normal(size=view.shape).astype(view.dtype)
        elif name == "tokens":
            view[...] = rng.integers(1, 32, view.shape)
        else:
            view[...] = rng.integers(1, view.shape[1] + 1 if view.ndim > 1 else 9, view.shape)


class _Slots:
    """Two slots laid out as the ring lays them out (``layout_views``); ``buffer`` is ``BatchRing.memory.buffer``."""

    def __init__(self, bucket: Bucket) -> None:
        self.buffers = [aligned_buffer(layout_nbytes(bucket) + 4096) for _ in range(2)]
        self.layout = batch_layout(bucket)

    def buffer(self, slot: int) -> np.ndarray:
        return self.buffers[slot]

    def batch(self, batch_id: int, rng: np.random.Generator) -> Batch:
        slot = batch_id % 2
        views = layout_views(self.buffers[slot], 0, self.layout)
        _fill(views, rng)
        return Batch(PlannedBatch(batch_id, 0, 0, (0, 1, 2, 3)), views, slot=slot)


def _step() -> Any:
    return build_reference_step(
        StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0)
    )


def _per_array_run(bucket: Bucket, jit: bool, extras: tuple[ExtraSpec, ...] = ()) -> tuple[list[bytes], list[float]]:
    step = _step()
    compiled = CompiledStep(step, [bucket.shapes()], jit_compile=jit, extras=extras, mel_dtype=bucket.mel_dtype)
    compiled.warm_up()
    slots, rng, losses = _Slots(bucket), np.random.default_rng(3), []
    for i in range(_STEPS):
        batch = slots.batch(i, rng)
        losses.append(float(compiled.run(0, {k: tf.constant(v) for k, v in batch.arrays.items()})["loss"]))
    return [v.numpy().tobytes() for v in step.variables()], losses


def _packed_run(bucket: Bucket, jit: bool, extras: tuple[ExtraSpec, ...] = ()) -> tuple[list[bytes], Any, Any]:
    step = _step()
    compiled = CompiledStep(step, [bucket.shapes()], jit_compile=jit, extras=extras, mel_dtype=bucket.mel_dtype)
    packed = PackedSteps.for_buckets(compiled, [bucket], None)
    packed.warm_up(step.variables())  # as the training loop does: compiles only the packed program
    slots, rng = _Slots(bucket), np.random.default_rng(3)
    handoff = TfStageAdapter(packed, None, slot_buffer=slots.buffer)
    for i in range(_STEPS):
        batch = slots.batch(i, rng)
        staged = handoff.put(batch)
        assert staged.host_copies == 0 and staged.copied is None  # the slot itself, held to the step's end
        handoff.wait(handoff.step(batch, staged.value))
    return [v.numpy().tobytes() for v in step.variables()], handoff, packed


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_the_program_takes_one_uint8_region_and_trains_bit_identically_to_the_per_array_path(jit: bool) -> None:
    bucket = _bucket()
    want, losses = _per_array_run(bucket, jit)
    got, handoff, packed = _packed_run(bucket, jit)
    assert got == want  # every variable, bit for bit
    args, kwargs = packed.program(0).structured_input_signature
    assert kwargs == {} and [(a.dtype, tuple(a.shape)) for a in args] == [(tf.uint8, (layout_nbytes(bucket),))]
    assert handoff.transfers == _STEPS and handoff.dispatched == _STEPS  # one tensor to the device per batch
    read = packed.accumulators.read()
    assert read.steps == _STEPS and read.sums["loss"] == sum(losses)  # float64 sums of the same float32 values
    assert read.first["loss"] == losses[0] and read.last["loss"] == losses[-1]


def test_float16_mels_and_extras_are_cut_from_the_region_where_the_layout_put_them() -> None:
    extras = (ExtraSpec("speaker", "utterance", "int32"), ExtraSpec("ref", "sequence", "float16", (2,)))
    bucket = _bucket("float16", extras)
    shapes = bucket.shapes()
    packed_names: list[str] = []

    class _Sees:
        def __call__(
            self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, **extras: tf.Tensor
        ) -> dict[str, tf.Tensor]:
            packed_names.extend(extras)
            return {
                "loss": tf.reduce_sum(tf.cast(mel, tf.float32)),
                "speaker": tf.cast(tf.reduce_sum(extras["speaker"]), tf.float32),
                "ref": tf.reduce_sum(tf.cast(extras["ref"], tf.float32)),
                "ref_len": tf.cast(tf.reduce_sum(extras["ref_len"]), tf.float32),
                "tokens": tf.cast(tf.reduce_sum(tokens), tf.float32),
            }

        def variables(self) -> list[Any]:
            return []

    compiled = CompiledStep(_Sees(), [shapes], jit_compile=False, extras=extras, mel_dtype="float16")
    compiled.warm_up()
    packed = PackedSteps.for_buckets(compiled, [bucket], None)
    packed.warm_up([])
    slots = _Slots(bucket)
    handoff = TfStageAdapter(packed, None, slot_buffer=slots.buffer)
    batch = slots.batch(0, np.random.default_rng(5))
    handoff.step(batch, handoff.put(batch).value)
    read = packed.accumulators.read()
    a = batch.arrays
    assert {"speaker", "ref", "ref_len"} <= set(packed_names)  # (**extras also takes the row inputs)
    args, _ = packed.program(0).structured_input_signature
    assert [a.dtype for a in args] == [tf.uint8]  # rows too come from the region
    assert read.last == pytest.approx(
        {
            "loss": float(a["mel"].astype(np.float32).sum()),
            "speaker": float(a["speaker"].sum()),
            "ref": float(a["ref"].astype(np.float32).sum()),
            "ref_len": float(a["ref_len"].sum()),
            "tokens": float(a["tokens"].sum()),
        },
        rel=1e-3,
    )


class _CountsRows:
    """A step that takes ``rows`` and ``row_mask`` and returns what it was given."""

    def __call__(
        self,
        mel: tf.Tensor,
        mel_len: tf.Tensor,
        tokens: tf.Tensor,
        tok_len: tf.Tensor,
        *,
        rows: tf.Tensor,
        row_mask: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        return {
            "loss": tf.cast(rows, tf.float32),
            "mask": tf.reduce_sum(tf.cast(row_mask, tf.float32)),
            "mel_len": tf.cast(tf.reduce_sum(mel_len), tf.float32),
        }

    def variables(self) -> list[Any]:
        return []


@pytest.mark.parametrize("in_slot", [True, False], ids=["slot", "packed"])
def test_a_row_input_step_reads_rows_from_the_one_region_it_is_given(in_slot: bool) -> None:
    bucket = _bucket()
    compiled = CompiledStep(_CountsRows(), [bucket.shapes()], jit_compile=False)
    compiled.warm_up()
    packed = PackedSteps.for_buckets(compiled, [bucket], None)
    packed.warm_up([])
    layout = packed.layouts[0]
    assert layout.rows_offset is not None and layout.rows_offset >= layout_nbytes(bucket)  # after every array
    args, kwargs = packed.program(0).structured_input_signature
    assert kwargs == {} and [(a.dtype, tuple(a.shape)) for a in args] == [(tf.uint8, (layout.nbytes,))]
    slots = _Slots(bucket)
    handoff = TfStageAdapter(packed, None, slot_buffer=slots.buffer)
    for batch_id, rows in enumerate((3, 1)):  # partial batches: fewer real rows than B = 4
        full = slots.batch(batch_id, np.random.default_rng(batch_id))
        batch = Batch(
            PlannedBatch(batch_id, 0, 0, tuple(range(rows))),
            full.arrays if in_slot else {k: v.copy() for k, v in full.arrays.items()},
            slot=full.slot,
        )
        staged = handoff.put(batch)
        assert staged.host_copies == (0 if in_slot else 1)
        handoff.step(batch, staged.value)
        read = packed.accumulators.read()
        assert read.last == {"loss": rows, "mask": rows, "mel_len": float(full.arrays["mel_len"].sum())}
    assert handoff.transfers == 2  # one tensor per batch, rows inside it


def test_a_batch_whose_arrays_are_not_in_a_slot_is_packed_into_a_region_with_one_host_copy() -> None:
    bucket = _bucket()
    compiled = CompiledStep(_step(), [bucket.shapes()], jit_compile=False)
    packed = PackedSteps.for_buckets(compiled, [bucket], None)  # staging needs the layout, no compiled program
    slots = _Slots(bucket)
    batch = slots.batch(0, np.random.default_rng(1))
    loose = Batch(batch.planned, {k: v.copy() for k, v in batch.arrays.items()}, slot=0)
    staged = TfStageAdapter(packed, None, slot_buffer=slots.buffer).put(loose)
    assert staged.host_copies == 1
    region, slot = staged.value.numpy(), slots.buffer(0)
    for _, offset, shape, dtype in batch_layout(bucket):  # every array's bytes where the layout puts them
        end = offset + int(np.prod(shape)) * dtype.itemsize
        assert region[offset:end].tobytes() == slot[offset:end].tobytes()
