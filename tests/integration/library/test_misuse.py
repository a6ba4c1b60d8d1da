"""A user's own loop getting the library wrong: one clear error, and the ring, leases and endpoint stay sound.

Real ``Consumer`` objects bound on ipc endpoints under ``tmp_path``, no producers: batches are put into
the ring the way the receiver does (``reserve`` then ``mark_ready`` with the planned batch), so each
case runs in milliseconds. consumer/guards.py states the rules.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from melfeed.consumer import Consumer
from melfeed.consumer.flow.ring import SlotState
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ClosedError, PipelineError


def _cfg(cache: Path, endpoint: str) -> Any:
    return config_from_mapping(
        {"cache_dir": str(cache), "consumer": {"steps": 6, "wait_timeout_s": 0.2}, "transport": {"endpoint": endpoint}}
    )


@pytest.fixture()
def feed(demo_cache: Path, endpoint: str) -> Iterator[Consumer]:
    with Consumer(_cfg(demo_cache, endpoint)) as consumer:
        yield consumer


def _arrive(feed: Consumer, *batch_ids: int) -> None:
    """Batches ``batch_ids`` arrive in the ring as a producer's would (the receiver's two calls)."""
    for batch_id in batch_ids:
        slot = feed._ring.reserve()
        assert slot is not None
        feed._ring.mark_ready(slot, feed.plan.batch(batch_id))


def _leftovers() -> tuple[set[threading.Thread], set[str]]:
    """Receiver threads and this process's slot files in /dev/shm."""
    return (
        {t for t in threading.enumerate() if t.name == "receiver"},
        {f for f in os.listdir("/dev/shm") if f.startswith(f"melfeed-{os.getpid()}-")},
    )


def test_a_batch_released_twice_is_refused_and_frees_no_slot_twice(feed: Consumer) -> None:
    _arrive(feed, 0)
    batch = feed.next_batch(0)
    assert batch is not None
    feed.release(batch)
    _arrive(feed, 1)
    newer = feed.next_batch(0)
    assert newer is not None and newer.slot == batch.slot  # the freed slot holds batch 1 now
    with pytest.raises(RuntimeError, match="batch 0 was already applied"):
        feed.release(batch)
    with pytest.raises(RuntimeError, match="slot of batch 0 was already freed"):
        feed._desk.free_slot(batch)  # would free the slot batch 1 is in
    assert feed._ring.counts()[SlotState.IN_STEP] == 1 and feed.applied_ids == [0]
    feed.release(newer)
    assert feed.applied_ids == [0, 1]


def test_a_batch_released_to_another_consumer_is_refused(feed: Consumer, demo_cache: Path, tmp_path: Path) -> None:
    with Consumer(_cfg(demo_cache, f"ipc://{tmp_path}/other.sock")) as other:
        _arrive(feed, 0)
        _arrive(other, 0)
        mine, theirs = feed.next_batch(0), other.next_batch(0)
        assert mine is not None and theirs is not None and mine.slot == theirs.slot
        with pytest.raises(RuntimeError, match="handed out by another Consumer"):
            feed.release(theirs)
        assert feed.applied_ids == [] and feed._ring.counts()[SlotState.IN_STEP] == 1  # mine is untouched
        feed.release(mine)
        other.release(theirs)
        assert feed.applied_ids == other.applied_ids == [0]


def test_release_inside_a_batches_loop_lets_the_loop_go_on(feed: Consumer) -> None:
    _arrive(feed, 0, 1, 2)
    seen = []
    for batch in feed.batches():
        seen.append(batch.batch_id)
        feed.release(batch)  # as the guide suggests before a break; the loop goes on
        if batch.batch_id < 3:
            _arrive(feed, batch.batch_id + 3)
    assert seen == feed.applied_ids == list(range(6))
    assert feed._ring.counts()[SlotState.FREE] == feed._ring.n_slots


def test_a_batch_released_after_its_loop_broke_out_is_not_handed_out_again(feed: Consumer) -> None:
    _arrive(feed, 0, 1)
    for batch in feed.batches():  # noqa: B007 - leaving the loop early is what this test checks
        break
    feed.release(batch)  # stepped after all: applied, its slot free for batch 2
    _arrive(feed, 2)
    seen, arriving = [], 3
    for later in feed.batches():
        seen.append(later.batch_id)
        if arriving < 6:
            _arrive(feed, arriving)
            arriving += 1
    assert seen == [1, 2, 3, 4, 5]  # batch 0 is not handed out again from a reused slot
    assert feed.applied_ids == list(range(6))


def test_calls_before_start_and_after_close_say_so(demo_cache: Path, endpoint: str) -> None:
    before = _leftovers()
    feed = Consumer(_cfg(demo_cache, endpoint))
    with pytest.raises(RuntimeError, match=r"start\(\) was not called"):
        feed.next_batch(0)
    with pytest.raises(RuntimeError, match=r"start\(\) was not called"):
        next(feed.batches())  # not a silent wait for producers that cannot connect
    with feed:
        _arrive(feed, 0)
        loop = feed.batches()
        assert next(loop).batch_id == 0  # held when the consumer closes: given back, not applied
    assert list(feed.batches()) == [] and feed.applied_ids == []
    with pytest.raises(ClosedError, match="closed"):
        feed.next_batch(0)
    feed.close()  # twice: nothing happens
    with pytest.raises(ClosedError, match="closed"):
        feed.start()  # would bind and keep the endpoint locked for good
    assert _leftovers() == before  # no receiver thread, no slot file
    with Consumer(_cfg(demo_cache, endpoint)) as again:  # the endpoint is free for the next consumer
        assert again.next_batch(0) is None


def test_a_loop_ended_by_another_threads_close_leaves_its_with_only_once_the_consumer_is_closed(
    demo_cache: Path, endpoint: str
) -> None:
    feed = Consumer(_cfg(demo_cache, endpoint))
    stopping, may_stop = threading.Event(), threading.Event()
    stop = feed._receiver.stop

    def slow_stop() -> None:
        stopping.set()
        may_stop.wait(10.0)
        stop()

    feed._receiver.stop = slow_stop  # type: ignore[method-assign]
    with feed:
        loop = feed.batches()
        closer = threading.Thread(target=feed.close)
        closer.start()
        assert list(loop) == []  # woken at once by the closing ring
        assert stopping.wait(10.0)
        second = threading.Thread(target=feed.close)  # what leaving ``with`` does
        second.start()
        second.join(0.2)
        assert second.is_alive()  # still bound: it waits for the first close to finish
        may_stop.set()
        second.join(10.0)
        closer.join(10.0)
    assert not second.is_alive() and feed._receiver.context is None


def test_arguments_a_user_gets_wrong_are_one_clear_error(feed: Consumer, demo_cache: Path, endpoint: str) -> None:
    with pytest.raises(TypeError, match="config_from_mapping"):
        Consumer({"cache_dir": str(demo_cache)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_batch"):
        Consumer(_cfg(demo_cache, endpoint), start_batch=-1)
    resumed = Consumer(_cfg(demo_cache, endpoint), start_batch=np.int64(2))  # type: ignore[arg-type]  # a position read with numpy
    resumed.close()
    assert resumed._desk.next_id == 2 and type(resumed._desk.next_id) is int
    with pytest.raises(TypeError, match="never waits without a bound"):
        feed.next_batch(None)  # type: ignore[arg-type]
    assert feed.next_batch(-1.0) is None  # a negative wait is no wait
    assert feed.next_batch(np.float32(0.01)) is None  # type: ignore[arg-type]  # a wait computed with numpy
    for device in ("/GPU:7", "/CPU:3", "gpu zero", 0):  # named when the dataset is made, not at its first batch
        with pytest.raises(
            ValueError,
            match=r"prefetch_device must be 'auto', None or a device TensorFlow sees "
            r"\([^)]*CPU:0[^)]*\), got ",
        ):
            feed.as_dataset(prefetch_device=device)  # type: ignore[arg-type]
    assert feed.as_dataset(prefetch_device="/cpu:0") is not None  # any spelling of a device it sees


def test_a_receiver_that_fails_while_the_loop_waits_ends_the_loop_with_its_error(
    demo_cache: Path, endpoint: str
) -> None:
    feed = Consumer(_cfg(demo_cache, endpoint))
    waiting = threading.Event()
    clock, take = feed._receiver._clock, feed._ring.take

    def failing_clock() -> float:
        if waiting.is_set():
            raise OSError("planted receiver failure")
        return clock()

    def take_then_fail(batch_id: int, timeout_s: float) -> Any:
        waiting.set()
        feed._receiver.wake()
        return take(batch_id, 10.0)  # woken by the receiver closing the ring as it fails

    feed._receiver._clock = failing_clock
    feed._ring.take = take_then_fail  # type: ignore[method-assign]
    with feed, pytest.raises(PipelineError, match="receiver failed: planted receiver failure"):
        list(feed.batches())  # not an empty loop that looks like the plan's end
