"""The plan sharded by rank: global step ``s`` is ``world`` batches of one bucket, one per rank.

Role: the data order of a multi-worker job (docs/design.md, invariant 1 and "Ranks"). The
sharded plan is a pure function of (bucket set, manifest fingerprint, seed, epoch, world size), never
of the producer count or of timing. Rank ``r`` applies, at its own step ``s``, the batch of rank ``r``
in global step ``s``; every rank runs the same bucket (the same compiled shape) at the same step.

Recipe for epoch ``e`` (one generator, the same as ``EpochPlan``'s): each bucket's members are
shuffled and cut into batches exactly as in ``EpochPlan.bucket_chunks``; consecutive batches of a
bucket are grouped ``world`` at a time into global steps; the order of all global steps is then
drawn with the generator's next permutation. With ``world == 1`` every group is one batch and the
draw is the same, so the sharded plan *is* ``EpochPlan`` (tests pin this).

Leftovers: a bucket whose batch count is not a multiple of ``world`` has ``k < world`` batches left
over. Their samples (``L`` of them) are dealt again into one more global step of ``world`` batches
of ``ceil(L / world)`` or ``floor(L / world)`` rows (never more than the bucket's B, since
``L <= k * B < world * B``). Only when ``L < world`` (some rank would get an empty batch) are those
samples left out of the epoch, counted in ``dropped_samples_per_epoch``; they differ every epoch,
since the shuffle does. So every kept sample is in exactly one batch of one rank per epoch, except
those counted. ``leftovers="drop"`` (for a plan that never makes a batch smaller than B, such as one
that drops partial batches) leaves every leftover batch out instead, counted the same way.

Ids: a rank's batches carry *local* ids (``batch_id`` = its step, ``data_epoch * steps + s``), so
the lease book, the ring, the hand-out rules, the checkpoint cursor and the audit log of one rank
work as for a single consumer. The plan-wide id of rank ``r``'s batch at step ``s`` is
``s * world + r`` (``global_id``): over the union of ranks each plan-wide id exists exactly once.
Shutdown: nothing to release.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from melfeed.consumer.flow.plan import EpochPlan, PlannedBatch
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import BucketSet

__all__ = ["GlobalStep", "LEFTOVER_POLICIES", "RankPlan", "plan_for_rank", "shard_chunks"]

log = logging.getLogger(__name__)

LEFTOVER_POLICIES = ("deal", "drop")


@dataclass(frozen=True, slots=True)
class GlobalStep:
    """One step of the job: the bucket every rank runs, and each rank's samples (index = rank)."""

    bucket: int
    shares: tuple[tuple[int, ...], ...]


def shard_chunks(
    chunks: list[tuple[int, tuple[int, ...]]], world: int, leftovers: str = "deal"
) -> tuple[list[GlobalStep], int]:
    """Group an epoch's batches (in bucket order) into global steps of ``world`` batches of one bucket.

    Args:
        chunks: ``(bucket, sample_ids)`` per batch, each bucket's batches consecutive (``bucket_chunks``).
        world: ranks in the job, >= 1.
        leftovers: "deal" (the samples of a bucket's last, fewer-than-``world`` batches are dealt into
            one more global step when they are at least ``world``) or "drop" (always left out).

    Returns:
        The global steps in bucket order (before the order is drawn), and how many samples were left
        out (leftovers of a bucket with fewer samples than ranks; see the module docstring).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if leftovers not in LEFTOVER_POLICIES:
        raise ValueError(f"leftovers must be one of {LEFTOVER_POLICIES}, got {leftovers!r}")
    by_bucket: dict[int, list[tuple[int, ...]]] = {}
    for bucket, samples in chunks:
        by_bucket.setdefault(bucket, []).append(samples)
    steps: list[GlobalStep] = []
    dropped = 0
    for bucket, batches in by_bucket.items():
        full = len(batches) - len(batches) % world
        steps.extend(GlobalStep(bucket, tuple(batches[i : i + world])) for i in range(0, full, world))
        left = [s for batch in batches[full:] for s in batch]
        if leftovers == "deal" and len(left) >= world:
            steps.append(GlobalStep(bucket, _deal(left, world)))
        else:
            dropped += len(left)
    return steps, dropped


def _deal(samples: list[int], world: int) -> tuple[tuple[int, ...], ...]:
    """``samples`` cut into ``world`` contiguous pieces whose sizes differ by at most one (none empty)."""
    base, extra = divmod(len(samples), world)
    pieces, start = [], 0
    for rank in range(world):
        size = base + (1 if rank < extra else 0)
        pieces.append(tuple(samples[start : start + size]))
        start += size
    return tuple(pieces)


class RankPlan(EpochPlan):
    """Rank ``rank``'s share of the sharded plan, as an ``EpochPlan`` of local ids (one per step).

    ``batches_per_epoch`` is the number of global steps per epoch (the same on every rank);
    ``batch(s)`` is this rank's batch at step ``s``.
    """

    def __init__(
        self,
        buckets: BucketSet,
        fingerprint: str,
        seed: int,
        *,
        rank: int,
        world: int,
        leftovers: str = "deal",
        partial: str = "pad",
    ) -> None:
        """``leftovers``: see ``shard_chunks``; ``partial``: ``buckets.partial`` (see ``EpochPlan``).

        Raises:
            ValueError: a rank outside ``0 .. world-1``, or no global step can be filled (every bucket
                holds fewer utterances than ranks), besides ``EpochPlan``'s own checks.
        """
        super().__init__(buckets, fingerprint, seed, partial)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..world-1, got rank {rank} of world {world}")
        self.rank = rank
        self.world = world
        self.leftovers = leftovers
        steps, self.dropped_samples_per_epoch = self._sharded(0)
        if not steps and leftovers == "drop":
            raise ValueError(
                f"no global step can be filled: one takes {world} full batches of one bucket (one per "
                "rank, none made smaller), and no bucket fills that many"
            )
        if not steps:
            raise ValueError(
                f"no global step can be filled: every bucket holds fewer utterances than the {world} ranks"
            )
        self._batches_per_epoch = len(steps)  # a bucket's batch count is the same in every epoch

    @property
    def samples_dropped_per_epoch(self) -> int:
        """Samples left out per epoch: partial batches under ``partial="drop"`` plus unshardable leftovers."""
        return super().samples_dropped_per_epoch + self.dropped_samples_per_epoch

    def global_steps(self, data_epoch: int) -> list[GlobalStep]:
        """Every rank's batch at each step of epoch ``data_epoch``, in step order (not memoised)."""
        if data_epoch < 0:
            raise ValueError(f"data_epoch must be >= 0, got {data_epoch}")
        return self._sharded(data_epoch)[0]

    def global_id(self, batch_id: int) -> int:
        """The plan-wide id of this rank's batch ``batch_id``: ``step * world + rank``."""
        return batch_id * self.world + self.rank

    def _sharded(self, data_epoch: int) -> tuple[list[GlobalStep], int]:
        rng, chunks = self.bucket_chunks(data_epoch)
        steps, dropped = shard_chunks(chunks, self.world, self.leftovers)
        order: list[int] = rng.permutation(len(steps)).tolist()
        return [steps[k] for k in order], dropped

    def _build(self, data_epoch: int) -> tuple[PlannedBatch, ...]:
        steps = self.global_steps(data_epoch)
        base = data_epoch * len(steps)
        return tuple(
            PlannedBatch(batch_id=base + s, data_epoch=data_epoch, bucket=g.bucket, sample_ids=g.shares[self.rank])
            for s, g in enumerate(steps)
        )


def plan_for_rank(
    buckets: BucketSet, fingerprint: str, seed: int, rank: int = 0, world: int = 1, partial: str = "pad"
) -> EpochPlan:
    """The plan a consumer of rank ``rank`` in a world of ``world`` follows (``partial``: ``buckets.partial``).

    A world of 1 is ``EpochPlan`` itself (today's plan, bit for bit); otherwise that rank's ``RankPlan``.
    Under ``partial="drop"`` no batch smaller than the bucket's rows is ever made: a bucket's leftover
    batches that do not fill a global step are dropped too, not dealt.

    Raises:
        ConfigError: "drop" leaves no batch, or no global step can be filled with this many ranks (exit 78).
    """
    if world == 1 and rank == 0:
        try:
            return EpochPlan(buckets, fingerprint, seed, partial)
        except ValueError as err:  # "drop" with no bucket holding one full batch
            raise ConfigError(str(err), path=("buckets", "partial"), got=partial) from None
    try:
        plan = RankPlan(
            buckets,
            fingerprint,
            seed,
            rank=rank,
            world=world,
            partial=partial,
            leftovers="drop" if partial == "drop" else "deal",
        )
        log.info(
            "plan for rank %d of %d: %d global steps per epoch (%d batches each); %d samples per epoch "
            "left out (bucket leftovers smaller than the world)",
            rank,
            world,
            plan.batches_per_epoch,
            world,
            plan.dropped_samples_per_epoch,
        )
        return plan
    except ValueError as err:  # "drop": the bucket sizes decide as much as the world does
        raise ConfigError(
            f"rank {rank} of {world}: {err}",
            path=("buckets", "partial") if partial == "drop" else ("TF_CONFIG",),
            got=partial if partial == "drop" else None,
        ) from None
