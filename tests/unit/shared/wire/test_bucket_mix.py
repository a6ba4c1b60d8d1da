"""Bucket mix, per-bucket padding and representative batches, checked against hand counts."""

from __future__ import annotations

import numpy as np
import pytest

from melfeed.shared.config import BucketConfig
from melfeed.shared.wire.bucket_mix import batch_mix, batches_per_bucket, bucket_padding, representative_batches
from melfeed.shared.wire.buckets import BucketSet, build_buckets

# Bucket 0 (<= 8 frames): 5 utterances -> 3 batches of 2; bucket 1 (<= 16 frames): 2 -> 1 batch.
FRAMES = np.array([4, 8, 8, 6, 2, 16, 12])
TOKENS = np.array([3, 3, 3, 3, 3, 5, 5])


def _set() -> BucketSet:
    return build_buckets(FRAMES, TOKENS, 4, BucketConfig(boundaries=(8, 16), batch_size=2))


def test_batches_per_bucket_and_mix_follow_the_plan_chunking() -> None:
    assert batches_per_bucket(_set()) == [3, 1]
    assert batch_mix(_set()) == [0.75, 0.25]


def test_padding_per_bucket_counts_the_partial_batch_as_full() -> None:
    # bucket 0: real 4+8+8+6+2 = 28 of 3 x 2 x 8 = 48; bucket 1: 28 of 1 x 2 x 16 = 32
    assert bucket_padding(_set(), FRAMES) == pytest.approx([28 / 48, 28 / 32])


def test_representative_batches_keep_the_proportions_and_their_buckets() -> None:
    bs = _set()
    batches = representative_batches(bs, 8, seed=1)
    assert [b for b, _ in batches].count(0) == 6 and len(batches) == 8
    for bucket, ids in batches:
        assert len(ids) == 2 and all(bs.assignment[i] == bucket for i in ids)
    assert batches == representative_batches(bs, 8, seed=1)
    with pytest.raises(ValueError):
        representative_batches(bs, 0)
