"""Where a run stops: ``consumer.steps`` N ends the plan at batch N; ``consumer.steps: null`` never ends it.

The rule lives in two places that must agree: the lease book (``consumer/flow/credit.py``: what is leased) and
``HandoutDesk.finished`` (``consumer/handout.py``: what the built-in loop and ``batches()`` stop on).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from melfeed.consumer.feed import Consumer
from melfeed.consumer.flow.credit import Arrival, LeaseBook
from melfeed.shared.config.loader import config_from_mapping, load_config

_OLD_DEFAULT_STEPS = 300  # consumer.steps' default: a service must go past it


def _apply(book: LeaseBook, n: int) -> int:
    """Lease, deliver and apply batches in plan order until ``n`` were applied or the book leases none; how many."""
    for applied in range(n):
        planned = book.next_batch()
        if planned is None:
            return applied
        book.grant(b"p", planned, slot=0, now_s=0.0)
        assert book.accept(b"p", planned.batch_id)[0] == Arrival.ACCEPT
        book.mark_applied(planned.batch_id)
    return n


@pytest.mark.parametrize(
    ("steps", "applied", "finished"),
    [(None, _OLD_DEFAULT_STEPS + 50, False), (_OLD_DEFAULT_STEPS, _OLD_DEFAULT_STEPS, True)],
)
def test_steps_null_leases_and_trains_past_the_old_default_and_a_number_ends_there(
    demo_cache: Path, steps: int | None, applied: int, finished: bool
) -> None:
    feed = Consumer(config_from_mapping({"cache_dir": str(demo_cache), "consumer": {"steps": steps}}))
    feed.close()  # never started: only its plan and its stopping rule are used
    book = LeaseBook(feed.plan, 0, feed._desk.end_batch, window=2, lease_timeout_s=10.0)
    assert _apply(book, _OLD_DEFAULT_STEPS + 50) == applied
    assert (book.is_finished, book.has_work()) == (finished, not finished)
    feed._desk.next_id = applied  # the loop took every batch it was leased
    assert feed._desk.finished is finished


def test_the_config_reads_steps_null_as_no_limit(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cache_dir: /data\nconsumer:\n  steps: null\n", encoding="utf-8")
    assert load_config(path).consumer.steps is None
    assert config_from_mapping({}).consumer.steps == _OLD_DEFAULT_STEPS
