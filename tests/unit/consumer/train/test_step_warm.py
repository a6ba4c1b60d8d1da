"""Warm-up, the packed programs' warm-up, jit_compile auto's timing and the resident limit run on real batches.

A step that asserts every length and every real token's duration positive (tests/value_steps.py) compiles and
runs on each bucket's warm-up batch (``warm_batches``), where an all-padding batch fails it; every variable holds
its value from before, bit for bit, after each of the three; auto's timing and the resident limit see the cost
of a step whose work follows the durations (zero durations cost next to nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from melfeed.consumer.flow.plan import EpochPlan
from melfeed.consumer.train.device.packed import PackedSteps
from melfeed.consumer.train.efficiency import measure_resident_limit
from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.step import CompiledStep
from melfeed.consumer.train.warm_batches import WarmBatch, warm_batches
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import StepError
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from tests.value_steps import duration_cost_step, positive_step, write_duration_cache

pytestmark = pytest.mark.tf

N_MELS = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[BucketSet, list[WarmBatch], StepSpec]:
    manifest = write_duration_cache(tmp_path_factory.mktemp("step_warm") / "cache", 24, N_MELS)
    buckets = build_buckets(
        manifest.frames,
        manifest.token_counts,
        N_MELS,
        BucketConfig(num_buckets=2, batch_size=4, partial="drop"),
        manifest.schema,
    )
    plan = EpochPlan(buckets, manifest.fingerprint, 0, "drop")
    spec = StepSpec(
        n_mels=N_MELS,
        vocab_size=256,
        learning_rate=0.1,
        mixed_precision=False,
        seed=0,
        bucket_shapes=tuple(b.shapes() for b in buckets.buckets),
        extras=manifest.schema.extras,
    )
    return buckets, warm_batches(plan, buckets, manifest, 0), spec


def _compiled(step: Any, buckets: BucketSet, spec: StepSpec, jit_compile: str | bool) -> CompiledStep:
    return CompiledStep(
        step, [b.shapes() for b in buckets.buckets], jit_compile=jit_compile, factory="t:step", extras=spec.extras
    )


def _moved(step: Any) -> list[np.ndarray]:
    """Give every variable a value of its own (not its initial zeros), and return host copies of them."""
    rng = np.random.default_rng(1)
    for v in step.variables():
        v.assign(rng.standard_normal(v.shape).astype(v.dtype.as_numpy_dtype) if v.dtype.is_floating else 7)
    return [v.numpy() for v in step.variables()]


def _unchanged(step: Any, before: list[np.ndarray]) -> bool:
    return all(a.tobytes() == b.numpy().tobytes() for a, b in zip(before, step.variables()))


def test_warm_up_on_real_batches_runs_a_step_asserting_positive_lengths_and_leaves_variables_bit_identical(
    run: tuple[BucketSet, list[WarmBatch], StepSpec],
) -> None:
    buckets, warm, spec = run
    step = positive_step(spec)
    before = _moved(step)
    compiled = _compiled(step, buckets, spec, False)  # graph mode runs the assertions (XLA drops them)
    compiled.warm_up(warm)
    assert compiled.is_ready and _unchanged(step, before)
    packed = PackedSteps.for_buckets(compiled, buckets.buckets, None)
    packed.warm_up(step.variables(), warm)
    assert _unchanged(step, before) and packed.dispatched == 0
    limit = measure_resident_limit(
        packed, step.variables(), [b.shapes() for b in buckets.buckets], 2, 256, batches=warm
    )
    assert len(limit.step_s) == len(buckets.buckets) and _unchanged(step, before)
    assert compiled.compiles_after_ready == 0


def test_the_same_step_fails_warm_up_on_an_all_padding_batch(run: tuple[BucketSet, list[WarmBatch], StepSpec]) -> None:
    buckets, _, spec = run
    with pytest.raises(StepError, match="all padding"):
        _compiled(positive_step(spec), buckets, spec, False).warm_up()


def test_auto_timing_and_the_resident_limit_see_the_cost_the_durations_drive(
    run: tuple[BucketSet, list[WarmBatch], StepSpec],
) -> None:
    buckets, warm, spec = run
    # Four times the default decoder work: the real batches' steps then cost far more than any scheduling delay of
    # a loaded machine, which the ratios below must not depend on.
    spec = dataclasses.replace(spec, params={"frames_per_matmul": 8})
    real, zeros = (
        _compiled(duration_cost_step(spec), buckets, spec, "auto"),
        _compiled(duration_cost_step(spec), buckets, spec, "auto"),
    )
    real.warm_up(warm)
    zeros.warm_up()
    assert real.choice is not None and zeros.choice is not None and real.choice.graph_step_ms is not None
    assert real.choice.graph_step_ms > 3 * (zeros.choice.graph_step_ms or 0.0), (real.choice, zeros.choice)
    shapes = [b.shapes() for b in buckets.buckets]
    packed = PackedSteps.for_buckets(real, buckets.buckets, None)
    packed.warm_up([], warm)
    on_real = measure_resident_limit(packed, [], shapes, 3, 256, batches=warm).step_s
    on_synthetic = measure_resident_limit(packed, [], shapes, 3, 256).step_s  # full rows, zero durations
    assert all(r > 2 * s for r, s in zip(on_real, on_synthetic)), (on_real, on_synthetic)
