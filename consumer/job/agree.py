"""Which checkpoint every rank of a job resumes from: the rule, free of TensorFlow and sockets.

Role: each rank offers the steps of its committed checkpoints (``RunState.committed_steps``); the
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
    * ``offer_row`` keeps the newest ``OFFER_WIDTH`` steps, padded with ``NO_STEP``, so every rank
      contributes a row of the same shape (the collective needs it); ``keep_checkpoints`` beyond that
      width still works, only the newest ``OFFER_WIDTH`` steps take part.
Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NO_STEP", "OFFER_WIDTH", "common_step", "no_common_step", "offer_row"]

NO_STEP = -1         # padding in an offer row: no checkpoint there
OFFER_WIDTH = 16     # newest committed steps each rank offers (keep_checkpoints is usually 2..5)


def offer_row(committed: Sequence[int]) -> list[int]:
    """This rank's offer: its newest ``OFFER_WIDTH`` committed steps, newest first, padded with ``NO_STEP``."""
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
    return (f"no checkpoint step is committed by every rank (newest per rank: {', '.join(newest)}); a rank's state "
            "directory was replaced or pruned: restore the missing checkpoints, or start the whole job with new "
            "state directories")
