"""The real batches a run compiles, warms up and times its step on: one per bucket, read by the consumer.

Role: before READY the step is compiled and run once per bucket (``CompiledStep.warm_up``, ``PackedSteps.warm_up``)
and timed on resident batches (consumer/train/efficiency.py); a model whose validity or cost depends on the
values (durations that size a decoder, attention over ``tok_len``) must see there what it will train on, not
zeros. ``warm_batches`` picks, for each bucket, the first full planned batch of that bucket from the run's
start position on and reads it from the cache into a region with the ring's
slot layout (``shared/wire/layout.py``), with the reference assembly (``melfeed.shared.cache.batch_read``):
the same bytes a producer would put in the slot. A bucket without a full batch in the plan (fewer members
than rows: its one batch is partial, or under ``partial: drop`` there is none) gets its own samples, repeated to
fill the rows; so every row of a warm-up batch is real (the resident limit times full steps), and only a bucket
without any sample stays all padding (it is never trained).
Why the consumer reads them and not the producers: the plan gives the consumer each bucket's batch at once,
while the producers deliver batches in plan order into a ring of a few slots, so a bucket's first batch may be
hundreds of batches away (docs/design.md "Warm-up batches").
Invariants: reading is all that happens: no lease, no ring slot, no audit record; the batches are not applied
(exactly-once and the plan are untouched), and the step's variables are restored after every use of them.
Shutdown: nothing to release; the regions are freed with the list.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.consumer.flow.plan import EpochPlan, PlannedBatch
from melfeed.shared.cache.batch_read import read_batch
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.wire.buckets import Bucket, BucketSet
from melfeed.shared.wire.layout import aligned_buffer, batch_layout, layout_nbytes, layout_views

__all__ = ["WarmBatch", "read_sample_batch", "sample_batch", "warm_batches"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WarmBatch:
    """One bucket's warm-up batch: its region in the ring's slot layout and the arrays in it."""

    bucket: int
    batch_id: int | None  # the planned batch read; None: the bucket's own samples (no full one planned)
    rows: int  # real rows: the bucket's rows B (0 for a bucket without samples)
    region: npt.NDArray[np.uint8]  # uint8 [layout_nbytes(bucket)], 64-byte aligned
    arrays: dict[str, npt.NDArray[Any]]  # views of ``region``, ``Bucket.shapes()`` keys

    def describe(self) -> str:
        """Which batch this is, for log lines and error messages."""
        if self.batch_id is None:
            return f"bucket {self.bucket}'s own samples ({self.rows} rows; no full planned batch)"
        return f"planned batch {self.batch_id} of bucket {self.bucket} ({self.rows} rows)"


def warm_batches(plan: EpochPlan, bucket_set: BucketSet, manifest: Manifest, start_batch: int) -> list[WarmBatch]:
    """One real batch per bucket (bucket order), chosen from the plan from ``start_batch`` on, read from the cache.

    A row whose file cannot be read is left empty, as a producer quarantines it (one WARNING naming it).
    """
    chosen = _first_full_of_each_bucket(plan, start_batch, [b.batch_size for b in bucket_set.buckets])
    out = []
    for bucket in bucket_set.buckets:
        planned = chosen.get(bucket.index)
        if planned is not None:
            batch_id, samples = planned.batch_id, planned.sample_ids
        else:
            batch_id, samples = None, _own_samples(bucket_set, bucket)
        out.append(_read(manifest, bucket, batch_id, samples))
    log.info("warm-up batches: %s", "; ".join(b.describe() for b in out))
    return out


def sample_batch(bucket_set: BucketSet, manifest: Manifest, bucket: Bucket) -> WarmBatch:
    """A batch of ``bucket``'s shape (its rows may differ from the set's: ``buckets.batch_size: auto``'s trials)
    from the bucket's own samples, longest first, repeated to fill the rows: real values at the longest lengths."""
    members = np.flatnonzero(bucket_set.assignment == bucket.index)
    longest_first = members[np.argsort(-np.asarray(manifest.frames)[members], kind="stable")]
    samples = tuple(int(m) for m in np.resize(longest_first, bucket.batch_size)) if members.size else ()
    return _read(manifest, bucket, None, samples)


def read_sample_batch(manifest: Manifest, bucket: Bucket, samples: Sequence[int]) -> WarmBatch:
    """A batch of ``bucket``'s shape from ``samples`` (each fits it), repeated to fill its rows."""
    return _read(manifest, bucket, None, tuple(int(m) for m in np.resize(np.asarray(samples), bucket.batch_size)))


def _first_full_of_each_bucket(plan: EpochPlan, start_batch: int, batch_rows: Sequence[int]) -> dict[int, PlannedBatch]:
    """Per bucket, its first full batch in one epoch's worth of the plan from ``start_batch`` on (``batch_rows``:
    each bucket's rows B); a bucket with none is left out."""
    full: dict[int, PlannedBatch] = {}
    for batch_id in range(start_batch, start_batch + plan.batches_per_epoch):
        planned = plan.batch(batch_id)
        if planned.rows == batch_rows[planned.bucket]:
            full.setdefault(planned.bucket, planned)
            if len(full) == len(batch_rows):
                break
    return full


def _own_samples(bucket_set: BucketSet, bucket: Bucket) -> tuple[int, ...]:
    members = np.flatnonzero(bucket_set.assignment == bucket.index)
    return tuple(int(m) for m in np.resize(members, bucket.batch_size)) if members.size else ()


def _read(manifest: Manifest, bucket: Bucket, batch_id: int | None, samples: Sequence[int]) -> WarmBatch:
    region = aligned_buffer(layout_nbytes(bucket))
    region[:] = 0
    arrays = layout_views(region, 0, batch_layout(bucket))
    for problem in read_batch(manifest, samples, arrays):
        log.warning("warm-up batch of bucket %d: row left empty: %s", bucket.index, problem)
    return WarmBatch(bucket.index, batch_id, len(samples), region, arrays)
