"""The producer's socket shell driven in-process: scripted consumer messages in, the exact frames out."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from producer.reader import TransientReadError
from producer.session import SessionConfig
from producer.worker import ProducerWorker, WorkerConfig
from shared.errors import CacheError
from shared.wire.protocol import (BatchHeader, Bye, Heartbeat, Hello, Lease, LeaseGrant, Message,
                                  Welcome, encode)
from tests.fakes import FakeAssembler, FakeClock, FakeDealer

HB_S = 0.2
SESSION = SessionConfig("producer-1", "ipc:///run/melfeed/sock", "fp", [[2, 4, 4]], 3, 7,
                        heartbeat_interval_s=HB_S, liveness_s=1.0, backoff_max_s=1.0)
BAD_FILE = "/cache/mels/LJ001-0003.npy"


def _worker(clock: FakeClock, assembler: FakeAssembler) -> ProducerWorker:
    return ProducerWorker(WorkerConfig(SESSION.endpoint, SESSION), assembler, clock=clock)


def _consumer(*msgs: Message, clock: FakeClock, stop: threading.Event | None = None,
              refuse_sends: bool = False) -> FakeDealer:
    """A consumer that has WELCOMEd us and leased ``msgs``; with ``stop``, the loop stops once idle."""
    dealer = FakeDealer(clock, on_idle=None if stop is None else lambda _: stop.set(), refuse_sends=refuse_sends)
    dealer.push(Welcome(7, 2, HB_S, False), *msgs)
    return dealer


def _kinds(dealer: FakeDealer) -> list[str]:
    return [type(m).__name__ for m in dealer.messages()]


def test_a_leased_batch_is_sent_as_header_and_four_frames_then_heartbeat_then_bye_on_stop() -> None:
    clock, stop = FakeClock(), threading.Event()
    assembler = FakeAssembler()
    worker = _worker(clock, assembler)
    dealer = _consumer(LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock, stop=stop)
    worker.serve(dealer, stop)
    # The idle poll that stopped the loop waited one interval: a second heartbeat was due before the BYE.
    assert _kinds(dealer) == ["Hello", "BatchHeader", "Heartbeat", "Heartbeat", "Bye"]
    hello, header, hb, _, bye = dealer.messages()
    assert isinstance(hello, Hello) and hello.caps == []         # no slot maps: payload frames only
    assert isinstance(header, BatchHeader) and (header.epoch, header.batch_id, header.shm) == (7, 5, None)
    assert [len(f) for f in dealer.sent[1][1:]] == [2 * 4 * 3 * 4, 2 * 4, 2 * 4 * 4, 2 * 4]
    assert isinstance(hb, Heartbeat) and hb.stats is not None and hb.stats.batches == 1
    assert bye == Bye(7) and dealer.sent[-1] == [encode(Bye(7))]  # a planned leave: no code, no reason
    assert worker.exit_code == 0 and worker.stats().batches_sent == 1


def test_a_bad_cache_file_under_fail_sends_bye_with_78_and_the_file_then_exits_78(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    worker = _worker(clock, FakeAssembler(error=CacheError(BAD_FILE, "missing")))
    dealer = _consumer(LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock)
    worker.serve(dealer, threading.Event())                      # returns by itself: the failure ends the loop
    assert worker.exit_code == 78
    assert _kinds(dealer) == ["Hello", "Bye"]
    assert dealer.messages()[-1] == Bye(7, 78, f"CacheError: {BAD_FILE}: missing")
    assert f"bad cache file in batch 5 (producer.bad_samples=fail); stopping: {BAD_FILE}: missing" in caplog.text


def test_a_transient_read_error_sends_bye_with_exit_1() -> None:
    clock = FakeClock()
    worker = _worker(clock, FakeAssembler(error=TransientReadError(BAD_FILE, "cannot open (Too many open files)")))
    dealer = _consumer(LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock)
    worker.serve(dealer, threading.Event())
    assert worker.exit_code == 1
    assert dealer.messages()[-1] == Bye(7, 1, f"TransientReadError: {BAD_FILE}: cannot open (Too many open files)")


def test_a_crash_in_a_build_sends_bye_with_exit_1_and_the_reason_then_propagates() -> None:
    clock = FakeClock()
    worker = _worker(clock, FakeAssembler(error=ValueError("lease names bucket 4, have 1")))
    dealer = _consumer(LeaseGrant(7, [Lease(5, 4, [10, 11], 5.0)], 1), clock=clock)
    with pytest.raises(ValueError, match="bucket 4"):
        worker.serve(dealer, threading.Event())
    assert worker.exit_code == 1
    assert dealer.messages()[-1] == Bye(7, 1, "ValueError: lease names bucket 4, have 1")


def test_a_bye_that_cannot_be_sent_does_not_hold_up_the_exit() -> None:
    clock = FakeClock()
    worker = _worker(clock, FakeAssembler(error=CacheError(BAD_FILE, "missing")))
    dealer = _consumer(LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock, refuse_sends=True)
    worker.serve(dealer, threading.Event())
    assert worker.exit_code == 78 and dealer.sent == []


def test_an_idle_joined_worker_waits_until_its_next_heartbeat_instead_of_spinning() -> None:
    clock, stop = FakeClock(), threading.Event()
    dealer = _consumer(clock=clock)
    dealer.on_idle = lambda d: stop.set() if clock() > 0.9 else None     # within liveness: no re-join
    _worker(clock, FakeAssembler()).serve(dealer, stop)
    hbs = [m for m in dealer.messages() if isinstance(m, Heartbeat)]
    assert len(hbs) == 6                                         # t = 0, 0.2, ... 1.0: one per interval
    assert dealer.poll_timeouts_ms[1:] == [200] * 5              # the first poll found the WELCOME waiting


@pytest.mark.parametrize("exit_at_plan_end", [True, False])
def test_the_plan_end_ends_the_loop_with_a_planned_bye_only_when_told_to_exit(exit_at_plan_end: bool) -> None:
    clock, stop = FakeClock(), threading.Event()
    cfg = dataclasses.replace(SESSION, exit_at_plan_end=exit_at_plan_end)
    worker = ProducerWorker(WorkerConfig(cfg.endpoint, cfg), FakeAssembler(), clock=clock)
    dealer = _consumer(Heartbeat(7, 0, 30, done=True), clock=clock)
    dealer.on_idle = lambda d: stop.set() if clock() > 3.0 else None    # a waiting producer runs on until stopped
    worker.serve(dealer, stop)
    assert worker.exit_code == 0 and dealer.messages()[1] == Bye(7)
    assert stop.is_set() is not exit_at_plan_end                  # the exiting one returned by itself
    later = _kinds(dealer)[2:]
    if exit_at_plan_end:
        assert later == []
    else:                                                         # HELLOs for the next consumer, nothing else
        assert later and set(later) == {"Hello"}
