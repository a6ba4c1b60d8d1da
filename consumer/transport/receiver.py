"""The consumer's ROUTER socket, run by one dedicated thread: the thin shell around the session.

Why a thread with a plain ``poll`` loop and not asyncio: the ROUTER carries both the bulk data
(BATCH payloads received with ``recv_into`` straight into aligned ring slots) and the control
messages (HELLO, LEASE, HB, ERR); a ZeroMQ socket must have one owner, and pyzmq's asyncio FD is
edge-triggered (docs/design.md "Threads"). One thread owning the socket keeps the hot path at
one copy out of libzmq and keeps all lease state single-threaded.
This module holds only what needs the socket: its options, the ZAP handler (CURVE), the poll loop,
decoding headers (under the bound of a producer header, so no message costs the loop more than a few
ms), taking a payload into its ring slot (``consumer/transport/intake.py``) and sending replies. Every
protocol decision -- handshake, leases, liveness, shared-memory fencing, duplicates, rejects, floods,
BYE -- is made by ``melfeed.consumer.flow.session.ReceiverSession``, which is socket-free and unit-tested.
Invariants: every ROUTER send is non-blocking and survives a vanished peer (E5); a payload is
written only into the slot its lease reserved, after the header and the frame sizes were checked;
every message the session does not take has the rest of its frames drained unread.
Shutdown: ``stop()`` sets an event, wakes the loop, joins with a timeout; the thread closes the
socket in ``finally`` (linger 0, or ``_END_LINGER_MS`` after a finished plan's last ``done`` heartbeats).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq

from melfeed.consumer.flow.credit import LeaseBook
from melfeed.consumer.flow.decisions import (
    BatchIntake,
    HandshakeContract,
    Outgoing,
    ReceiverSessionConfig,
    ReceiverStats,
)
from melfeed.consumer.flow.ring import BatchRing
from melfeed.consumer.flow.session import ReceiverSession
from melfeed.consumer.transport.conn_guard import ConnectionGuard
from melfeed.consumer.transport.endpoint_lock import EndpointLock, lock_endpoint, remove_stale_endpoints
from melfeed.consumer.transport.intake import check_header, check_in_place, fill_from_frames
from melfeed.consumer.transport.shm_slots import ShmSlots
from melfeed.shared.errors import ConfigError, ProtocolError
from melfeed.shared.printable import escape_line
from melfeed.shared.wire.buckets import BucketSet
from melfeed.shared.wire.curve import ZAP_ENDPOINT, ServerKeys, zap_reply
from melfeed.shared.wire.protocol import BatchHeader, decode_header, encode, max_producer_header_bytes

__all__ = ["Receiver", "ReceiverConfig", "ReceiverStats", "HandshakeContract"]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0  # > one poll interval plus one 8 MB receive
_MAX_MSGS_PER_WAKE = 64  # bound one burst so heartbeats and grants still run
_AUTH_LOG_INTERVAL_S = 5.0  # a scanner must not flood the log with refused CURVE handshakes
_END_LINGER_MS = 200  # the last ``done`` heartbeats (~50 bytes a peer) leave ipc/loopback far sooner


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    """Where the receiver binds and the protocol settings its session runs with."""

    endpoint: str  # ``ipc://...`` or ``tcp://...``
    session: ReceiverSessionConfig
    curve: ServerKeys | None = None  # CURVE server keys + allow-list; None = plaintext (ipc/loopback)
    max_connections: int = 64  # open connections beyond this are cut (``conn_guard``)
    handshake_timeout_s: float = 10.0  # ZMQ_HANDSHAKE_IVL: a connection not through its handshake is dropped


class Receiver:
    """Owns the ROUTER socket; feeds its messages to a ``ReceiverSession`` and sends the replies.

    Args:
        cfg: endpoint, protocol settings, CURVE keys.
        ring, book: shared with the step loop (ring) or owned here (book); a lease carries its planned batch.
        bucket_set: the buckets (header bound, payload checks, largest message).
        shm: the ring's slot files when the shared-memory path is on (the ring's memory), else ``None``.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        cfg: ReceiverConfig,
        ring: BatchRing,
        book: LeaseBook,
        bucket_set: BucketSet,
        *,
        shm: ShmSlots | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = cfg.endpoint
        self.run_id = cfg.session.run_id
        self._ring = ring
        self._buckets = bucket_set
        self._max_header_bytes = max_producer_header_bytes(max(b.batch_size for b in bucket_set.buckets))
        self._checksum = cfg.session.checksum
        self._clock = clock
        self._session = ReceiverSession(cfg.session, ring, book, shm=shm)
        self._stop = threading.Event()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Held across each write and the close: a step thread's wake() whose write was still in flight when
        # stop() closed the fd would otherwise write 8 bytes into whatever file took that fd number next.
        self._wake_fd_lock = threading.Lock()
        # Set by the loop: its last grant ran out of free slots, so a freed slot must wake it. Read by
        # the step thread in ``slot_freed``; raised before the loop's second look at the ring (see _grant).
        self._slot_wake = False
        self._applied_through = -1  # written by the step thread, read here
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._curve = cfg.curve
        self._zap: zmq.Socket[bytes] | None = None
        self._auth_denied = 0
        self._auth_log_s = 0.0
        self._endpoint_lock: EndpointLock | None = None
        self._max_connections = cfg.max_connections
        self._handshake_ivl_ms = max(1, round(cfg.handshake_timeout_s * 1000))
        self._guard: ConnectionGuard | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Bind (errors surface here, in the caller's thread) and start the loop. Idempotent."""
        if self._thread is not None:
            return
        # Before the bind: libzmq's ipc bind unlinks a live consumer's socket (one consumer per endpoint).
        # Sockets of dead consumers beside it go first (their locks are free: endpoint_lock.py).
        if self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@"):
            remove_stale_endpoints(Path(self.endpoint.removeprefix("ipc://")).parent)
        self._endpoint_lock = lock_endpoint(self.endpoint)
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # No handover: a connection announcing a routing id the ROUTER already holds is ignored, so
        # a peer can never displace a live peer by claiming its id (docs/security.md "Identity").
        # Producers announce no id: the ROUTER assigns a fresh one to every connection, so a producer
        # whose DEALER reconnects after a cut is a new peer (UNKNOWN_PEER -> HELLO), never a duplicate.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._buckets.max_batch_nbytes() + (1 << 20))
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.HANDSHAKE_IVL, self._handshake_ivl_ms)  # idle connections do not stay (conn_guard)
        try:
            if self._curve is not None:
                # ZAP handler first: libzmq asks it about every CURVE handshake; this thread answers.
                self._zap = self._ctx.socket(zmq.REP)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(ZAP_ENDPOINT)
                self._curve.apply(sock)
            sock.bind(self.endpoint)
        except zmq.ZMQError as err:  # port in use, no such directory, address not ours: the operator's to fix
            sock.close()
            if self._zap is not None:
                self._zap.close()
            self._ctx.term()
            self._release_lock()
            raise ConfigError(f"cannot bind {self.endpoint}: {err.strerror}", path=("transport", "endpoint")) from err
        self._sock = sock
        self._guard = ConnectionGuard(sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), self._max_connections)
        self._thread = threading.Thread(target=self._run, name="receiver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and close the socket. Idempotent; bounded by ``_JOIN_TIMEOUT_S``."""
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.error("receiver thread did not stop within %.1f s", _JOIN_TIMEOUT_S)
        elif self._sock is not None:
            if self._guard is not None:
                self._guard.close()
            self._sock.close(0)
        if self._ctx is not None and (self._thread is None or not self._thread.is_alive()):
            self._ctx.term()
            self._ctx = None
        if self._wake_fd >= 0 and (self._thread is None or not self._thread.is_alive()):
            with self._wake_fd_lock:
                os.close(self._wake_fd)
                self._wake_fd = -1
            self._release_lock(remove_files=self._sock is not None)  # the socket is closed: leave no file

    def _release_lock(self, *, remove_files: bool = False) -> None:
        if self._endpoint_lock is not None:
            self._endpoint_lock.release(remove_files=remove_files)
            self._endpoint_lock = None

    def wake(self) -> None:
        """Make the loop run now (a slot was freed or a batch applied). Any thread may call it."""
        with self._wake_fd_lock:  # never a write to an fd number stop() has given back
            if self._wake_fd >= 0:
                try:
                    os.eventfd_write(self._wake_fd, 1)  # non-blocking: the lock is held for one syscall
                except OSError:
                    pass

    def mark_applied(self, batch_id: int, wake: bool = True) -> None:
        """Called by the step loop after ``batch_id`` was applied (ids arrive in order).

        ``wake=False`` when a slot release follows at once (it wakes the loop if a lease waits for a
        slot); the loop reads the applied id at its next pass either way.
        """
        self._applied_through = batch_id
        if wake:
            self.wake()

    def slot_freed(self) -> None:
        """A ring slot became free (any thread): wake the loop only if its last grant ran short of slots.

        Otherwise every producer's window is full and the next BATCH wakes the loop, which then
        leases the slot: one wake and one pass of the loop per batch instead of two.
        """
        if self._slot_wake:
            self.wake()

    @property
    def context(self) -> zmq.Context[zmq.Socket[bytes]] | None:
        """This process's ZeroMQ context (from ``start()`` until ``stop()``), for other sockets of the consumer."""
        return self._ctx

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> ReceiverStats:
        return self._session.stats()

    @property
    def connections_cut(self) -> int:
        """Connections cut because ``transport.max_connections`` were open (``conn_guard``)."""
        return self._guard.count.refused if self._guard is not None else 0

    def queue_depth(self) -> int:
        """Ready batches plus leases outstanding (what is sent back to producers)."""
        return self._session.queue_depth()

    # --- loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._sock is not None  # set by start()
        sock, session = self._sock, self._session
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_fd, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        guard = self._guard
        if guard is not None and guard.monitor is not None:
            poller.register(guard.monitor, zmq.POLLIN)
        linger_ms = 0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(session.poll_timeout_ms(self._clock())))
                if self._wake_fd in events:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
                if self._zap is not None and self._zap in events:
                    self._answer_zap()
                if guard is not None and guard.monitor in events:
                    guard.drain()
                if sock in events:
                    for _ in range(_MAX_MSGS_PER_WAKE):
                        if not self._recv_one(sock):
                            break
                now = self._clock()
                self._send_all(session.tick(now, self._applied_through))
                self._grant(now)
            linger_ms = self._send_closing()
        except BaseException as err:  # the step loop re-raises it; never die silently
            self.error = err
            log.error("receiver loop failed", exc_info=True)
            self._ring.close()
        finally:
            if guard is not None:
                guard.close()
            sock.close(linger_ms)
            if self._zap is not None:
                self._zap.close(0)

    def _grant(self, now: float) -> None:
        """Lease free slots; if that ran out of slots, ask for a wake on the next release, then look once more.

        The flag goes up before the second look, so a slot freed after the first look is either
        leased by the second or wakes the loop (its releaser sees the flag up): never missed.
        """
        session = self._session
        self._send_all(session.grant(now))
        if session.slot_starved:
            self._slot_wake = True
            self._send_all(session.grant(now))
        self._slot_wake = session.slot_starved

    def _send_closing(self) -> int:
        """A finished plan's last ``done`` heartbeats. Returns the linger (ms) that lets them leave."""
        sends = self._session.closing(self._clock(), self._applied_through)
        self._send_all(sends)
        return _END_LINGER_MS if sends else 0

    def _answer_zap(self) -> None:
        """One ZAP request per wake is enough: handshakes are rare and the REP socket queues."""
        assert self._zap is not None and self._curve is not None
        try:
            request = self._zap.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        reply = zap_reply(request, self._curve.allowed)
        if reply[2] != b"200":
            self._auth_denied += 1
            now = self._clock()
            if now >= self._auth_log_s:  # rate-limited: a scanner must not flood the log
                address = request[3].decode(errors="replace") if len(request) > 3 else "?"
                log.warning(
                    "CURVE handshake refused (%s) from %s; %d refused so far",
                    reply[3].decode(errors="replace"),
                    escape_line(address),
                    self._auth_denied,
                )
                self._auth_log_s = now + _AUTH_LOG_INTERVAL_S
        self._zap.send_multipart(reply)

    def _recv_one(self, sock: zmq.Socket[bytes]) -> bool:
        """Take one message off the socket and act on the session's decision. False: none queued."""
        try:
            ident = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        user_id: str | None = None
        if self._curve is not None and sock.getsockopt(zmq.RCVMORE):
            frame = sock.recv(copy=False)
            header, user_id = frame.bytes, str(frame.get("User-Id"))
        else:
            header = sock.recv() if sock.getsockopt(zmq.RCVMORE) else b""
        session = self._session
        now = self._clock()
        if not session.admit(ident, now):
            self._drain(sock)
            return True
        try:
            msg = decode_header(header, self._max_header_bytes)
        except ProtocolError as err:
            decision = session.on_invalid(ident, err, now)
        else:
            decision = session.on_message(ident, msg, now, more=bool(sock.getsockopt(zmq.RCVMORE)), user_id=user_id)
        if decision.intake is not None:
            try:
                session.on_batch_taken(decision.intake, self._take_payload(sock, decision.intake))
            except ProtocolError as err:
                decision = session.on_batch_refused(decision.intake, err, now)
        if decision.drain:
            self._drain(sock)
        self._send_all(decision.sends)
        return True

    def _take_payload(self, sock: zmq.Socket[bytes], intake: BatchIntake) -> int:
        """Check the BATCH against its planned bucket and take its payload into the lease's slot.

        Returns:
            The batch bytes now in the slot (received frames, or the views the producer built).
        """
        hdr: BatchHeader = intake.hdr
        expected = check_header(hdr, intake.planned_bucket, self._buckets)
        views = self._ring.views(intake.lease.slot, expected.index)
        if intake.in_place:  # built in the slot by the producer: the same bytes arrived, without a frame
            check_in_place(sock, views, hdr, expected, self._checksum)
            return sum(int(v.nbytes) for v in views.values())
        return fill_from_frames(sock, views, hdr, expected, self._checksum)

    def _send_all(self, sends: Sequence[Outgoing]) -> None:
        for out in sends:
            self._send(out)

    def _send(self, out: Outgoing) -> None:
        """Non-blocking ROUTER send that survives a vanished peer (E5)."""
        assert self._sock is not None
        try:
            self._sock.send_multipart([out.ident, encode(out.msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as err:
            log.debug("send to %r failed: %s", out.ident, err)
            if err.errno == zmq.EHOSTUNREACH:
                self._session.on_unreachable(out.ident)

    @staticmethod
    def _drain(sock: zmq.Socket[bytes]) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)
