"""Unit tests for consumer/flow/shards.py: the plan sharded by rank, exactly once over the union of ranks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from melfeed.consumer.flow.plan import EpochPlan
from melfeed.consumer.flow.shards import GlobalStep, RankPlan, plan_for_rank, shard_chunks
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from tests.fakes import ljspeech_like

_FINGERPRINT = "3f9a0c47d12e88b5" + "0" * 48


def _bucket_set(n: int = 500, batch_size: int = 16, seed: int = 0, **cfg: object) -> BucketSet:
    frames, tokens = ljspeech_like(n, seed)
    return build_buckets(frames, tokens, 80, BucketConfig(batch_size=batch_size, **cfg))  # type: ignore[arg-type]


def _check_sharded_epoch(bs: BucketSet, seed: int, world: int, data_epoch: int) -> None:
    """Every invariant of the sharded plan for one epoch, over all ranks."""
    plans = [plan_for_rank(bs, _FINGERPRINT, seed, rank, world) for rank in range(world)]
    steps = plans[0].batches_per_epoch
    assert all(p.batches_per_epoch == steps for p in plans)  # one step count for the job
    shares = [p.epoch(data_epoch) for p in plans]
    for s in range(steps):  # same bucket at each global step
        assert len({share[s].bucket for share in shares}) == 1
    local = [b.batch_id for b in shares[0]]
    assert local == list(range(data_epoch * steps, (data_epoch + 1) * steps))
    ids = Counter(
        p.global_id(b.batch_id) if isinstance(p, RankPlan) else b.batch_id
        for p, share in zip(plans, shares)
        for b in share
    )
    base = data_epoch * steps * world
    assert sorted(ids) == list(range(base, base + steps * world)) and set(ids.values()) == {1}
    seen = Counter(sample for share in shares for b in share for sample in b.sample_ids)
    kept = set(np.flatnonzero(bs.assignment >= 0).tolist())
    assert set(seen.values()) <= {1} and set(seen) <= kept  # no sample twice in an epoch
    dropped = getattr(plans[0], "dropped_samples_per_epoch", 0)
    assert len(kept) - len(seen) == dropped  # what is left out is counted
    for b in (b for share in shares for b in share):
        assert 1 <= len(b.sample_ids) <= bs.buckets[b.bucket].batch_size
        assert all(bs.assignment[x] == b.bucket for x in b.sample_ids)
    for bucket in bs.buckets:  # only a bucket of < world samples drops
        members = int((bs.assignment == bucket.index).sum())
        batches = -(-members // bucket.batch_size)
        left = members - (batches - batches % world) * bucket.batch_size if batches % world else 0
        assert left < world or all(x in seen for x in np.flatnonzero(bs.assignment == bucket.index))


@settings(max_examples=80, deadline=None)
@given(
    world=st.integers(1, 8),
    seed=st.integers(0, 2**32),
    n=st.integers(1, 300),
    batch_size=st.integers(1, 24),
    num_buckets=st.integers(1, 5),
    data_epoch=st.integers(0, 50),
)
def test_every_batch_in_exactly_one_rank_share_and_buckets_agree_at_every_step(
    world: int, seed: int, n: int, batch_size: int, num_buckets: int, data_epoch: int
) -> None:
    try:
        bs = _bucket_set(n, batch_size, seed=seed % 97, num_buckets=num_buckets, max_frames=800)
    except ConfigError:  # a tiny draw whose utterances are all over 800 frames: nothing to plan
        assume(False)
    try:
        _check_sharded_epoch(bs, seed, world, data_epoch)
    except ConfigError as err:  # every bucket smaller than the world: refused, with the reason
        assert "fewer utterances than the" in str(err)
        assert all(int((bs.assignment == b.index).sum()) < world for b in bs.buckets)


@pytest.mark.parametrize("seed", [0, 7, 2**31])
def test_a_world_of_one_is_todays_plan_bit_for_bit(seed: int) -> None:
    bs = _bucket_set(700, 12, num_buckets=4)
    plan = EpochPlan(bs, _FINGERPRINT, seed)
    assert type(plan_for_rank(bs, _FINGERPRINT, seed)) is EpochPlan
    sharded = RankPlan(bs, _FINGERPRINT, seed, rank=0, world=1)  # the sharded recipe itself, world 1
    assert sharded.batches_per_epoch == plan.batches_per_epoch
    for e in (0, 3):
        assert sharded.epoch(e) == plan.epoch(e)


def test_global_steps_interleave_buckets_and_leftovers_are_dealt_into_one_more_step() -> None:
    bs = _bucket_set(2000, 16, num_buckets=4)
    plan = RankPlan(bs, _FINGERPRINT, 3, rank=1, world=3)
    steps = plan.global_steps(0)
    assert [g.bucket for g in steps] != sorted(g.bucket for g in steps)  # order drawn across buckets
    short = [g for g in steps if any(len(s) < bs.buckets[g.bucket].batch_size for s in g.shares)]
    assert len(short) <= len(bs.buckets)  # at most one dealt step per bucket
    assert plan.epoch(0)[5].sample_ids == steps[5].shares[1]
    assert plan.batch(plan.batches_per_epoch + 2) == plan.epoch(1)[2]
    assert plan.global_id(plan.batches_per_epoch + 2) == (plan.batches_per_epoch + 2) * 3 + 1


def test_shard_chunks_deals_leftovers_evenly_and_drops_fewer_samples_than_ranks() -> None:
    chunks = [(0, (1, 2, 3)), (0, (4, 5, 6)), (0, (7, 8, 9)), (0, (10,)), (1, (20, 21))]
    steps, dropped = shard_chunks(chunks, 3)
    assert steps == [GlobalStep(0, ((1, 2, 3), (4, 5, 6), (7, 8, 9)))]  # a full group of 3 batches
    assert len(steps) == 1 and dropped == 3  # (10,) alone and (20, 21): fewer samples than 3 ranks
    steps, dropped = shard_chunks([(0, (1, 2, 3)), (0, (4, 5))], 2)
    assert steps == [GlobalStep(0, ((1, 2, 3), (4, 5)))] and dropped == 0
    steps, dropped = shard_chunks([(0, (1, 2, 3, 4)), (0, (5, 6, 7, 8)), (0, (9,))], 4)
    assert steps == [GlobalStep(0, ((1, 2, 3), (4, 5), (6, 7), (8, 9)))] and dropped == 0
    with pytest.raises(ValueError):
        shard_chunks(chunks, 0)
    with pytest.raises(ValueError, match="leftovers must be one of"):
        shard_chunks(chunks, 2, "pad")


def test_leftovers_drop_leaves_every_short_group_out_and_counts_its_samples() -> None:
    chunks = [(0, (1, 2, 3)), (0, (4, 5, 6)), (0, (7, 8, 9)), (1, (20, 21)), (1, (22, 23))]
    steps, dropped = shard_chunks(chunks, 2, "drop")
    assert steps == [GlobalStep(0, ((1, 2, 3), (4, 5, 6))), GlobalStep(1, ((20, 21), (22, 23)))] and dropped == 3
    bs = _bucket_set(700, 12, num_buckets=4)
    plan = RankPlan(bs, _FINGERPRINT, 1, rank=0, world=5, leftovers="drop")
    short = Counter(
        g.bucket for g in plan.global_steps(0) for s in g.shares if len(s) < bs.buckets[g.bucket].batch_size
    )
    assert all(n <= 1 for n in short.values())  # only a bucket's own partial batch, nothing dealt
    kept = int((bs.assignment >= 0).sum())
    assert sum(len(s) for g in plan.global_steps(0) for s in g.shares) == kept - plan.dropped_samples_per_epoch


def test_bad_rank_or_a_world_larger_than_every_bucket_is_refused() -> None:
    bs = _bucket_set(40, 4, num_buckets=2)
    with pytest.raises(ValueError, match="rank must be in 0..world-1"):
        RankPlan(bs, _FINGERPRINT, 0, rank=2, world=2)
    with pytest.raises(ConfigError, match="^TF_CONFIG: rank 0 of 64: no global step can be filled"):
        plan_for_rank(bs, _FINGERPRINT, 0, 0, 64)
    # "drop" makes no batch smaller than its bucket: the bucket sizes are as much to blame as the world
    with pytest.raises(
        ConfigError,
        match="^buckets.partial: rank 1 of 8: no global step can be filled: one takes 8 full batches of one bucket",
    ):
        plan_for_rank(bs, _FINGERPRINT, 0, 1, 8, partial="drop")
