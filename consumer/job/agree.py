"""Which checkpoint every rank of a job resumes from, and whether the ranks may train together at all.

Role: the rules, free of TensorFlow and sockets. First, every rank offers a digest of each setting the
ranks must share (``job_settings``: the cache's fingerprint, ``seed``, ``n_mels``, ``buckets``, ``model``
and the consumer keys that decide how many collectives a rank runs: ``steps``,
``checkpoint_every_steps``, ``feed_efficiency_steps``); ``settings_mismatch`` names the settings on
which some rank differs. Ranks whose plans differ would apply overlapping shares (samples lost and
repeated, each rank exiting 0), and ranks that run different numbers of steps pair one rank's step
with another's measurement or end, so a mismatch stops every rank before its state directory is
touched (exit 78). A rank that cannot start (its cache, its state directory) offers ``REFUSED``
instead, so that the others stop with it (``refused_ranks``) rather than wait for it in vain.

Then each rank offers the steps of its committed checkpoints (``RunState.committed_steps``); the
collective in ``consumer/job/cluster.py`` gathers every rank's offer (a fixed-width row each:
``offer_row``) and every rank applies ``common_step`` to the same gathered rows, so all ranks pick
the same step without any channel of melfeed's own.

The rule: the newest step that *every* rank committed. Ranks commit at the same global steps (the
period is counted in steps, never in time), so after a crash the ranks differ by at most the one
commit that some of them finished and the others did not; with ``keep_checkpoints >= 2`` the one
before it is on every rank. A step that one rank lacks cannot be the job's (that rank cannot restore
it), and no common step while some rank has checkpoints is an error, not a silent restart from 0
(``no_common_step``: one line naming the ranks' newest steps).

Invariants:
    * Pure and symmetric: the result depends on the set of offers only, never on which rank asks.
    * Every rank without checkpoints (a new job) agrees on ``None``: start at step 0.
    * Every rank computes the same verdict from the same gathered rows: all start, or all stop.
    * ``offer_row`` keeps the newest ``OFFER_WIDTH`` steps, padded with ``NO_STEP``, so every rank
      contributes a row of the same shape (the collective needs it); ``keep_checkpoints`` beyond that
      width still works, only the newest ``OFFER_WIDTH`` steps take part.
Shutdown: nothing to release.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_to_mapping
from melfeed.shared.printable import escape_line

__all__ = [
    "NO_STEP",
    "OFFER_WIDTH",
    "REFUSED",
    "SETTINGS",
    "common_rows",
    "common_step",
    "job_settings",
    "no_common_step",
    "offer_row",
    "refused_ranks",
    "settings_mismatch",
    "settings_row",
]

NO_STEP = -1  # padding in an offer row: no checkpoint there
REFUSED = -2  # a whole row of it: this rank cannot start (it says why in its own log) and stops
OFFER_WIDTH = 16  # newest committed steps each rank offers (keep_checkpoints is usually 2..5)
SETTINGS = (
    "cache_dir",
    "seed",
    "n_mels",
    "buckets",
    "model",
    "consumer.steps",
    "consumer.checkpoint_every_steps",
    "consumer.feed_efficiency_steps",
)  # what every rank of a job must share, in column order
_SHOWN_CHARS = 120  # of this rank's value of a differing setting, in the one line


def job_settings(cfg: PipelineConfig, fingerprint: str) -> dict[str, object]:
    """This rank's value of each of ``SETTINGS`` (``cache_dir``: its manifest's fingerprint, not its path)."""
    mapping = config_to_mapping(cfg)
    c = cfg.consumer
    return {
        "cache_dir": f"fingerprint {fingerprint}",
        "seed": cfg.seed,
        "n_mels": cfg.n_mels,
        "buckets": mapping["buckets"],
        "model": mapping["model"],
        "consumer.steps": c.steps,
        "consumer.checkpoint_every_steps": c.checkpoint_every_steps,
        "consumer.feed_efficiency_steps": c.feed_efficiency_steps,
    }


def settings_row(settings: Mapping[str, object] | None) -> list[int]:
    """One digest per setting (>= 0, fits int64), in ``SETTINGS`` order; ``None``: this rank refuses (``REFUSED``)."""
    if settings is None:
        return [REFUSED] * len(SETTINGS)
    return [_digest(settings[key]) for key in SETTINGS]


def _digest(value: object) -> int:
    text = json.dumps(value, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def common_rows(rows: Sequence[Sequence[int]], n_buckets: int) -> list[int]:
    """Each bucket's smallest rows over the ranks' offers (``buckets.batch_size: auto``): it fits every rank's
    device, and every rank computes the same list from the same gathered rows."""
    return [min(int(r[k]) for r in rows) for k in range(n_buckets)]


def refused_ranks(rows: Sequence[Sequence[int]]) -> list[int]:
    """The ranks (index = rank) whose row says ``REFUSED``."""
    return [rank for rank, row in enumerate(rows) if row and row[0] == REFUSED]


def settings_mismatch(rows: Sequence[Sequence[int]], settings: Mapping[str, object]) -> str | None:
    """One line naming each setting on which some rank differs from rank 0, else ``None``.

    ``rows``: every rank's ``settings_row`` (index = rank); ``settings``: this rank's values, shown in the line.
    """
    differing = []
    for column, key in enumerate(SETTINGS):
        odd = [rank for rank, row in enumerate(rows) if row[column] != rows[0][column]]
        if odd:
            who = f"rank {odd[0]} differs" if len(odd) == 1 else f"ranks {', '.join(map(str, odd))} differ"
            differing.append(f"{key} ({who} from rank 0; here: {escape_line(repr(settings[key]), _SHOWN_CHARS)})")
    if not differing:
        return None
    return (
        "the ranks of this job differ in " + "; ".join(differing) + ": every rank must train the same plan and "
        "model with the same cache, seed, n_mels, buckets, model, consumer.steps, checkpoint_every_steps and "
        "feed_efficiency_steps"
    )


def offer_row(committed: Sequence[int] | None) -> list[int]:
    """This rank's offer: its newest ``OFFER_WIDTH`` committed steps, newest first, padded with ``NO_STEP``;
    ``None``: this rank cannot open its state directory and stops (a row of ``REFUSED``)."""
    if committed is None:
        return [REFUSED] * OFFER_WIDTH
    if any(step < 0 for step in committed):
        raise ValueError(f"committed steps must be >= 0, got {sorted(committed)}")
    newest = sorted(set(committed), reverse=True)[:OFFER_WIDTH]
    return newest + [NO_STEP] * (OFFER_WIDTH - len(newest))


def common_step(rows: Sequence[Sequence[int]]) -> int | None:
    """The newest step in every rank's row (index = rank); ``None`` when no rank offers any step.

    Raises:
        LookupError: some rank offers steps but no step is in every row (``no_common_step`` says why).
    """
    offers = [{step for step in row if step != NO_STEP} for row in rows]
    if not offers or not any(offers):
        return None
    shared = set.intersection(*offers)
    if not shared:
        raise LookupError(no_common_step(rows))
    return max(shared)


def no_common_step(rows: Sequence[Sequence[int]]) -> str:
    """One line: each rank's newest committed step, and that no step is on every rank."""
    newest = []
    for rank, row in enumerate(rows):
        steps = [step for step in row if step != NO_STEP]
        newest.append(f"rank {rank}: {max(steps) if steps else 'none'}")
    return (
        f"no checkpoint step is committed by every rank (newest per rank: {', '.join(newest)}); a rank's state "
        "directory was replaced or pruned: restore the missing checkpoints, or start the whole job with new "
        "state directories"
    )
