"""The consumer's control socket: a REP socket that answers every request with the latest snapshot.

Role: lets ``melfeed status`` (consumer/observe/status.py) read the live figures of a running
consumer without touching the data path. The request body is ignored (any single frame up to
4 kB); the reply is the snapshot as JSON (``null`` before the first one).
Invariants: one thread owns the socket; it uses the consumer's ZeroMQ context (one per process);
linger 0; every poll is bounded, so ``stop`` is noticed within ``_POLL_MS``; a reply that cannot be
sent (the asker gave up) is dropped by REP, never retried.
An ipc control socket has its own endpoint lock (``consumer/transport/endpoint_lock.py``): a dead
consumer's leftover is removed at start, a live one's never touched.
Shutdown: ``close()`` sets the stop event and joins (bounded); the thread closes the socket, then
the socket file and its lock are removed. The socket must be closed before the context is
terminated (``Consumer.close``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from melfeed.consumer.transport.endpoint_lock import EndpointLock, lock_endpoint, remove_stale_endpoints
from melfeed.shared.errors import ConfigError

__all__ = ["ControlServer"]

log = logging.getLogger(__name__)

_POLL_MS = 100  # stop is noticed within this
_JOIN_TIMEOUT_S = 2.0  # > one poll plus one reply of a few kB
_MAX_REQUEST_BYTES = 4096  # a request is a short word; anything larger is dropped by libzmq


class ControlServer:
    """Serves ``get_reply()`` on ``endpoint`` from its own thread.

    Args:
        ctx: the process's ZeroMQ context.
        endpoint: ``ipc://...`` or loopback ``tcp://...`` (``consumer.control_endpoint``).
        get_reply: returns the bytes to answer with; called from the server thread.
    """

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, get_reply: Callable[[], bytes]) -> None:
        self.endpoint = endpoint
        self._ctx = ctx
        self._get_reply = get_reply
        self._stop = threading.Event()
        self._sock: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._lock: EndpointLock | None = None

    def start(self) -> None:
        """Bind (errors surface here, as ``ConfigError`` naming the key) and start serving. Idempotent."""
        if self._thread is not None or self._stop.is_set():
            return
        key = ("consumer", "control_endpoint")
        if self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@"):
            remove_stale_endpoints(Path(self.endpoint.removeprefix("ipc://")).parent)
        self._lock = lock_endpoint(self.endpoint, key)
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as err:
            sock.close(0)
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            raise ConfigError(
                f"cannot bind {self.endpoint}: {err.strerror}", path=("consumer", "control_endpoint")
            ) from err
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="control", daemon=True)
        self._thread.start()
        log.info("status served at %s", self.endpoint)

    def close(self) -> None:
        """Stop serving and close the socket. Idempotent; bounded by ``_JOIN_TIMEOUT_S``."""
        self._stop.set()
        closed = True
        if self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.error("control thread did not stop within %.1f s", _JOIN_TIMEOUT_S)
                closed = False
            self._thread = None
        elif self._sock is not None:
            self._sock.close(0)
        self._sock = None
        if self._lock is not None:
            self._lock.release(remove_files=closed)  # a socket still open keeps its file
            self._lock = None

    def _run(self) -> None:
        assert self._sock is not None  # set by start()
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                    sock.send(self._get_reply(), zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except zmq.ZMQError as err:  # e.g. EFSM after a failed send: REP recovers on the next recv
                    log.debug("control request dropped: %s", err)
        except BaseException:  # never take the consumer down over a status request
            log.error("control socket loop failed; status is no longer served", exc_info=True)
        finally:
            sock.close(0)
