"""``Consumer(cfg, producers=N)``: the consumer starts its own producer group and leaves no process behind.

Real producer processes on the small demo cache. The group's processes are found in /proc as this test
process's descendants, so nothing here reads the consumer's internals.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import melfeed
from tests import procs

_BATCHES = 12  # > one epoch of the 200-utterance cache (8 batches)


def _cfg(cache: Path, endpoint: str, steps: int | None) -> Any:
    return melfeed.config_from_mapping(
        {
            "cache_dir": str(cache),
            "consumer": {"steps": steps, "wait_timeout_s": 0.5},
            "transport": {"endpoint": endpoint, "heartbeat_interval_s": 0.2},
        }
    )


def _group() -> list[procs.Tracked]:
    """This process's producer group: the supervisor (``python -m melfeed producer``) and its workers."""
    family = procs.descendants(os.getpid())
    return [p for p in family if b"producer" in Path(f"/proc/{p.pid}/cmdline").read_bytes()] if family else []


def test_a_consumer_with_producers_yields_the_plan_in_order_and_leaves_no_producer_behind(
    demo_cache: Path, endpoint: str
) -> None:
    seen: list[Any] = []
    group: list[Any] = []
    with melfeed.Consumer(_cfg(demo_cache, endpoint, _BATCHES), producers=1) as feed:
        for b in feed.batches():
            group = group or _group()  # while the producer runs (it exits by itself at the plan's end)
            seen.append((b.batch_id, b.bucket, b.sample_ids))
            assert all(np.shares_memory(a, feed.slot_buffers()[b.slot]) for a in b.arrays.values())
    assert seen == [(p.batch_id, p.bucket, p.sample_ids) for p in map(feed.plan.batch, range(_BATCHES))]
    assert len(group) >= 2, group  # the supervisor and its one worker, seen while the block ran
    assert procs.wait_gone(group, timeout_s=0) == [], [procs.describe(p) for p in group]
    feed.close()  # idempotent


def test_the_with_block_stops_the_producers_when_the_loop_raises(demo_cache: Path, endpoint: str) -> None:
    group: list[procs.Tracked] = []
    with pytest.raises(KeyError, match="the loop failed"):
        with melfeed.Consumer(_cfg(demo_cache, endpoint, None), producers=1) as feed:  # steps null: no end
            for batch in feed.batches():
                group = _group()
                raise KeyError(f"the loop failed at batch {batch.batch_id}")
    assert group and procs.wait_gone(group, timeout_s=0) == [], [procs.describe(p) for p in group]


def test_a_producer_group_that_dies_ends_the_wait_with_its_exit_code(demo_cache: Path, endpoint: str) -> None:
    with melfeed.Consumer(_cfg(demo_cache, endpoint, None), producers=1) as feed:
        batches = feed.batches()
        next(batches)
        group = _group()
        supervisor = min(group, key=lambda p: p.start_ticks)  # started first, before its workers
        os.kill(supervisor.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(melfeed.PipelineError, match=r"producer group \(pid \d+.*was killed by SIGKILL"):
            for _ in batches:  # the batches already in the ring come first, then the wait ends
                pass
        assert time.monotonic() - t0 < procs.WAIT_S
    assert procs.wait_gone(group) == [], [procs.describe(p) for p in group]  # the workers follow their supervisor


def test_producers_is_a_count_of_at_least_one(demo_cache: Path, endpoint: str) -> None:
    cfg = _cfg(demo_cache, endpoint, 5)
    with pytest.raises(ValueError, match="at least 1 producer"):
        melfeed.Consumer(cfg, producers=0)
    with pytest.raises(TypeError, match="a number of producers or None"):
        melfeed.Consumer(cfg, producers="2")  # type: ignore[arg-type]
