"""The resident-batch limit: a real compiled step, timed per bucket, leaves every variable as it was."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.train.device.packed import PackedSteps, RegionLayout
from melfeed.consumer.train.efficiency import measure_resident_limit, resident_arrays, resident_vocab
from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.step import CompiledStep
from melfeed.shared.errors import StepError
from melfeed.shared.wire.layout import ALIGN_BYTES, round_up
from tests.steps import _TinyStep, tiny_step

pytestmark = pytest.mark.tf

N_MELS = 8
_SHAPES = [
    {"mel": (4, 16, N_MELS), "mel_len": (4,), "tokens": (4, 5), "tok_len": (4,)},
    {"mel": (2, 32, N_MELS), "mel_len": (2,), "tokens": (2, 9), "tok_len": (2,)},
]


def _layout(shapes: dict[str, tuple[int, ...]]) -> RegionLayout:
    rows, offset = [], 0
    for name, shape in shapes.items():
        dtype = np.dtype(np.float32 if name == "mel" else np.int32)
        rows.append((name, offset, shape, dtype))
        offset = round_up(offset + int(np.prod(shape)) * dtype.itemsize, ALIGN_BYTES)
    return RegionLayout.of(rows)


def _packed(step: object, factory: str = "step") -> PackedSteps:
    compiled = CompiledStep(step, _SHAPES, jit_compile=False, factory=factory)  # type: ignore[arg-type]
    compiled.warm_up()
    packed = PackedSteps(compiled, [_layout(s) for s in _SHAPES])
    packed.warm_up(step.variables())  # type: ignore[attr-defined]
    return packed


def test_resident_batch_is_full_length_with_valid_token_ids_and_the_bucket_shapes() -> None:
    arrays = resident_arrays(_SHAPES[1], vocab_size=4)
    assert {k: v.shape for k, v in arrays.items()} == _SHAPES[1]
    assert arrays["mel"].dtype == np.float32 and arrays["tokens"].dtype == np.int32
    assert (arrays["mel_len"] == 32).all() and (arrays["tok_len"] == 9).all()
    assert arrays["tokens"].min() == 1 and arrays["tokens"].max() == 3  # never padding (0), always < vocab
    assert np.array_equal(arrays["mel"], resident_arrays(_SHAPES[1], vocab_size=4)["mel"])  # deterministic


def test_limit_is_timed_per_bucket_and_every_variable_is_restored_bit_for_bit() -> None:
    step = tiny_step(StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=0.1, mixed_precision=False, seed=0))
    packed = _packed(step)
    compiled = packed._compiled
    step.w.assign(np.linspace(-1.0, 1.0, N_MELS, dtype=np.float32))  # not the zeros a bug could restore to
    before = [v.numpy().copy() for v in step.variables()]
    limit = measure_resident_limit(packed, step.variables(), _SHAPES, steps_per_bucket=3, vocab_size=32)
    assert len(limit.step_s) == 2 and all(s > 0 for s in limit.step_s) and limit.steps_per_bucket == 3
    assert limit.measure_s >= max(limit.step_s)  # the median block of a bucket never exceeds its total
    for var, old in zip(step.variables(), before):
        assert var.numpy().tobytes() == old.tobytes(), var.name  # training never sees the measurement
    assert compiled.compiles_after_ready == 0  # the buckets' own programs ran
    assert packed.accumulators.read().steps == 0  # nor do the outputs


class _SmallEmbedding(_TinyStep):
    """A user's step with its own embedding of 16 rows: right for a cache whose ids are below 16."""

    def __call__(self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor) -> tf.Tensor:
        rows = tf.gather(tf.ones([16, N_MELS]), tokens)  # on the CPU an id >= 16 fails the step
        return super().__call__(mel, mel_len, tokens, tok_len) + 0.0 * tf.reduce_sum(rows)


def test_the_resident_batch_holds_only_the_ids_the_cache_holds_and_a_failure_is_one_line() -> None:
    assert (resident_vocab((1, 15), 256), resident_vocab(None, 256), resident_vocab((0, 0), 256)) == (16, 256, 2)
    step = _SmallEmbedding(StepSpec(n_mels=N_MELS, vocab_size=256, learning_rate=0.1, mixed_precision=False, seed=0))
    packed = _packed(step, "mine:small")
    cache_ids = resident_vocab((1, 15), 256)
    measure_resident_limit(packed, step.variables(), _SHAPES, steps_per_bucket=1, vocab_size=cache_ids)
    with pytest.raises(StepError) as info:  # ids up to model.vocab_size: ones the data never holds
        measure_resident_limit(packed, step.variables(), _SHAPES, steps_per_bucket=1, vocab_size=256)
    line = _SmallEmbedding.__call__.__code__.co_firstlineno + 1
    assert str(info.value) == (
        "model.step mine:small: the step fails on the resident batch of the feed-efficiency "
        "measure (full-length rows, token ids 1..255; consumer.feed_efficiency_steps: 0 skips "
        f"it): op GatherV2 ({__file__}:{line}): indices[3,0] = 16 is not in [0, 16)"
    )


def test_steps_per_bucket_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="steps_per_bucket must be >= 1"):
        measure_resident_limit(object(), [], _SHAPES, steps_per_bucket=0, vocab_size=32)


class _ClockedStep:
    """A stand-in for PackedSteps whose steps take the given seconds of a fake clock (pure timing logic)."""

    def __init__(self, durations_s: list[float]) -> None:
        self.now_s = 0.0
        self._durations_s = list(durations_s)
        self.layouts = [_layout(s) for s in _SHAPES]
        self.accumulators = self  # read() is the block's sync; reset() after
        self.order: list[int] = []  # the bucket of each step, in order

    def clock(self) -> float:
        return self.now_s

    def stage(self, bucket: int, region: object) -> tuple[object, int]:
        return region, 0

    def run(self, bucket: int, region: object) -> None:
        self.order.append(bucket)
        self.now_s += self._durations_s.pop(0)

    def read(self) -> None:
        return None

    def reset(self) -> None:
        return None


def test_limit_is_steps_over_wall_time_like_the_fed_figure_not_a_median(monkeypatch: pytest.MonkeyPatch) -> None:
    # untimed first step, then 9 timed in 3 blocks: a slow step recurring in every block counts, as it
    # does in the fed figure (a median of single steps would say 0.010)
    fake = _ClockedStep([5.0] + [0.010, 0.010, 0.040] * 3)
    monkeypatch.setattr(time, "perf_counter", fake.clock)
    limit = measure_resident_limit(fake, [], _SHAPES[:1], steps_per_bucket=9, vocab_size=32)
    assert limit.step_s == pytest.approx((0.020,))


def test_a_burst_of_another_process_in_one_block_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _ClockedStep([5.0] + [0.010, 0.010, 0.040] + [1.0, 1.0, 1.0] + [0.010, 0.010, 0.040])
    monkeypatch.setattr(time, "perf_counter", fake.clock)
    limit = measure_resident_limit(fake, [], _SHAPES[:1], steps_per_bucket=9, vocab_size=32)
    assert limit.step_s == pytest.approx((0.020,))  # a plain mean over the 9 steps would say 0.353


def test_the_buckets_blocks_take_turns_so_a_burst_reaches_each_bucket_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # untimed steps of both buckets, then 3 blocks of 1 step each in turns; a burst (1.0 s) lasts two steps:
    # it lands in one block of each bucket, and each bucket's median leaves it out (taken bucket by bucket,
    # the same durations would give both buckets 0.020)
    fake = _ClockedStep([5.0, 5.0] + [0.010, 0.020] + [1.0, 1.0] + [0.010, 0.020])
    monkeypatch.setattr(time, "perf_counter", fake.clock)
    limit = measure_resident_limit(fake, [], _SHAPES[:2], steps_per_bucket=3, vocab_size=32)
    assert fake.order == [0, 1] + [0, 1] * 3
    assert limit.step_s == pytest.approx((0.010, 0.020))
