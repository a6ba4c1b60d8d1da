"""The resident-batch limit of the compiled step: the denominator of feed efficiency.

Role: after warm-up, time the loop's own programs (``PackedSteps``, consumer/train/device/packed.py) on one
batch region per bucket that is already resident on the step's device (no loader, no hand-off, no host wait between
steps) and give the loop each bucket's
seconds per step. The loop stamps every applied batch with its bucket's figure (``StepRecord.resident_s``)
and ``melfeed.shared.metrics.StepWindow`` turns them into feed efficiency = sum(resident_s) / wall = fed steps/s
divided by resident steps/s for the same bucket sequence (docs/design.md "Feed efficiency").
Method: per bucket one untimed step, then per bucket ``steps_per_bucket`` steps in up to ``_BLOCKS`` blocks
of consecutive steps, the buckets' blocks taken in turns (every bucket's first block, then every bucket's
second, ...), so each bucket's blocks span the whole measurement and a change of load during it reaches
every bucket alike, as it reaches the fed steps of every bucket. Each block is dispatched back to back with one host
read of its last step's outputs
(the steps chain through the variables, so that read waits for all of them): its seconds per step =
elapsed / steps, the statistic of the fed figure (steps over wall time), so the ratio compares like
with like on either device; the block's read is ``Accumulators.read``, the loop's own interval read. The figure is the
median of the blocks' means: a burst of another process
that lands in one block is left out (one burst in a short measurement made the figure 1.3 on a loaded
machine), while slow steps that recur in every block still count, as they do in the fed mean. (A median
of steps timed alone would leave those out too, and feed efficiency would err low.) On a GPU a read per
step would add the very host wait the figure exists to expose; on the CPU the call returns when the step
is done, so the reads change nothing.
The resident batch of a bucket is its real warm-up batch (``batches``: the built-in loop's, consumer/train/
warm_batches.py), so a step whose cost follows the values (durations that size a decoder) is timed doing the work
it does in training. Without one (``bench``'s reference) it is synthetic and deterministic: every row full
length (``mel_len`` = T, ``tok_len`` = L), mel from a fixed seed, token ids 1 up to the cache's largest
(``resident_vocab``: a step is never fed an id its data does not hold), extras zero. A step that fails on it
(a TensorFlow op error) is one ``StepError`` line naming ``model.step``.
Invariants: afterwards every variable of ``variables`` holds exactly its value from before (host
snapshot, assigned back in ``finally`` as ``CompiledStep.warm_up`` does), so a run's final variables
never depend on whether the figure was measured; the batches have the buckets' shapes and dtypes, so
no program is traced. Shutdown: nothing to release; the resident batches are freed on return.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ResidentLimit", "measure_resident_limit", "resident_arrays", "resident_region", "resident_vocab"]

log = logging.getLogger(__name__)

_BLOCKS = 3  # blocks of consecutive timed steps per bucket; the median block mean is kept
_BATCH_SEED = 20240614  # the resident batch's mel values; any fixed seed: values do not change the cost


@dataclass(frozen=True, slots=True)
class ResidentLimit:
    """Seconds per step of the compiled step on a resident batch, per bucket (bucket order)."""

    step_s: tuple[float, ...]
    steps_per_bucket: int
    measure_s: float  # the whole measurement: snapshot, untimed and timed steps, restore


def resident_vocab(token_range: tuple[int, int] | None, vocab_size: int) -> int:
    """The ``vocab_size`` of the resident batches: the cache's largest token id + 1 (``manifest.token_range``), so
    the measure feeds only ids the step will see in training, else (a manifest without the range) ``vocab_size``."""
    return min(vocab_size, max(2, token_range[1] + 1)) if token_range is not None else vocab_size


def resident_arrays(
    shapes: Mapping[str, tuple[int, ...]], vocab_size: int, dtypes: Mapping[str, str] | None = None
) -> dict[str, np.ndarray]:
    """One full batch of a bucket's shapes: every row at full length, mel ~ N(0, 1) from a fixed seed.

    Extra arrays of the batch schema (keys beyond the four base ones, dtypes from ``dtypes``) are zeros;
    mel takes ``dtypes["mel"]`` when given (float16 on a float16 wire, ``transport.mel_dtype``).
    """
    batch, frames, n_mels = shapes["mel"]
    tokens = shapes["tokens"][1]
    rng = np.random.default_rng(_BATCH_SEED)
    base = {
        "mel": rng.standard_normal((batch, frames, n_mels), dtype=np.float32).astype(
            (dtypes or {}).get("mel", "float32"), copy=False
        ),
        "mel_len": np.full((batch,), frames, np.int32),
        "tokens": (1 + np.arange(batch * tokens, dtype=np.int32) % max(1, vocab_size - 1)).reshape(batch, tokens),
        "tok_len": np.full((batch,), tokens, np.int32),
    }
    extras = {k: np.zeros(shape, (dtypes or {}).get(k, "float32")) for k, shape in shapes.items() if k not in base}
    return {**base, **extras}


def _block_s(packed: Any, bucket: int, region: Any, steps: int) -> float:
    """Seconds per step of ``steps`` back-to-back steps ending in one host read (every step finished)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        packed.run(bucket, region)
    packed.accumulators.read()  # the block's only host wait: every step before it has finished
    return (time.perf_counter() - t0) / steps


def _time_round_robin(packed: Any, regions: Sequence[Any], steps: int) -> list[float]:
    """Per bucket, the median block mean of ``steps`` steps in up to ``_BLOCKS`` blocks, the buckets' blocks
    taken in turns (bucket 0's first block, bucket 1's first, ..., then every bucket's second)."""
    blocks = min(_BLOCKS, steps)
    means: list[list[float]] = [[] for _ in regions]
    for block in range(blocks):
        n = steps // blocks + (block < steps % blocks)
        for bucket, region in enumerate(regions):
            means[bucket].append(_block_s(packed, bucket, region, n))
    return [float(statistics.median(m)) for m in means]


def resident_region(layout: Any, arrays: Mapping[str, np.ndarray], rows: int | None = None) -> np.ndarray:
    """``arrays`` laid out in one aligned uint8 region of ``layout`` (a ``RegionLayout``), as a slot holds them
    (``rows`` real rows; None = every row)."""
    from melfeed.shared.wire.layout import aligned_buffer

    region = aligned_buffer(layout.nbytes)
    region[:] = 0
    layout.fill(region, arrays, rows)
    return region


def measure_resident_limit(
    packed: Any,
    variables: Sequence[Any],
    bucket_shapes: Sequence[Mapping[str, tuple[int, ...]]],
    steps_per_bucket: int,
    vocab_size: int,
    bucket_dtypes: Sequence[Mapping[str, str]] | None = None,
    batches: Sequence[Any] | None = None,
) -> ResidentLimit:
    """Time ``packed`` (a warmed-up ``PackedSteps``: the programs the loop runs) on a resident batch of every bucket.

    Args:
        packed: the one-region programs, after ``warm_up()``; its ``run(bucket, region)`` is called.
        variables: everything the step may change (``step.variables()``); restored exactly afterwards, and the
            output accumulators reset.
        bucket_shapes: one dict of shapes per bucket, in bucket order.
        steps_per_bucket: timed steps per bucket (>= 1).
        vocab_size: token ids of the resident batch stay below it (the loop passes the cache's largest id + 1).
        bucket_dtypes: dtypes of each bucket's arrays (``Bucket.dtypes()``), for the schema's extras.
        batches: the real batch of each bucket (``WarmBatch``: its ``arrays`` and ``rows``), bucket order;
            None = synthetic full-length batches (``resident_arrays``).

    Raises:
        ValueError: ``steps_per_bucket`` < 1. StepError: the step fails on a resident batch (a TensorFlow op
            error, one line naming ``packed.factory``); anything else it raises as is (variables restored first).
    """
    import tensorflow as tf

    from melfeed.consumer.train.describe import describe_tf_error
    from melfeed.shared.errors import StepError

    if steps_per_bucket < 1:
        raise ValueError(f"steps_per_bucket must be >= 1, got {steps_per_bucket}")
    started = time.perf_counter()
    saved = [v.numpy() for v in variables]  # host copies: a device snapshot could alias what the steps update
    step_s: list[float] = []
    try:
        hosts, regions = [], []
        for bucket, shapes in enumerate(bucket_shapes):
            if batches is not None:
                hosts.append(resident_region(packed.layouts[bucket], batches[bucket].arrays, batches[bucket].rows))
            else:
                hosts.append(
                    resident_region(
                        packed.layouts[bucket],
                        resident_arrays(shapes, vocab_size, bucket_dtypes[bucket] if bucket_dtypes else None),
                    )
                )  # kept alive: aliased
            regions.append(packed.stage(bucket, hosts[-1])[0])  # where the fed loop puts a batch (each replica's)
            packed.run(bucket, regions[-1])  # untimed: first call on this batch
            packed.accumulators.read()
        step_s = _time_round_robin(packed, regions, steps_per_bucket)
    except tf.errors.OpError as err:  # the user's step on a batch it never saw in warm-up: one line
        what = "a warm-up batch" if batches is not None else f"full-length rows, token ids 1..{max(1, vocab_size - 1)}"
        raise StepError(
            packed.factory,
            f"the step fails on the resident batch of the feed-efficiency measure ({what}; "
            f"consumer.feed_efficiency_steps: 0 skips it): {describe_tf_error(err)}",
        ) from err
    finally:
        for var, value in zip(variables, saved):
            var.assign(value)
        packed.accumulators.reset()
    limit = ResidentLimit(tuple(step_s), steps_per_bucket, time.perf_counter() - started)
    log.info(
        "resident-batch limit: %s ms per step by bucket (%d steps each, %.1f s)",
        [round(1000 * s, 2) for s in limit.step_s],
        steps_per_bucket,
        limit.measure_s,
    )
    return limit
