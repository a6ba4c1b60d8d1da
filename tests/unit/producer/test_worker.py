"""The producer's socket shell driven in-process: scripted consumer messages in, the exact frames out.

Trust: a real socket file decides whether the worker connects and takes a WELCOME; a real slot file
decides whether it builds in shared memory."""

from __future__ import annotations

import dataclasses
import logging
import os
import pwd
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import zmq

from melfeed.producer.batcher import BuiltBatch
from melfeed.producer.reader import TransientReadError
from melfeed.producer.session import ProducerSessionConfig
from melfeed.producer.slot_maps import SlotMappings
from melfeed.producer.worker import ProducerWorker, WorkerConfig
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.buckets import Bucket, build_buckets
from melfeed.shared.wire.layout import slot_nbytes_for
from melfeed.shared.wire.protocol import (
    CAP_SHM,
    LEARN_ROWS,
    BatchHeader,
    Bye,
    Heartbeat,
    Hello,
    Lease,
    LeaseGrant,
    Message,
    ShmSlot,
    Welcome,
    decode_header,
    encode,
)
from tests.fakes import FakeAssembler, FakeClock, FakeDealer

HB_S = 0.2
SESSION = ProducerSessionConfig(
    "producer-1",
    "tcp://127.0.0.1:5555",
    "fp",
    [[2, 4, 4]],
    3,
    7,
    heartbeat_interval_s=HB_S,
    liveness_s=1.0,
    backoff_max_s=1.0,
)
BAD_FILE = "/cache/mels/LJ001-0003.npy"


def _worker(clock: FakeClock, assembler: FakeAssembler) -> ProducerWorker:
    return ProducerWorker(WorkerConfig(SESSION.endpoint, SESSION), assembler, clock=clock)


def _welcome(worker: ProducerWorker, shm_dir: str | None = None) -> Welcome:
    """The consumer's answer to ``worker``'s HELLO: it echoes the HELLO's join nonce."""
    return Welcome(7, 2, HB_S, False, worker.session.hello().nonce, shm_dir)


def _consumer(
    worker: ProducerWorker,
    *msgs: Message,
    clock: FakeClock,
    stop: threading.Event | None = None,
    refuse_sends: bool = False,
) -> FakeDealer:
    """A consumer that has WELCOMEd ``worker`` and leased ``msgs``; with ``stop``, the loop stops once idle."""
    dealer = FakeDealer(clock, on_idle=None if stop is None else lambda _: stop.set(), refuse_sends=refuse_sends)
    dealer.push(_welcome(worker), *msgs)
    return dealer


def _kinds(dealer: FakeDealer) -> list[str]:
    return [type(m).__name__ for m in dealer.messages()]


def test_a_leased_batch_is_sent_as_header_and_four_frames_then_heartbeat_then_bye_on_stop() -> None:
    clock, stop = FakeClock(), threading.Event()
    assembler = FakeAssembler()
    worker = _worker(clock, assembler)
    dealer = _consumer(worker, LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock, stop=stop)
    worker.serve(dealer, stop)
    # The idle poll that stopped the loop waited one interval: a second heartbeat was due before the BYE.
    assert _kinds(dealer) == ["Hello", "BatchHeader", "Heartbeat", "Heartbeat", "Bye"]
    hello, header, hb, _, bye = dealer.messages()
    assert isinstance(hello, Hello) and hello.caps == []  # no slot maps: payload frames only
    assert isinstance(header, BatchHeader) and (header.epoch, header.batch_id, header.shm) == (7, 5, None)
    assert [len(f) for f in dealer.sent[1][1:]] == [2 * 4 * 3 * 4, 2 * 4, 2 * 4 * 4, 2 * 4]
    assert isinstance(hb, Heartbeat) and hb.stats is not None and hb.stats.batches == 1
    assert bye == Bye(7) and dealer.sent[-1] == [encode(Bye(7))]  # a planned leave: no code, no reason
    assert worker.exit_code == 0 and worker.stats().batches_sent == 1


def test_rows_learned_in_the_welcome_shape_the_batches_before_the_first_build() -> None:
    clock, stop = FakeClock(), threading.Event()
    assembler = FakeAssembler(rows=1)  # the shape set a learning producer starts with
    cfg = dataclasses.replace(SESSION, buckets=[[0, LEARN_ROWS, 4, 4, 3]])
    worker = ProducerWorker(WorkerConfig(cfg.endpoint, cfg), assembler, clock=clock)
    dealer = FakeDealer(clock, on_idle=lambda _: stop.set())
    welcome = dataclasses.replace(_welcome(worker), rows=[3])
    dealer.push(welcome, LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0), Lease(6, 0, [12], 5.0)], 1))
    worker.serve(dealer, stop)
    assert assembler.rows_used == [[3]] and assembler.built == [5, 6]  # adopted once, before the first build
    header = dealer.messages()[1]
    assert isinstance(header, BatchHeader) and header.shapes[0] == [3, 4, 3]


def test_a_plan_learned_in_the_welcome_shapes_the_batches_before_the_first_build() -> None:
    clock, stop = FakeClock(), threading.Event()
    assembler = FakeAssembler()  # two rows of 4 frames: not the consumer's plan
    planned = (Bucket(0, 3, 8, 5, 3),)
    cfg = dataclasses.replace(SESSION, buckets=[])  # buckets.cost: measured: no shapes until the WELCOME
    worker = ProducerWorker(WorkerConfig(cfg.endpoint, cfg), assembler, clock=clock, planner=lambda c, r: planned)
    dealer = FakeDealer(clock, on_idle=lambda _: stop.set())
    welcome = dataclasses.replace(_welcome(worker), costs=[0.5, 0.002], buckets=[planned[0].as_wire()])
    dealer.push(welcome, LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0), Lease(6, 0, [12], 5.0)], 1))
    worker.serve(dealer, stop)
    hello, header = dealer.messages()[:2]
    assert isinstance(hello, Hello) and hello.buckets == []
    assert assembler.buckets_used == [planned] and assembler.built == [5, 6]  # adopted once, before the first build
    assert isinstance(header, BatchHeader) and header.shapes[0] == [3, 8, 3] and header.shapes[2] == [3, 5]


def test_a_restarted_consumer_with_other_weights_reshapes_the_batches_of_its_epoch() -> None:
    clock, stop = FakeClock(), threading.Event()
    assembler = FakeAssembler()
    plans = {(0.5, 0.002): (Bucket(0, 3, 8, 5, 3),), (1.0, 0.0): (Bucket(0, 2, 16, 6, 3),)}
    cfg = dataclasses.replace(SESSION, buckets=[])
    worker = ProducerWorker(
        WorkerConfig(cfg.endpoint, cfg), assembler, clock=clock, planner=lambda costs, rows: plans[costs]
    )

    def restarted(dealer: FakeDealer) -> None:  # the next consumer answers the HELLO the worker sends now
        plan = plans[(1.0, 0.0)]
        welcome = Welcome(9, 2, HB_S, False, worker.session.hello().nonce, None, None, [1.0, 0.0], [plan[0].as_wire()])
        dealer.push(welcome, LeaseGrant(9, [Lease(6, 0, [12, 13], 5.0)], 1))

    # One step per idle poll: the consumer restarts (a heartbeat of a new epoch), answers the new HELLO, then stop.
    script: list[Callable[[FakeDealer], None]] = [lambda d: d.push(Heartbeat(9)), restarted, lambda _: stop.set()]
    dealer = FakeDealer(clock, on_idle=lambda d: script.pop(0)(d))
    first = plans[(0.5, 0.002)]
    welcome = dataclasses.replace(_welcome(worker), costs=[0.5, 0.002], buckets=[first[0].as_wire()])
    dealer.push(welcome, LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1))
    worker.serve(dealer, stop)
    headers = [m for m in dealer.messages() if isinstance(m, BatchHeader)]
    assert [(h.epoch, h.batch_id, h.shapes[0]) for h in headers] == [(7, 5, [3, 8, 3]), (9, 6, [2, 16, 3])]
    assert assembler.buckets_used == [first, plans[(1.0, 0.0)]] and worker.exit_code == 0


def test_a_bad_cache_file_under_fail_sends_bye_with_78_and_the_file_then_exits_78(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    worker = _worker(clock, FakeAssembler(error=CacheError(BAD_FILE, "missing")))
    dealer = _consumer(worker, LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock)
    worker.serve(dealer, threading.Event())  # returns by itself: the failure ends the loop
    assert worker.exit_code == 78
    assert _kinds(dealer) == ["Hello", "Bye"]
    assert dealer.messages()[-1] == Bye(7, 78, f"CacheError: {BAD_FILE}: missing")
    assert f"bad cache file in batch 5 (producer.bad_samples=fail); stopping: {BAD_FILE}: missing" in caplog.text


def test_a_transient_read_error_sends_bye_with_exit_1() -> None:
    clock = FakeClock()
    worker = _worker(clock, FakeAssembler(error=TransientReadError(BAD_FILE, "cannot open (Too many open files)")))
    dealer = _consumer(worker, LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock)
    worker.serve(dealer, threading.Event())
    assert worker.exit_code == 1
    assert dealer.messages()[-1] == Bye(7, 1, f"TransientReadError: {BAD_FILE}: cannot open (Too many open files)")


def test_a_crash_in_a_build_sends_bye_with_exit_1_and_the_reason_then_propagates() -> None:
    clock = FakeClock()
    worker = _worker(clock, FakeAssembler(error=ValueError("lease names bucket 4, have 1")))
    dealer = _consumer(worker, LeaseGrant(7, [Lease(5, 4, [10, 11], 5.0)], 1), clock=clock)
    with pytest.raises(ValueError, match="bucket 4"):
        worker.serve(dealer, threading.Event())
    assert worker.exit_code == 1
    assert dealer.messages()[-1] == Bye(7, 1, "ValueError: lease names bucket 4, have 1")


def test_a_bye_that_cannot_be_sent_does_not_hold_up_the_exit() -> None:
    clock = FakeClock()
    worker = _worker(clock, FakeAssembler(error=CacheError(BAD_FILE, "missing")))
    dealer = _consumer(worker, LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock, refuse_sends=True)
    worker.serve(dealer, threading.Event())
    assert worker.exit_code == 78 and dealer.sent == []


def test_an_idle_joined_worker_waits_until_its_next_heartbeat_instead_of_spinning() -> None:
    clock, stop = FakeClock(), threading.Event()
    worker = _worker(clock, FakeAssembler())
    dealer = _consumer(worker, clock=clock)
    dealer.on_idle = lambda d: stop.set() if clock() > 0.9 else None  # within liveness: no re-join
    worker.serve(dealer, stop)
    hbs = [m for m in dealer.messages() if isinstance(m, Heartbeat)]
    assert len(hbs) == 6  # t = 0, 0.2, ... 1.0: one per interval
    assert dealer.poll_timeouts_ms[1:] == [200] * 5  # the first poll found the WELCOME waiting


@pytest.mark.parametrize("exit_at_plan_end", [True, False])
def test_the_plan_end_ends_the_loop_with_a_planned_bye_only_when_told_to_exit(exit_at_plan_end: bool) -> None:
    clock, stop = FakeClock(), threading.Event()
    cfg = dataclasses.replace(SESSION, exit_at_plan_end=exit_at_plan_end)
    worker = ProducerWorker(WorkerConfig(cfg.endpoint, cfg), FakeAssembler(), clock=clock)
    dealer = _consumer(worker, Heartbeat(7, 0, 30, done=True), clock=clock)
    dealer.on_idle = lambda d: stop.set() if clock() > 3.0 else None  # a waiting producer runs on until stopped
    worker.serve(dealer, stop)
    assert worker.exit_code == 0 and dealer.messages()[1] == Bye(7)
    assert stop.is_set() is not exit_at_plan_end  # the exiting one returned by itself
    later = _kinds(dealer)[2:]
    if exit_at_plan_end:
        assert later == []
    else:  # HELLOs for the next consumer, nothing else
        assert later and set(later) == {"Hello"}


# --- trust: which consumer the worker connects to, takes a WELCOME from, and writes slot files for ------------


@pytest.fixture()
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    """A real unix socket file, bound (as a consumer's is) by this process: owned by our euid."""
    path = tmp_path / "c.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    try:
        yield path
    finally:
        sock.close()


def _ipc_worker(
    clock: Callable[[], float],
    path: Path,
    assembler: FakeAssembler,
    slot_maps: SlotMappings | None = None,
    backoff_max_s: float = 1.0,
) -> ProducerWorker:
    cfg = dataclasses.replace(SESSION, endpoint=f"ipc://{path}", backoff_max_s=backoff_max_s)
    return ProducerWorker(WorkerConfig(cfg.endpoint, cfg), assembler, slot_maps, clock=clock)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _plant(kind: str, path: Path) -> str:
    """Make ``path`` (our bound socket) what a squatter leaves there; returns the reason the worker must give."""
    if kind == "other owner":
        os.chown(path, 65534, 65534)
        return f"socket owned by uid 65534 ({pwd.getpwuid(65534).pw_name}), not by this process's uid"
    if kind == "symlink":
        path.rename(path.with_name("real.sock"))
        path.symlink_to(path.with_name("real.sock"))  # a socket of ours, behind a link
        return "a symbolic link, not a socket"
    if kind == "regular file":
        path.unlink()
        path.write_bytes(b"")
        return "not a socket"
    return ""


@pytest.mark.parametrize("kind", ["other owner", "symlink", "regular file", "ours"])
def test_a_welcome_is_taken_only_while_the_socket_file_is_a_socket_of_ours_or_roots(
    unix_socket: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    if kind == "other owner" and os.geteuid() != 0:
        pytest.skip("giving a socket file to uid 65534 needs root")
    reason = _plant(kind, unix_socket)
    clock, stop = FakeClock(), threading.Event()
    assembler = FakeAssembler()
    worker = _ipc_worker(clock, unix_socket, assembler)
    dealer = _consumer(worker, LeaseGrant(7, [Lease(5, 0, [10, 11], 5.0)], 1), clock=clock)

    def answer_again(d: FakeDealer) -> None:  # the same consumer answers every HELLO
        d.push(_welcome(worker))
        if clock() > 3.0:
            stop.set()

    dealer.on_idle = answer_again
    worker.serve(dealer, stop)  # no hang, no crash
    if kind == "ours":
        assert worker.joined_epoch == 7 and assembler.built == [5] and _warnings(caplog) == []
        return
    assert worker.joined_epoch is None and assembler.built == []
    assert set(_kinds(dealer)) == {"Hello"} and len(_kinds(dealer)) >= 3  # HELLO goes on with its back-off
    refusals = _warnings(caplog)
    assert len(refusals) == 1, refusals  # once, however often it answers
    assert refusals[0].startswith(f"refusing the consumer at {unix_socket}: {reason}"), refusals


def test_run_connects_only_once_the_socket_file_is_trusted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a socket file to uid 65534 needs root")
    path = tmp_path / "c.sock"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{path}")
    os.chown(path, 65534, 65534)  # a squatter's consumer at our endpoint
    worker = _ipc_worker(time.monotonic, path, FakeAssembler(), backoff_max_s=0.2)  # real time: a real socket
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), name="producer", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10.0
        while not _warnings(caplog):
            assert time.monotonic() < deadline, "the worker never refused the squatted socket"
            assert router.poll(50) == 0, "the worker connected to a socket file of uid 65534"
        assert "socket owned by uid 65534" in _warnings(caplog)[0]
        os.chown(path, 0, 0)  # now root's: trusted
        assert router.poll(10_000), "no HELLO once the socket file was trusted"
        _, frame = router.recv_multipart()
        assert isinstance(decode_header(frame), Hello)
    finally:
        stop.set()
        thread.join(10)
        router.close()
        ctx.term()
    assert not thread.is_alive()


class _Scribbler(FakeAssembler):
    """Writes 0xFF over every byte of the slot it is given, as a real build overwrites it."""

    def build(
        self,
        batch_id: int,
        bucket: int,
        sample_ids: list[int],
        target: dict[str, npt.NDArray[np.generic]] | None = None,
    ) -> BuiltBatch:
        for arr in (target or {}).values():
            arr.view(np.uint8)[...] = 0xFF
        return super().build(batch_id, bucket, sample_ids, target)


def test_a_lease_naming_a_hard_link_to_a_victims_file_is_refused_unwritten_and_payload_frames_follow(
    unix_socket: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    buckets = build_buckets(np.array([4, 4]), np.array([4, 4]), 3, BucketConfig(num_buckets=1, batch_size=2))
    shm = tmp_path / "shm"
    shm.mkdir()
    victim = tmp_path / "precious.bin"
    victim.write_bytes(os.urandom(slot_nbytes_for(buckets.buckets)))
    victim.chmod(0o600)
    before = victim.read_bytes()
    name = "melfeed-4242-7-s0-g0"
    os.link(victim, shm / name)
    clock, stop = FakeClock(), threading.Event()
    assembler = _Scribbler()
    maps = SlotMappings(buckets, 4, shm_dir=str(shm), endpoint=f"ipc://{unix_socket}")
    worker = _ipc_worker(clock, unix_socket, assembler, maps)
    dealer = FakeDealer(clock, on_idle=lambda _: stop.set() if clock() > 2.0 else None)
    dealer.push(_welcome(worker, str(shm)), LeaseGrant(7, [Lease(5, 0, [0, 1], 5.0, ShmSlot(name, 0, 0))], 1))
    worker.serve(dealer, stop)
    assert victim.read_bytes() == before and assembler.built == []
    hellos = [m for m in dealer.messages() if isinstance(m, Hello)]
    assert hellos[0].caps == [CAP_SHM] and hellos[-1].caps == []  # payload frames from now on
    assert _warnings(caplog) == [
        f"cannot map slot file {shm}/{name} (errno 1: refused: has 2 hard links, a slot "
        "file has 1); using ZeroMQ payload frames from now on"
    ]


def test_while_no_socket_file_exists_the_worker_looks_again_within_the_first_back_off(tmp_path: Path) -> None:
    """A producer started before its consumer joins it at once when the consumer binds: waiting for the socket
    file never grows the HELLO back-off (it grew to connect_backoff_max_s, 5 s, before the first connect)."""
    clock, path, stop = FakeClock(100.0), tmp_path / "later.sock", threading.Event()
    seen: dict[str, Any] = {}

    def on_idle(dealer: FakeDealer) -> None:
        if clock() >= 104.0 and "bound_s" not in seen:  # the consumer binds 4 s after the producer began
            seen["sock"] = socket.socket(socket.AF_UNIX)
            seen["sock"].bind(str(path))
            seen["bound_s"] = clock()
        if dealer.connected_to and "connected_s" not in seen:
            seen["connected_s"] = clock()
        if "connected_s" in seen or clock() > 130.0:
            stop.set()

    dealer = FakeDealer(clock, on_idle=on_idle)
    worker = _ipc_worker(clock, path, FakeAssembler(), backoff_max_s=5.0)
    try:
        worker.serve(dealer, stop, connect=True)
    finally:
        if "sock" in seen:
            seen["sock"].close()
    assert dealer.connected_to == [f"ipc://{path}"]
    assert seen["connected_s"] - seen["bound_s"] <= 0.25, seen  # within about one first back-off
    assert max(dealer.poll_timeouts_ms) <= 101  # never a grown back-off while waiting
