"""sd_notify against a real AF_UNIX datagram socket (no systemd needed)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from melfeed.shared.service.sdnotify import Notifier


@pytest.fixture()
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield sock, path
    sock.close()


def _recv(sock: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())


def test_ready_status_stopping_and_extend_arrive_as_key_value_datagrams(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    n.ready("compiled 4 shapes\nin 3 s")
    assert _recv(sock) == {"READY": "1", "STATUS": "compiled 4 shapes in 3 s"}  # one line, always
    n.status("x" * 500)
    assert len(_recv(sock)["STATUS"]) == 200
    n.extend_timeout(30)
    assert _recv(sock) == {"EXTEND_TIMEOUT_USEC": "30000000"}
    n.stopping()
    assert _recv(sock) == {"STOPPING": "1"}
    n.close()
    n.close()


def test_watchdog_pings_at_half_the_period_and_only_for_our_pid(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_interval_s == 2.0
    assert n.watchdog(now_s=100.0) and _recv(sock) == {"WATCHDOG": "1"}
    assert not n.watchdog(now_s=101.9)  # rate-limited: nothing sent
    assert n.watchdog(now_s=102.0) and _recv(sock) == {"WATCHDOG": "1"}
    other = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None and not other.watchdog()


def test_abstract_socket_address(tmp_path: Path) -> None:
    name = f"melfeed-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    try:
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert _recv(sock) == {"READY": "1"}
    finally:
        sock.close()


def test_without_systemd_every_call_is_a_no_op_and_a_vanished_socket_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    quiet = Notifier({})
    assert not quiet.enabled and not quiet.notify(READY=1) and not quiet.watchdog()
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody.sock")})
    assert not gone.notify(READY=1) and not gone.notify(STATUS="x")
    assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1


def test_a_receiver_that_stopped_reading_never_blocks_the_sender(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    sent = [n.notify(STATUS=f"status {i}") for i in range(2000)]  # far beyond the datagram queue length
    assert sent[0] and not all(sent)  # a blocking send would hang here


def _fill(n: Notifier) -> int:
    """Fill the receiver's datagram queue with STATUS lines (never blocking); how many went in."""
    sent = 0
    while n.notify(STATUS=f"status {sent}"):
        sent += 1
        assert sent < 100_000, "the queue never filled"
    return sent


def test_a_state_change_waits_for_room_in_a_full_queue_instead_of_being_dropped(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2"})
    queued = _fill(n)
    assert not n.watchdog(now_s=1.0)  # a ping is dropped at once: the queue is full
    drainer = threading.Timer(0.2, sock.recv, args=(4096,))  # a reader that fell behind for a moment
    drainer.start()
    try:
        n.stopping("bye")  # waits (bounded) for the reader, then goes in
    finally:
        drainer.join(60)
    received = [_recv(sock) for _ in range(queued)]
    assert received[-1] == {"STOPPING": "1", "STATUS": "bye"}, received[-3:]


def test_a_state_change_gives_up_after_its_bounded_wait(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    _fill(n)
    started_s = time.monotonic()
    assert not n.notify(READY=1)  # nobody reads: dropped after the wait, never raises
    assert 0.5 <= time.monotonic() - started_s < 30
