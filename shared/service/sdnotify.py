"""Pure-Python ``sd_notify`` (systemd ``Type=notify``): READY, STATUS, WATCHDOG, STOPPING.

Role: the only code that talks to systemd. Without ``$NOTIFY_SOCKET`` (not under systemd, or a unit
that is not ``Type=notify``) every call is a cheap no-op, so callers never branch on it.
Protocol (sd_notify(3)): one ``AF_UNIX``/``SOCK_DGRAM`` datagram of ``KEY=VALUE`` lines to the path
in ``$NOTIFY_SOCKET`` (a leading ``@`` names an abstract socket). ``$WATCHDOG_USEC`` (with
``$WATCHDOG_PID`` naming us, when set) asks for ``WATCHDOG=1`` at least that often; we ping at half
the period. A failed send is logged once and never raises.
Two kinds of send: STATUS, WATCHDOG and EXTEND_TIMEOUT_USEC never block (``MSG_DONTWAIT``): losing
one must not stop training (systemd's watchdog catches a notifier that really stopped), and they
are sent from loops (found the hard way: a full datagram queue blocked a producer's loop for 30 s).
State changes (READY, STOPPING, RELOADING, ERRNO) are sent once each and systemd acts on them, so
when the receiver's queue is full they wait for room, at most ``_STATE_SEND_WAIT_S`` (the kernel's
send timeout, woken as soon as the reader drains one datagram), instead of being dropped. Found the
hard way too: a reader that fell behind (Linux queues 10 datagrams by default) lost a producer's
STOPPING behind its own WATCHDOG pings.
Invariants: ``watchdog()`` is only called by a loop that made progress since its last call (the
callers' job; see ``consumer/train/loop.py``); STATUS texts are single lines of at most 200 chars.
Shutdown: ``close()`` is idempotent.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = ["Notifier"]

log = logging.getLogger(__name__)

_STATUS_MAX = 200
_STATE_KEYS = frozenset({"READY", "STOPPING", "RELOADING", "ERRNO"})  # sent once; systemd acts on them
_STATE_SEND_WAIT_S = 1.0  # > a reader busy for a moment on a loaded machine; far below any start/stop timeout


class Notifier:
    """Sends notifications to systemd if ``environ`` has ``NOTIFY_SOCKET``; otherwise does nothing."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if path.startswith("@"):
            self._address = b"\0" + path[1:].encode()
        elif path.startswith("/"):
            self._address = path
        self._sock: socket.socket | None = None
        if self._address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Bounds a blocking send (state changes only): the kernel waits for room in the
            # receiver's queue, then gives up with EAGAIN.
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(_STATE_SEND_WAIT_S))
        self.watchdog_interval_s = _watchdog_interval(env)
        self._next_ping_s = 0.0
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=VALUE`` lines, e.g. ``notify(READY=1, STATUS="...")``. True if sent.

        A state change waits (bounded) for room in a full queue; anything else is dropped at once.
        """
        if self._sock is None or self._address is None:
            return False
        text = "\n".join(f"{k}={_one_line(v)}" for k, v in fields.items())
        # A datagram queue that systemd (or anyone) stopped reading must not stall the loop that
        # sends: MSG_DONTWAIT drops the message instead (EAGAIN). State changes may wait for room.
        flags = 0 if _STATE_KEYS.intersection(fields) else socket.MSG_DONTWAIT
        try:
            self._sock.sendto(text.encode(), flags, self._address)
            return True
        except OSError as err:
            if not self._warned:
                log.warning("sd_notify to %s failed: %s (further failures are silent)", self._address, err)
                self._warned = True
            return False

    def ready(self, status: str | None = None) -> None:
        self.notify(READY=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> None:
        self.notify(STATUS=text)

    def extend_timeout(self, seconds: float) -> None:
        """Ask systemd for ``seconds`` more before a start (or stop) timeout fires."""
        self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    @contextmanager
    def extending_start_timeout(self, every_s: float = 10.0) -> Iterator[None]:
        """Inside: ``extend_timeout(3 x every_s)`` every ``every_s`` from a thread of its own (compiling can outlast
        ``TimeoutStartSec``; READY comes after). Without systemd no thread is started."""
        done = threading.Event()

        def extend() -> None:
            while not done.is_set():
                self.extend_timeout(every_s * 3)
                done.wait(every_s)

        thread = threading.Thread(target=extend, name="sd-extend", daemon=True) if self.enabled else None
        if thread is not None:
            thread.start()
        try:
            yield
        finally:
            done.set()
            if thread is not None:
                thread.join(every_s)

    def stopping(self, status: str | None = None) -> None:
        self.notify(STOPPING=1, **({"STATUS": status} if status else {}))

    def watchdog(self, now_s: float | None = None) -> bool:
        """Ping the watchdog if half its period passed since the last ping. True if sent."""
        if self.watchdog_interval_s is None:
            return False
        now = time.monotonic() if now_s is None else now_s
        if now < self._next_ping_s:
            return False
        self._next_ping_s = now + self.watchdog_interval_s
        return self.notify(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` for ``SO_SNDTIMEO``."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _one_line(value: object) -> str:
    text = " ".join(str(value).split())
    return text[:_STATUS_MAX]


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half of ``$WATCHDOG_USEC`` in seconds, when the watchdog is meant for this process."""
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2e6
