"""Unit tests for ``buckets.partial`` in consumer/flow/plan.py: "drop" removes exactly the partial batches
and counts their samples; "pad" keeps them and says which rows are real."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from melfeed.consumer.flow.plan import EpochPlan
from melfeed.consumer.handout import row_mask
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from tests.fakes import ljspeech_like

_FINGERPRINT = "3f9a0c47d12e88b5" + "0" * 48


def _bucket_set(n: int = 500, batch_size: int = 16) -> BucketSet:
    frames, tokens = ljspeech_like(n, 0)
    return build_buckets(frames, tokens, 80, BucketConfig(batch_size=batch_size))


def _members(bs: BucketSet) -> list[int]:
    return [int((bs.assignment == b.index).sum()) for b in bs.buckets]


@pytest.mark.parametrize("data_epoch", [0, 3])
def test_drop_removes_exactly_the_partial_batches_and_counts_their_samples(data_epoch: int) -> None:
    bs = _bucket_set()
    members = _members(bs)
    assert any(n % 16 for n in members), "the fixture must have partial batches"
    pad = EpochPlan(bs, _FINGERPRINT, 5, "pad").epoch(data_epoch)
    drop_plan = EpochPlan(bs, _FINGERPRINT, 5, "drop")
    drop = drop_plan.epoch(data_epoch)
    full = Counter(frozenset(b.sample_ids) for b in pad if b.rows == 16)
    assert Counter(frozenset(b.sample_ids) for b in drop) == full  # the same full batches, nothing else
    assert all(b.rows == 16 for b in drop)
    assert drop_plan.batches_per_epoch == len(drop) == sum(n // 16 for n in members)
    assert [b.batch_id for b in drop] == list(range(data_epoch * len(drop), (data_epoch + 1) * len(drop)))
    dropped = sum(b.rows for b in pad if b.rows < 16)
    assert drop_plan.samples_dropped_per_epoch == dropped == sum(n % 16 for n in members)
    kept = {s for b in drop for s in b.sample_ids}
    assert len(kept) == int((bs.assignment >= 0).sum()) - dropped  # every other sample exactly once


def test_pad_keeps_the_partial_batches_and_marks_their_real_rows() -> None:
    bs = _bucket_set()
    plan = EpochPlan(bs, _FINGERPRINT, 5, "pad")
    assert plan.samples_dropped_per_epoch == 0
    short = [b for b in plan.epoch(0) if b.rows < bs.buckets[b.bucket].batch_size]
    assert len(short) == sum(1 for n in _members(bs) if n % 16)
    for b in short:
        mask = row_mask(b.rows, 16)
        assert mask.dtype == np.bool_ and mask.shape == (16,)
        assert mask.tolist() == [True] * len(b.sample_ids) + [False] * (16 - len(b.sample_ids))


def test_drop_with_no_full_batch_is_refused_and_an_unknown_policy_too() -> None:
    bs = _bucket_set(n=40, batch_size=64)
    with pytest.raises(ValueError, match="no bucket fills one batch"):
        EpochPlan(bs, _FINGERPRINT, 0, "drop")
    with pytest.raises(ValueError, match="partial"):
        EpochPlan(bs, _FINGERPRINT, 0, "trim")
    with pytest.raises(ConfigError, match="buckets.partial"):
        BucketConfig(partial="trim")
