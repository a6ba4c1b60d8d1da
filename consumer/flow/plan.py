"""Epoch plan: which manifest samples form batch ``b``, and in which bucket (docs/design.md, invariant 1).

Role: the consumer's single source of truth for data order. The plan is a pure function of
(bucket set, manifest fingerprint, seed, epoch). It never depends on how many producers run, on
timing, or on which process computes it, so order, content and resume position are the same for
1 or 16 producers and across restarts. Producers never compute it; they build what they are leased.

Randomness: epoch ``e`` draws from one generator,
``np.random.default_rng([seed, e, int(fingerprint[:15], 16)])`` (a SeedSequence over the seed, the
epoch and the first 60 bits of the manifest fingerprint). It first permutes each bucket's members
(in bucket index order), chunks them into batches of that bucket's B rows (the last may be
partial), then permutes the order of all batches across buckets. With ``partial="drop"`` a bucket's
last chunk is left out when it has fewer than B rows (the within-bucket draws are the same, so every kept
batch holds the same samples as under "pad"; only the batch order differs); which samples skip an epoch
changes with the epoch, how many does not (``samples_dropped_per_epoch``). ``hash()`` is never used, so
the plan is identical in every process and Python run; NumPy does not promise identical streams
across its own major versions, and a golden test pins the current one.

Invariants:
    * ``batches_per_epoch`` is the same for every epoch: bucket membership does not depend on it.
    * ``batch_id == data_epoch * batches_per_epoch + position``; an epoch's ids are contiguous.
    * Every kept sample (assignment >= 0) appears in exactly one batch per epoch; dropped never.
    * A batch's samples all belong to its bucket; at most B of them, fewer only in a bucket's
      last batch of the epoch under "pad" (``rows`` < B: the rows from ``rows`` on are padding),
      never under "drop".
    * ``partial`` is part of the plan's identity: the state directory's run.json records it
      (``buckets.partial``) and a resume with another value is refused.

Shutdown: nothing to release. Sharing one plan between threads is safe: a race on the two-epoch
memo only recomputes an identical epoch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from melfeed.shared.wire.buckets import BucketSet

__all__ = ["PlannedBatch", "EpochPlan", "PARTIAL_POLICIES"]

PARTIAL_POLICIES = ("pad", "drop")  # buckets.partial

_MEMO_EPOCHS = 2  # the epoch being leased and the one before it (late lease returns, resume)
_FINGERPRINT_HEX_DIGITS = 15  # 60 bits of the fingerprint enter the seed


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    """One batch of the plan: its global id, its epoch, its bucket and its samples."""

    batch_id: int  # global across epochs: data_epoch * batches_per_epoch + position
    data_epoch: int  # pass over the dataset, from 0
    bucket: int  # index into BucketSet.buckets
    sample_ids: tuple[int, ...]  # manifest indices; len <= bucket batch_size, the rest is padding

    @property
    def rows(self) -> int:
        """Real rows: rows ``0 .. rows - 1`` of the batch hold ``sample_ids``, the rest are padding."""
        return len(self.sample_ids)


class EpochPlan:
    """Deterministic batch order over any number of epochs for one dataset and seed."""

    def __init__(self, buckets: BucketSet, fingerprint: str, seed: int, partial: str = "pad") -> None:
        """Precompute each bucket's members; epochs are built lazily.

        Args:
            buckets: the bucket set built from the manifest.
            fingerprint: the manifest fingerprint, a hex string (its first 15 digits are used).
            seed: data-order seed, >= 0.
            partial: ``buckets.partial``: "pad" keeps each bucket's last, partial batch of an
                epoch (padding rows fill it), "drop" leaves it out.

        Raises:
            ValueError: a fingerprint that does not start with hex digits, a negative seed, an
                unknown ``partial``, or a plan with no batch (no kept utterance, or under "drop"
                no bucket with a full batch).
        """
        try:
            self._fingerprint_key = int(fingerprint[:_FINGERPRINT_HEX_DIGITS], 16)
        except ValueError as err:
            raise ValueError(f"fingerprint must be a hex string, got {fingerprint!r}") from err
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if partial not in PARTIAL_POLICIES:
            raise ValueError(f"partial must be one of {PARTIAL_POLICIES}, got {partial!r}")
        self._seed = int(seed)
        self._buckets = buckets
        self._is_dropping = partial == "drop"
        self._members: tuple[npt.NDArray[np.int64], ...] = tuple(
            np.flatnonzero(buckets.assignment == b.index).astype(np.int64) for b in buckets.buckets
        )
        sizes = [(m.size, b.batch_size) for m, b in zip(self._members, buckets.buckets)]
        self._dropped_per_epoch = sum(n % rows for n, rows in sizes) if self._is_dropping else 0
        self._batches_per_epoch = sum(n // rows if self._is_dropping else -(-n // rows) for n, rows in sizes)
        if self._batches_per_epoch == 0:
            raise ValueError(
                "no batch in the plan: no kept utterance"
                if not self._is_dropping or not any(n for n, _ in sizes)
                else "no batch in the plan: with partial 'drop', no bucket fills one batch"
            )
        self._memo: OrderedDict[int, tuple[PlannedBatch, ...]] = OrderedDict()

    @property
    def batches_per_epoch(self) -> int:
        """Batches in every epoch: sum over buckets of ceil(members / B) ("pad") or floor ("drop")."""
        return self._batches_per_epoch

    @property
    def samples_dropped_per_epoch(self) -> int:
        """Kept samples left out of each epoch by ``partial="drop"`` (sum of members mod B; 0 under "pad")."""
        return self._dropped_per_epoch

    def epoch(self, data_epoch: int) -> tuple[PlannedBatch, ...]:
        """All batches of one epoch in plan order (the last two epochs asked for are memoised).

        Args:
            data_epoch: pass over the dataset, >= 0.

        Returns:
            ``batches_per_epoch`` batches whose ids run contiguously from
            ``data_epoch * batches_per_epoch``.

        Raises:
            ValueError: a negative epoch.
        """
        if data_epoch < 0:
            raise ValueError(f"data_epoch must be >= 0, got {data_epoch}")
        cached = self._memo.get(data_epoch)
        if cached is None:
            cached = self._build(data_epoch)
            self._memo[data_epoch] = cached
            while len(self._memo) > _MEMO_EPOCHS:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(data_epoch)
        return cached

    def batch(self, batch_id: int) -> PlannedBatch:
        """The batch with this global id; equal to ``epoch(e)[position]``.

        Raises:
            ValueError: a negative batch id.
        """
        if batch_id < 0:
            raise ValueError(f"batch_id must be >= 0, got {batch_id}")
        data_epoch, position = divmod(batch_id, self._batches_per_epoch)
        return self.epoch(data_epoch)[position]

    def bucket_chunks(self, data_epoch: int) -> tuple[np.random.Generator, list[tuple[int, tuple[int, ...]]]]:
        """The epoch's batches before their order is drawn: ``(bucket, sample_ids)`` in bucket order.

        Returns the epoch's generator too, advanced past the shuffles within buckets: the next draw
        is the batch order (``_build``), or the order of global steps in a sharded plan
        (``consumer/flow/shards.py``), so a world of 1 gives this plan exactly.
        """
        rng = np.random.default_rng([self._seed, data_epoch, self._fingerprint_key])
        chunks: list[tuple[int, tuple[int, ...]]] = []
        for bucket, members in zip(self._buckets.buckets, self._members):
            shuffled: list[int] = rng.permutation(members).tolist()
            rows = bucket.batch_size
            end = len(shuffled) - len(shuffled) % rows if self._is_dropping else len(shuffled)
            chunks.extend((bucket.index, tuple(shuffled[start : start + rows])) for start in range(0, end, rows))
        return rng, chunks

    def _build(self, data_epoch: int) -> tuple[PlannedBatch, ...]:
        """Shuffle within buckets, chunk into batches, shuffle the batch order (one RNG stream)."""
        rng, chunks = self.bucket_chunks(data_epoch)
        order: list[int] = rng.permutation(len(chunks)).tolist()
        base = data_epoch * self._batches_per_epoch
        return tuple(
            PlannedBatch(batch_id=base + position, data_epoch=data_epoch, bucket=chunks[k][0], sample_ids=chunks[k][1])
            for position, k in enumerate(order)
        )
