"""The ceiling on quarantined rows (``producer.max_quarantined_fraction``): when a run must stop.

Role: a producer that cannot read a row's cache file leaves the row empty (quarantined, ``mel_len`` 0)
and lists it in the BATCH header; the ring hands that on in ``Batch.quarantined``. The built-in loop
feeds every applied batch to ``QuarantineCeiling.add`` and, the first time it trips, stops the run in
order (the steps in flight complete, final checkpoint, summary with ``error``) and raises ``DataError``
(exit 65). Pure: no clock, no I/O, no TensorFlow.

The rule (docs/guide/bad-data.md), over the batches this process applied, counting
real rows only (a partial batch's padding rows are not rows):
    * ``n`` rows trained, ``q`` of them quarantined, ``f`` = ``max_quarantined_fraction``;
    * nothing is judged before ``n >= min_rows`` = min(1000, the rows of one epoch of this consumer's
      plan): one bad file in the first batch is no trend, and a cache smaller than 1000 rows is judged
      after one epoch;
    * from then on, after every applied batch, it trips when ``q > f * n`` (the fraction since this
      process started), or when the last ``min_rows`` rows trained were all quarantined (a cache lost in
      the middle of a long run stops it within ``min_rows`` rows, whatever the fraction before);
    * ``f = 1.0`` turns both off; ``f = 0`` tolerates no quarantined row (judged from ``min_rows`` on);
    * a run that reaches the end of its plan before ``min_rows`` rows is judged once at the end
      (``judge_at_end``): it trips when every row it trained was quarantined (a cache that is not there;
      fewer bad rows in so short a run are still no trend).
A resumed run counts afresh (the counts are this process's).
Invariant: ``add`` or ``judge_at_end`` returns True at most once, when the rule trips.
Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from melfeed.consumer.flow.plan import EpochPlan

__all__ = ["MIN_ROWS", "QuarantineCeiling", "ceiling_for", "judged_from"]

MIN_ROWS = 1000  # rows trained before the rule is judged (fewer only when one epoch is shorter)
_KEY = "producer.max_quarantined_fraction"


def judged_from(epoch_rows: int) -> int:
    """``min_rows`` for a plan whose epoch holds ``epoch_rows`` real rows: min(MIN_ROWS, epoch_rows), >= 1."""
    return max(1, min(MIN_ROWS, epoch_rows))


@dataclass
class QuarantineCeiling:
    """The running counts and the rule. ``max_fraction``: the key's value in 0..1; ``min_rows`` >= 1."""

    max_fraction: float
    min_rows: int = MIN_ROWS
    rows: int = 0  # real rows of the applied batches
    quarantined: int = 0  # of them, left empty by a producer
    streak: int = 0  # quarantined rows in a row, up to the last row trained
    example: str = ""  # the first quarantined row seen: "sample N (utterance ID): PATH: REASON"
    tripped: bool = False
    at_end: bool = False  # tripped by ``judge_at_end`` (the plan had ended: nothing to resume)

    @property
    def enabled(self) -> bool:
        return self.max_fraction < 1.0

    def add(
        self,
        sample_ids: Sequence[int],
        quarantined: Collection[int],
        *,
        utterance_ids: Sequence[str] = (),
        note: str = "",
    ) -> bool:
        """Count one applied batch (its real rows in row order, and which of them were quarantined).

        ``utterance_ids`` (row order) and ``note`` (the producer's ``PATH: REASON``) only name the example.
        Returns True when this batch trips the rule (once; later batches are still counted).
        """
        if not quarantined:  # the usual batch: one comparison, no set
            self.streak = 0 if sample_ids else self.streak
        else:
            listed = set(quarantined)
            for row, sid in enumerate(sample_ids):
                if sid not in listed:
                    self.streak = 0
                    continue
                self.quarantined += 1
                self.streak += 1
                if not self.example:
                    name = f" ({utterance_ids[row]})" if row < len(utterance_ids) else ""
                    self.example = f"sample {sid}{name}" + (f": {note}" if note else "")
        self.rows += len(sample_ids)
        if self.tripped or not self.enabled or self.rows < self.min_rows:
            return False
        self.tripped = self._above() or self.streak >= self.min_rows
        return self.tripped

    def judge_at_end(self) -> bool:
        """Once, when the plan ended before ``min_rows`` rows: True (tripped) when every row trained was
        quarantined. A longer run, an untripped rule already judged, or ``f = 1.0``: False."""
        if self.tripped or not self.enabled or not 0 < self.rows < self.min_rows:
            return False
        self.tripped = self.at_end = self.quarantined == self.rows
        return self.tripped

    def _above(self) -> bool:
        # q / n, not q > f * n: a ratio equal to the key's decimal rounds to the same double (0.29 * 100 does not)
        return self.rows > 0 and self.quarantined / self.rows > self.max_fraction

    def message(self, resume_at: int | None = None, *, resumable: bool = True) -> str:
        """The one line naming the key, what was seen, an example and what to do (once ``add`` returned True).

        ``resume_at``: the batch the final checkpoint resumes at; ``resumable`` False: no state directory.
        """
        pct, limit = 100.0 * self.quarantined / max(self.rows, 1), 100.0 * self.max_fraction
        if self._above():
            seen = (
                f"{self.quarantined} of the {self.rows} rows trained were quarantined ({pct:.2f} %, above {limit:g} %)"
            )
        else:
            seen = (
                f"the last {self.streak} rows trained were all quarantined ({self.quarantined} of {self.rows} "
                f"in all, {pct:.2f} %)"
            )
        example = f"; e.g. {self.example}" if self.example else ""
        if self.at_end:
            then = "; the run reached the end of its plan on empty rows: fix the cache and train again"
        elif not resumable:
            then = "; fix the cache and start again (no consumer.state_dir: nothing to resume)"
        elif resume_at is not None:
            then = f"; fix the cache and run the same command again: it resumes at batch {resume_at}"
        else:
            then = ""
        return (
            f"{_KEY}: {seen}, so cache files are missing or bad{example}; the producers' log names each one "
            f"('quarantined sample=N'), `melfeed verify-cache --cache-dir CACHE_DIR` lists them all{then}"
        )


def ceiling_for(max_fraction: float, plan: EpochPlan) -> QuarantineCeiling:
    """The ceiling for a consumer following ``plan`` (``min_rows`` from its first epoch's real rows)."""
    if max_fraction >= 1.0:
        return QuarantineCeiling(max_fraction)
    return QuarantineCeiling(max_fraction, judged_from(sum(len(b.sample_ids) for b in plan.epoch(0))))
