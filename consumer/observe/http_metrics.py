"""A small HTTP server for ``/metrics``: one thread, a bounded number of connections, bounded requests.

Why not prometheus_client's own server: it starts a thread per connection, so 200 half-open
connections to the metrics port gave the consumer 229 threads (docs/security.md "Hostile peers").
Here one thread runs a ``selectors`` loop over the listening socket and every open connection:
* at most ``max_connections`` are open; accepting one more closes the oldest (a client that is
  still sending its request after everyone else is the one to drop), so held connections never lock
  a good client out;
* a request must arrive whole (headers up to ``_MAX_REQUEST_BYTES``) and be answered within
  ``request_timeout_s`` of the connection, else it is closed;
* one request per connection (``Connection: close``); GET or HEAD of ``/metrics`` (or ``/``) gets
  the exposition from ``render()``, anything else 404 or 405.
Invariant: threads = 1 and descriptors <= max_connections + 4 (listener, self-pipe, selector) whatever the clients do.
Shutdown: ``close()`` stops the loop (a self-pipe wakes it), joins it (bounded) and closes every
socket; idempotent.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MetricsHttpServer"]

log = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 8192  # request line and headers; a scraper sends a few hundred
_JOIN_TIMEOUT_S = 2.0  # > one loop turn (_TICK_S) plus one render
_TICK_S = 0.25  # deadline checks; the self-pipe wakes the loop at once for close()
_BACKLOG = 128


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    deadline_s: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytes = b""
    sent: int = 0


class MetricsHttpServer:
    """Serves ``render()`` at ``http://host:port/metrics`` from one thread.

    Args:
        host, port: where to listen (``port`` 0 picks a free one; see ``port`` after ``start()``).
        render: the exposition body and its content type, built at request time.
        max_connections: open connections at most (the oldest is closed to make room).
        request_timeout_s: a connection must have sent its request and taken the answer by then.
    """

    def __init__(
        self,
        host: str,
        port: int,
        render: Callable[[], tuple[bytes, str]],
        *,
        max_connections: int = 16,
        request_timeout_s: float = 5.0,
    ) -> None:
        self._address = (host, port)
        self._render = render
        self._max = max_connections
        self._timeout_s = request_timeout_s
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[int, _Conn] = {}  # by descriptor, in accept order (oldest first)
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.port = port
        self.dropped = 0  # connections closed unanswered (evicted or too slow)

    def start(self) -> None:
        """Bind and start serving. Raises ``OSError`` when the address cannot be bound."""
        host, port = self._address
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(addr)
            listener.listen(_BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread is None or not self._thread.is_alive():
            for conn in list(self._conns.values()):
                self._drop(conn)
            if self._listener is not None:
                self._listener.close()
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    # --- the loop (the server thread only) -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(_TICK_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        conn = self._conns.get(key.fd)
                        if conn is not None:
                            self._serve(conn, mask)
                now = time.monotonic()
                for conn in [c for c in self._conns.values() if now >= c.deadline_s]:
                    self.dropped += 1
                    self._drop(conn)
        except Exception:  # never take the consumer down for a metrics client
            log.error("metrics HTTP server stopped", exc_info=True)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(_BACKLOG):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # EMFILE and friends: leave it queued, try again next turn
                log.debug("metrics accept failed: %s", err)
                return
            if len(self._conns) >= self._max:
                self.dropped += 1
                self._drop(next(iter(self._conns.values())))  # the oldest makes room
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + self._timeout_s)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ)

    def _serve(self, conn: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_READ and not conn.outbox:
                data = conn.sock.recv(4096)
                if not data:
                    self._drop(conn)
                    return
                conn.inbox += data
                if b"\r\n\r\n" in conn.inbox or b"\n\n" in conn.inbox:
                    self._answer(conn)
                elif len(conn.inbox) > _MAX_REQUEST_BYTES:
                    conn.outbox = _response(431, b"request too large\n", "text/plain")
                    self._sel.modify(conn.sock, selectors.EVENT_WRITE)
                return
            if mask & selectors.EVENT_WRITE:
                conn.sent += conn.sock.send(conn.outbox[conn.sent :])
                if conn.sent >= len(conn.outbox):
                    self._drop(conn)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)

    def _answer(self, conn: _Conn) -> None:
        line = bytes(conn.inbox).split(b"\n", 1)[0].decode("latin-1").split()
        method, path = (line[0], line[1].split("?", 1)[0]) if len(line) >= 2 else ("", "")
        if method not in ("GET", "HEAD"):
            conn.outbox = _response(405, b"only GET\n", "text/plain")
        elif path not in ("/metrics", "/"):
            conn.outbox = _response(404, b"try /metrics\n", "text/plain")
        else:
            body, content_type = self._render()
            conn.outbox = _response(200, body, content_type, head=method == "HEAD")
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large"}


def _response(status: int, body: bytes, content_type: str, *, head: bool = False) -> bytes:
    header = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    return header + (b"" if head else body)
