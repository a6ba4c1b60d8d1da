"""``CopyThread``: copies run one at a time in submission order on their own thread; every wait is bounded."""

from __future__ import annotations

import threading

import pytest

from melfeed.consumer.train.copy_thread import CopyThread
from melfeed.shared.errors import PipelineError

_BOUND_S = 30.0  # generous: an event that never comes fails the test instead of hanging it


def test_copies_run_in_order_on_the_copy_thread_and_each_starts_after_the_one_before_completed() -> None:
    copier = CopyThread()
    log: list[tuple[str, int, str]] = []
    gate = threading.Event()

    def copy(k: int) -> int:
        log.append(("start", k, threading.current_thread().name))
        if k == 0:
            assert gate.wait(_BOUND_S)
        log.append(("end", k, threading.current_thread().name))
        return 10 * k

    first, second = copier.submit(lambda: copy(0)), copier.submit(lambda: copy(1))
    assert first.wait_started(_BOUND_S) and not first.done()
    assert not second.wait_started(0.05)  # the first still runs: the second has not been issued
    gate.set()
    assert (first.result(_BOUND_S), second.result(_BOUND_S)) == (0, 10) and first.done() and second.done()
    assert [(what, k) for what, k, _ in log] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]
    assert {name for *_, name in log} == {"melfeed-copy"}
    copier.close()
    copier.close()  # idempotent


def test_a_copys_error_is_raised_by_its_result_and_the_thread_goes_on() -> None:
    copier = CopyThread()

    def broken() -> int:
        raise ValueError("no device")

    failed, next_one = copier.submit(broken), copier.submit(lambda: 7)
    with pytest.raises(ValueError, match="no device"):
        failed.result(_BOUND_S)
    assert next_one.result(_BOUND_S) == 7
    copier.close()


def test_close_cancels_the_copies_not_started_waits_for_the_running_one_and_refuses_new_ones() -> None:
    copier = CopyThread()
    gate = threading.Event()
    running = copier.submit(lambda: gate.wait(_BOUND_S))
    assert running.wait_started(_BOUND_S)
    queued = copier.submit(lambda: 1)
    assert not copier.close(timeout_s=0.05)  # the copy it runs still reads its slot: not ended yet
    assert not running.done()
    gate.set()
    assert copier.close(_BOUND_S)  # waits for the running copy to end
    assert running.done() and running.result(_BOUND_S) is True
    with pytest.raises(PipelineError, match="closed before this copy started"):
        queued.result(_BOUND_S)
    assert not queued.started.is_set()
    with pytest.raises(PipelineError, match="the copy thread is closed"):
        copier.submit(lambda: 2)


def test_a_copy_that_never_completes_is_an_error_after_the_bound() -> None:
    copier = CopyThread()
    gate = threading.Event()
    stuck = copier.submit(lambda: gate.wait(_BOUND_S))
    with pytest.raises(PipelineError, match="did not complete within 0 s"):
        stuck.result(0.01)
    gate.set()
    copier.close()
