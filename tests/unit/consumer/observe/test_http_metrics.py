"""The metrics HTTP server under held connections: one thread, bounded connections, /metrics still answers."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from melfeed.consumer.observe.http_metrics import MetricsHttpServer
from melfeed.consumer.observe.prom import start_prometheus

_HALF_OPEN = 200
_WAIT_S = 30.0


def _snapshot() -> dict[str, Any]:
    import tempfile

    from melfeed.consumer.observe.telemetry import Telemetry
    from tests.unit.consumer.observe.test_telemetry import _cfg, _FakeConsumer  # a real snapshot

    with tempfile.TemporaryDirectory() as tmp:
        from pathlib import Path

        tel = Telemetry(_cfg(Path(tmp)), _FakeConsumer(), 0.0, control_endpoint=None)
        return tel.publish(3, 0.25, 0)


def test_200_half_open_connections_leave_one_thread_and_a_good_client_gets_metrics() -> None:
    snap = _snapshot()
    threads_before = threading.active_count()
    server = start_prometheus("127.0.0.1", 0, lambda: snap)
    held: list[socket.socket] = []
    try:
        for _ in range(_HALF_OPEN):  # a request line, never the blank line that ends it
            s = socket.create_connection(("127.0.0.1", server.port), timeout=_WAIT_S)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        assert threading.active_count() <= threads_before + 1
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=_WAIT_S) as reply:
            body = reply.read().decode()
        assert reply.status == 200 and "melfeed_loss 0.25" in body
        assert threading.active_count() <= threads_before + 1
    finally:
        for s in held:
            s.close()
        server.close()
        server.close()  # idempotent
    assert threading.active_count() <= threads_before


def test_a_stalled_request_is_closed_after_the_request_timeout_and_others_get_404_or_405() -> None:
    server = MetricsHttpServer(
        "127.0.0.1", 0, lambda: (b"m 1\n", "text/plain"), max_connections=4, request_timeout_s=0.3
    )
    server.start()
    try:
        stalled = socket.create_connection(("127.0.0.1", server.port), timeout=_WAIT_S)
        stalled.sendall(b"GET /metr")
        t0 = time.monotonic()
        assert stalled.recv(100) == b""  # closed by the server, unanswered
        assert time.monotonic() - t0 < _WAIT_S / 2
        stalled.close()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=_WAIT_S)
        assert err.value.code == 404
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=_WAIT_S)
        assert err.value.code == 405
        big = socket.create_connection(("127.0.0.1", server.port), timeout=_WAIT_S)
        big.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10000)
        assert big.recv(100).startswith(b"HTTP/1.1 431")
        big.close()
        assert server.dropped >= 1
    finally:
        server.close()
