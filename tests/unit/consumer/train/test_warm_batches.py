"""Each bucket's warm-up batch is a real batch of the run's plan, read into the ring's slot layout.

Checked: the choice (the first full planned batch of each bucket from the start position on; a bucket without a
full planned batch gets its own samples, every row real), the bytes (those of the reference assembly,
``melfeed.shared.cache.batch_read``, in a 64-byte aligned region laid out as ``batch_layout`` lays out a slot),
and that reading them touches nothing of the plan.
"""

from __future__ import annotations

import numpy as np
import pytest

from melfeed.consumer.flow.plan import EpochPlan
from melfeed.consumer.train.warm_batches import warm_batches
from melfeed.shared.cache.batch_read import read_batch
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import BucketConfig
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from melfeed.shared.wire.layout import ALIGN_BYTES, batch_layout, layout_views
from tests.value_steps import write_duration_cache

pytestmark = pytest.mark.tf

N_MELS = 16
ROWS = 4


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    return write_duration_cache(tmp_path_factory.mktemp("warm") / "cache", 30, N_MELS)


def _buckets(manifest: Manifest) -> BucketSet:
    return build_buckets(
        manifest.frames, manifest.token_counts, N_MELS, BucketConfig(num_buckets=2, batch_size=ROWS), manifest.schema
    )


@pytest.mark.parametrize("start_batch", [0, 5])
def test_each_bucket_gets_its_first_full_planned_batch_from_the_start_laid_out_as_a_slot(
    manifest: Manifest, start_batch: int
) -> None:
    buckets = _buckets(manifest)
    plan = EpochPlan(buckets, manifest.fingerprint, 3, "pad")
    ahead = [plan.batch(i) for i in range(start_batch, start_batch + plan.batches_per_epoch)]
    warm = warm_batches(plan, buckets, manifest, start_batch)
    assert [w.bucket for w in warm] == [b.index for b in buckets.buckets]
    for w, bucket in zip(warm, buckets.buckets):
        planned = next(p for p in ahead if p.bucket == bucket.index and p.rows == ROWS)
        assert (w.batch_id, w.rows) == (planned.batch_id, ROWS)
        assert w.region.ctypes.data % ALIGN_BYTES == 0
        views = layout_views(w.region, 0, batch_layout(bucket))
        want = {k: np.zeros(v.shape, v.dtype) for k, v in views.items()}
        assert read_batch(manifest, planned.sample_ids, want) == []
        assert all(views[k].tobytes() == want[k].tobytes() and w.arrays[k].tobytes() == want[k].tobytes() for k in want)
        assert (w.arrays["mel_len"] > 0).all() and (w.arrays["duration"].sum(axis=1) >= w.arrays["tok_len"]).all()
    assert [plan.batch(i) for i in range(start_batch, start_batch + plan.batches_per_epoch)] == ahead


@pytest.mark.parametrize("partial", ["drop", "pad"])
def test_a_bucket_without_a_full_planned_batch_gets_its_own_samples_in_every_row(
    manifest: Manifest, partial: str
) -> None:
    built = _buckets(manifest)
    assignment = built.assignment.copy()
    assignment[np.flatnonzero(assignment == 1)[2:]] = -1  # bucket 1 keeps 2 members: no full batch
    buckets = BucketSet(built.buckets, assignment, 0, 0, built.real_frames)
    plan = EpochPlan(buckets, manifest.fingerprint, 0, partial)
    ones = [plan.batch(i) for i in range(plan.batches_per_epoch) if plan.batch(i).bucket == 1]
    assert [p.rows for p in ones] == ([] if partial == "drop" else [2])  # none planned, or one partial batch
    warm = warm_batches(plan, buckets, manifest, 0)
    assert warm[0].batch_id is not None and warm[1].batch_id is None and warm[1].rows == ROWS
    members = np.flatnonzero(assignment == 1)
    want = {k: np.zeros(v.shape, v.dtype) for k, v in warm[1].arrays.items()}
    read_batch(manifest, [int(m) for m in np.resize(members, ROWS)], want)
    assert all(warm[1].arrays[k].tobytes() == want[k].tobytes() for k in want)
    assert (warm[1].arrays["mel_len"] > 0).all() and "own samples" in warm[1].describe()


def test_a_float16_wire_gives_float16_warm_up_batches_of_the_cached_values(manifest: Manifest) -> None:
    """The doctor's probe and ``run`` warm up on these: a float16 wire's mel is the cached mel, cast."""

    def buckets(mel_dtype: str) -> BucketSet:
        return build_buckets(
            manifest.frames,
            manifest.token_counts,
            N_MELS,
            BucketConfig(num_buckets=2, batch_size=ROWS),
            manifest.schema,
            mel_dtype=mel_dtype,
        )

    wide, half = (
        warm_batches(EpochPlan(b, manifest.fingerprint, 3, "pad"), b, manifest, 0)
        for b in (buckets("float32"), buckets("float16"))
    )
    for w, h in zip(wide, half):
        assert h.arrays["mel"].dtype == np.float16 and h.arrays["mel"].any()
        assert np.array_equal(h.arrays["mel"], w.arrays["mel"].astype(np.float16))
