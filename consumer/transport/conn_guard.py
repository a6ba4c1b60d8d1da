"""A bound on the connections libzmq holds open for the consumer's ROUTER endpoint.

Why: every connection accepted by libzmq costs the consumer one descriptor, and libzmq has no option
that caps them. Unbounded, idle connections that never say a word (1,100 of them on loopback tcp) take
every descriptor the process has, so the next checkpoint fails with "Too many open files"
(docs/security.md "Hostile peers"). Two layers bound them:

* ``ZMQ_HANDSHAKE_IVL`` (``transport.handshake_timeout_s``, set by the receiver): libzmq drops a
  connection that has not finished its ZMTP (and CURVE) handshake in time, so an idle or
  unauthenticated connection lives that long at most;
* this guard: a socket monitor reports every accepted connection (with its descriptor) and every
  disconnect; past ``transport.max_connections`` open connections the newest one is cut at once
  (``shutdown`` on its descriptor: libzmq sees the peer go, closes it and reports the disconnect).

``ConnectionCount`` is the pure bookkeeping (unit-tested); ``ConnectionGuard`` is the socket shell,
polled by the receiver thread, which owns it. A descriptor is cut only after checking it is still a
socket accepted on this endpoint (same local port, or same socket path): a descriptor number that was
closed and reused for anything else in the meantime is left alone.
The bound holds at the speed the receiver reads monitor events; a burst may briefly exceed it, which
is what the descriptor headroom (``raise_fd_limit`` at start, ``LimitNOFILE=`` in the unit) is for.
Shutdown: ``close()`` stops the monitor and closes its socket (idempotent; the receiver thread calls it).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from melfeed.shared.printable import escape_line

__all__ = ["ConnectionCount", "ConnectionGuard"]

log = logging.getLogger(__name__)

_LOG_INTERVAL_S = 5.0  # one WARNING per interval however fast a peer reconnects
_MAX_EVENTS_PER_WAKE = 4096  # > a burst of accepts between two polls; bounds one wake of the receiver


class ConnectionCount:
    """Which accepted descriptors are open, and which must be cut (pure: no sockets, no clock)."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._open: set[int] = set()
        self.refused = 0  # connections cut because the bound was reached

    @property
    def open(self) -> int:
        return len(self._open)

    def accepted(self, fd: int) -> bool:
        """A connection was accepted on ``fd``. Returns True when it must be cut (over the bound)."""
        if fd in self._open or len(self._open) < self.max_connections:
            self._open.add(fd)
            return False
        self.refused += 1
        return True

    def closed(self, fd: int) -> None:
        """The connection on ``fd`` is gone (a cut one too: it was never counted as open)."""
        self._open.discard(fd)


class ConnectionGuard:
    """Monitors ``sock`` (bound to ``endpoint``) and cuts accepted connections past ``max_connections``.

    Args:
        sock: the ROUTER, already bound; monitored from here on.
        endpoint: the address it is bound to (``LAST_ENDPOINT``: a real port for ``tcp://...:*``).
        max_connections: ``transport.max_connections``.
        clock: monotonic seconds (the rate limit of the warning).
    """

    def __init__(
        self, sock: zmq.Socket[bytes], endpoint: str, max_connections: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.count = ConnectionCount(max_connections)
        self._sock = sock
        self._endpoint = endpoint
        self._local = _local_address(endpoint)
        self._clock = clock
        self._log_s = 0.0
        self.monitor: zmq.Socket[bytes] | None = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    def drain(self) -> None:
        """Handle every queued monitor event (non-blocking, bounded per call)."""
        if self.monitor is None:
            return
        for _ in range(_MAX_EVENTS_PER_WAKE):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                if self.count.accepted(fd):
                    self._cut(fd)
            else:
                self.count.closed(fd)

    def _cut(self, fd: int) -> None:
        if _is_ours(fd, self._local):
            conn = socket.socket(fileno=fd)  # wraps libzmq's descriptor: shut down, never closed here
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone: libzmq reports the disconnect anyway
            finally:
                conn.detach()
        now = self._clock()
        if now >= self._log_s:
            log.warning(
                "%s: %d connections open, the bound (transport.max_connections); cut a new one, %d cut so far",
                escape_line(self._endpoint),
                self.count.open,
                self.count.refused,
            )
            self._log_s = now + _LOG_INTERVAL_S

    def close(self) -> None:
        if self.monitor is None:
            return
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.monitor = None


def _local_address(endpoint: str) -> int | str:
    """What an accepted socket of ``endpoint`` reports as its own address: the tcp port, or the ipc path."""
    if endpoint.startswith("tcp://"):
        return int(endpoint.rsplit(":", 1)[1])
    return endpoint.removeprefix("ipc://")


def _is_ours(fd: int, local: int | str) -> bool:
    """``fd`` is still a connected socket accepted on this endpoint (not a reused descriptor number)."""
    try:
        probe = socket.socket(fileno=fd)
    except OSError:
        return False  # not a socket (a file reopened on that number)
    try:
        name = probe.getsockname()
        if probe.type != socket.SOCK_STREAM:
            return False
        if isinstance(local, int):
            return probe.family in (socket.AF_INET, socket.AF_INET6) and name[1] == local
        return probe.family == socket.AF_UNIX and name == local
    except OSError:
        return False
    finally:
        probe.detach()
