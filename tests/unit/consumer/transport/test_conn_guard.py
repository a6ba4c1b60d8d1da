"""The connection bound's bookkeeping (``ConnectionCount``) and the guard on a real ROUTER."""

from __future__ import annotations

import socket
import time

import zmq

from melfeed.consumer.transport.conn_guard import ConnectionCount, ConnectionGuard


def test_connections_past_the_bound_are_cut_and_a_closed_one_frees_its_place() -> None:
    count = ConnectionCount(2)
    assert [count.accepted(fd) for fd in (10, 11, 12)] == [False, False, True]
    assert (count.open, count.refused) == (2, 1)
    count.closed(12)  # the cut one goes: nothing changes
    assert count.open == 2
    count.closed(10)
    assert count.accepted(13) is False and count.open == 2
    assert count.accepted(11) is False and count.open == 2  # a repeated report is not a second connection


def test_the_guard_keeps_a_real_router_at_its_bound_and_cuts_only_its_own_connections() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    guard = ConnectionGuard(router, f"tcp://127.0.0.1:{port}", 3)
    conns = [socket.create_connection(("127.0.0.1", port), timeout=30.0) for _ in range(8)]
    try:
        deadline = time.monotonic() + 30.0
        while guard.count.refused < 5 and time.monotonic() < deadline:
            assert guard.monitor is not None
            guard.monitor.poll(100)
            guard.drain()
        assert (guard.count.open, guard.count.refused) == (3, 5)
        at_eof: set[int] = set()
        while len(at_eof) < 5 and time.monotonic() < deadline:  # the cut ones see the hang-up
            for i, c in enumerate(conns):
                if i not in at_eof and _at_eof(c):
                    at_eof.add(i)
        assert len(at_eof) == 5
        assert not any(_at_eof(c) for i, c in enumerate(conns) if i not in at_eof)  # the others stay
    finally:
        for c in conns:
            c.close()
        guard.close()
        guard.close()  # idempotent
        router.close(0)
        ctx.term()


def _at_eof(conn: socket.socket) -> bool:
    """Read what is queued (the ZMTP greeting) without blocking; True once the other side hung up."""
    conn.setblocking(False)
    try:
        while True:
            if conn.recv(4096) == b"":
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
