"""How an epoch divides into buckets: batch mix, per-bucket padding, representative batches.

Role: the figures ``melfeed doctor`` needs about the plan without the plan itself (the
plan belongs to the consumer, and producers may not import it). Everything derives from a
``BucketSet`` and the manifest's frame counts, with the same rules as ``melfeed.consumer.flow.plan``: each
bucket's members are chunked into batches of its B rows, the last one partial.

Invariants:
    * ``batch_mix`` weights are >= 0 and sum to 1 over the buckets.
    * ``representative_batches`` returns batches whose bucket counts follow ``batches_per_bucket``
      in proportion (largest remainder) and whose samples all belong to their bucket.
Shutdown: nothing to release; pure functions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.shared.wire.buckets import BucketSet

__all__ = ["batches_per_bucket", "batch_mix", "bucket_padding", "bucket_grid", "format_grid", "representative_batches"]


def batches_per_bucket(bucket_set: BucketSet) -> list[int]:
    """Batches per epoch in each bucket: ceil(members / B), as the consumer's plan chunks them."""
    sizes = np.bincount(bucket_set.assignment[bucket_set.assignment >= 0], minlength=len(bucket_set.buckets))
    return [math.ceil(int(n) / b.batch_size) for b, n in zip(bucket_set.buckets, sizes)]


def batch_mix(bucket_set: BucketSet) -> list[float]:
    """Fraction of an epoch's batches in each bucket (the weights of a per-bucket cost)."""
    counts = batches_per_bucket(bucket_set)
    total = sum(counts)
    return [c / total for c in counts] if total else [0.0 for _ in counts]


def bucket_padding(bucket_set: BucketSet, frames: npt.NDArray[np.integer]) -> list[float]:
    """Padding efficiency per bucket: real frames / padded frames (last partial batch counted full).

    Args:
        frames: [num_utterances] frames per utterance, manifest order (the set's ``assignment``).
    """
    lengths = np.asarray(frames, dtype=np.int64)
    out: list[float] = []
    for b, n_batches in zip(bucket_set.buckets, batches_per_bucket(bucket_set)):
        members = lengths[bucket_set.assignment == b.index]
        padded = n_batches * b.batch_size * b.max_frames
        out.append(float(np.minimum(members, b.max_frames).sum()) / padded if padded else 0.0)
    return out


def bucket_grid(bucket_set: BucketSet, frames: npt.NDArray[np.integer]) -> list[dict[str, Any]]:
    """One row per shape for ``doctor`` and the run summary: T frames, L tokens, B rows, batches and
    utterances per epoch, the share of the epoch's real frames, and its padding efficiency (frames).

    Args:
        frames: [num_utterances] frames per utterance, manifest order (the set's ``assignment``).
    """
    lengths = np.asarray(frames, dtype=np.int64)
    total = max(1, bucket_set.real_frames)
    rows = []
    for b, n_batches, padding in zip(
        bucket_set.buckets, batches_per_bucket(bucket_set), bucket_padding(bucket_set, lengths)
    ):
        members = lengths[bucket_set.assignment == b.index]
        rows.append(
            {
                "bucket": b.index,
                "frames": b.max_frames,
                "tokens": b.max_tokens,
                "rows": b.batch_size,
                "batches": n_batches,
                "utterances": int(members.size),
                "frames_share": round(float(np.minimum(members, b.max_frames).sum()) / total, 4),
                "padding_efficiency": round(padding, 4),
            }
        )
    return rows


def format_grid(grid: list[dict[str, Any]]) -> list[str]:
    """The grid as aligned text lines (a header, then one line per shape)."""
    out = ["bucket  T frames  L tokens  rows  batches  frames share  padding"]
    for r in grid:
        out.append(
            f"{r['bucket']:>6}  {r['frames']:>8}  {r['tokens']:>8}  {r['rows']:>4}  {r['batches']:>7}  "
            f"{100 * r['frames_share']:>11.1f} %  {r['padding_efficiency']:>7.3f}"
        )
    return out


def representative_batches(bucket_set: BucketSet, count: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """``count`` batches (bucket, sample ids) in the epoch's bucket proportions, interleaved.

    Each bucket gets its share by largest remainder; its batches take B members drawn without
    replacement (with replacement only when the bucket has fewer than B), so they read as many files
    as real batches do. The order is shuffled with ``seed``, so a timed prefix still mixes buckets.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    mix = batch_mix(bucket_set)
    shares = [count * w for w in mix]
    per = [int(s) for s in shares]
    for k in sorted(range(len(mix)), key=lambda i: (per[i] - shares[i], i))[: count - sum(per)]:
        per[k] += 1
    rng = np.random.default_rng(seed)
    out: list[tuple[int, list[int]]] = []
    for b, n in zip(bucket_set.buckets, per):
        members = np.flatnonzero(bucket_set.assignment == b.index)
        for _ in range(n):
            pick = rng.choice(members, size=b.batch_size, replace=members.size < b.batch_size)
            out.append((b.index, [int(s) for s in pick]))
    order = rng.permutation(len(out))
    return [out[i] for i in order]
