"""Utterances that leave the bucket plan, and why: frames-per-token outliers and overlong ones.

Role: ``buckets.max_frames_per_token`` / ``buckets.min_frames_per_token`` catch misaligned pairs (a
transcript far too short or too long for its audio), which would otherwise widen a shape for every
row beside them; ``buckets.max_frames`` / ``max_tokens`` with ``overlong: drop`` remove overlong
ones. ``build_buckets`` leaves them all out (assignment -1); ``excluded`` lists them with a reason
for the state directory's report (``OUTLIERS_NAME``).

Invariants: each utterance has at most one reason; the frames-per-token rule comes first (an
outlier is never also counted as overlong). Zero tokens means an unbounded frames-per-token ratio.
Shutdown: nothing to release; pure functions.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from melfeed.shared.config import BucketConfig

__all__ = ["OUTLIERS_NAME", "REASONS", "frames_per_token_outliers", "excluded"]

OUTLIERS_NAME = "outliers.tsv"  # in consumer.state_dir: id, frames, tokens, reason
REASONS = ("max_frames_per_token", "min_frames_per_token", "max_frames", "max_tokens")


def frames_per_token_outliers(
    frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], cfg: BucketConfig
) -> npt.NDArray[np.int8]:
    """Per utterance: 0 = inside the frames-per-token limits, 1 = above the maximum, 2 = below the minimum."""
    out = np.zeros(frames.shape, dtype=np.int8)
    f = frames.astype(np.float64)
    t = tokens.astype(np.float64)
    if cfg.max_frames_per_token is not None:
        out[f > cfg.max_frames_per_token * t] = 1  # 0 tokens: any frames > 0 is above
    if cfg.min_frames_per_token is not None:
        out[(out == 0) & (f < cfg.min_frames_per_token * t)] = 2
    return out


def excluded(
    frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], assignment: npt.NDArray[np.integer], cfg: BucketConfig
) -> list[tuple[int, str]]:
    """(manifest index, reason) of every utterance the plan leaves out, in manifest order.

    Args:
        frames: [n] frames per utterance (manifest order).
        tokens: [n] tokens per utterance.
        assignment: the ``BucketSet.assignment`` built from them (-1 = left out).
    """
    ratio = frames_per_token_outliers(frames, tokens, cfg)
    out: list[tuple[int, str]] = []
    for i in np.flatnonzero(np.asarray(assignment) < 0).tolist():
        if ratio[i]:
            out.append((i, REASONS[int(ratio[i]) - 1]))
        elif cfg.max_tokens is not None and tokens[i] > cfg.max_tokens:
            out.append((i, "max_tokens"))
        else:
            out.append((i, "max_frames"))
    return out
