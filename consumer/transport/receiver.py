"""The consumer's ROUTER socket and control plane, run by one dedicated thread.

Why a thread with a plain ``poll`` loop and not asyncio: the ROUTER carries both the bulk data
(BATCH payloads received with ``recv_into`` straight into aligned ring slots) and the control
messages (HELLO, LEASE, HB, ERR); a ZeroMQ socket must have one owner, and pyzmq's asyncio FD is
edge-triggered (notes/zmq-systemd.md 3.5 #6). One thread owning the socket keeps the hot path at
one copy out of libzmq and keeps all lease state single-threaded.
Invariants: only leased ids are accepted; every ROUTER send is non-blocking and survives a vanished
peer (E5); a payload is written only into the slot its lease reserved, after the header and the
frame sizes were checked. Shared-memory path (``shm`` given, producer offered ``CAP_SHM``): the
lease names the slot's file and generation, the producer builds in it and sends the header alone;
it is accepted only from the lease's own producer naming that slot and generation. Fencing: a
LEASED shm slot cancelled without an accepted batch (peer lost, deadline, revoke, requeue) is
retired here -- its file unlinked, a new generation mapped -- so a zombie writes only into orphaned
memory and its late BATCH is refused (UNKNOWN_PEER or LEASE). Bad input (DESIGN invariant 7): every message not taken is counted once,
as a reject (code and routing id; answered by exactly one ERR), a duplicate, or -- from a peer
blocked for flooding -- FLOOD (dropped unread, unanswered); headers are decoded under the bound of
a producer header, so no message costs the loop more than a few ms.
Shutdown: ``stop()`` sets an event, wakes the loop, joins with a timeout; the thread closes the
socket (linger 0) in ``finally``.
"""

from __future__ import annotations

import logging
import os
import reprlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from consumer.flow.credit import ActiveLease, LeaseBook, Verdict, grant_round
from consumer.transport.intake import check_header, check_in_place, fill_from_frames
from consumer.flow.peers import PeerTable, ProducerReport
from consumer.flow.rejects import RejectLog, peer_label
from consumer.flow.ring import BatchRing
from consumer.transport.shm_slots import ShmSlots
from shared.wire.buckets import BucketSet
from shared.wire.curve import ZAP_ENDPOINT, ServerKeys, producer_id_matches, zap_reply
from shared.wire.layout import PAYLOAD_COPIES
from shared.errors import ProtocolError
from shared.wire.protocol import (CAP_SHM, SUPPORTED_VERSIONS, BatchHeader, Bye, Err, Heartbeat, Hello,
                             LeaseGrant, Lease, Message, RejectCode, ShmSlot, Welcome, decode_header, encode,
                             max_producer_header_bytes)

__all__ = ["Receiver", "ReceiverStats", "HandshakeContract"]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0      # > one poll interval plus one 8 MB receive
_MAX_MSGS_PER_WAKE = 64    # bound one burst so heartbeats and grants still run
_BLOCK_S = 30.0            # a flooding peer is ignored this long


@dataclass(frozen=True, slots=True)
class HandshakeContract:
    """What a producer's HELLO must match."""

    fingerprint: str
    buckets: list[list[int]]
    n_mels: int
    seed: int


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    batches_received: int
    bytes_received: int          # batch bytes delivered into the ring (payload frames or built in place)
    duplicates_dropped: int
    stale_dropped: int
    leases_outstanding: int
    leases_reissued: int
    producers_alive: int
    producers_seen: int
    rejects: dict[str, int]      # by reject code; FLOOD = messages of a blocked peer, dropped unread
    quarantined: int
    # Rejected + ignored messages by routing id (``peer_label``), for the 256 most recently rejected peers.
    rejects_by_peer: dict[str, int] = field(default_factory=dict)
    shm_retired: int = 0         # shm slot files orphaned because their lease was cancelled (fencing)
    lease_window: int = 0                                   # leases one producer may hold
    producers: tuple[ProducerReport, ...] = ()              # connected producers and their stage counters


class Receiver:
    """Owns the ROUTER socket; grants leases into free ring slots and fills them.

    Args:
        endpoint: where to bind (``ipc://...`` or ``tcp://...``).
        ring, book: shared with the step loop (ring) or owned here (book); a lease carries its planned batch.
        contract: what HELLO must carry.
        epoch: this consumer start's epoch (random, non-zero).
        clock: monotonic seconds (injectable for tests).
        shm: the ring's slot files when the shared-memory path is on (the ring's memory), else ``None``.
    """

    def __init__(self, endpoint: str, ring: BatchRing, book: LeaseBook, bucket_set: BucketSet, contract: HandshakeContract, epoch: int, *,
                 heartbeat_interval_s: float, liveness_s: float, checksum: bool,
                 clock: Callable[[], float] = time.monotonic, curve: ServerKeys | None = None,
                 shm: ShmSlots | None = None) -> None:
        self.endpoint = endpoint
        self._ring, self._book = ring, book
        self._buckets = bucket_set
        self._max_header_bytes = max_producer_header_bytes(max(b.batch_size for b in bucket_set.buckets))
        self._contract = contract
        self.epoch = epoch
        self._hb_s = heartbeat_interval_s
        self._liveness_s = liveness_s
        self._checksum = checksum
        self._clock = clock
        self._peers = PeerTable()
        self._rejects = RejectLog()
        self._stop = threading.Event()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._applied_through = -1            # written by the step thread, read here
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._counts = {"batches": 0, "bytes": 0, "dup": 0, "stale": 0, "reissued": 0, "quarantined": 0}
        self.error: BaseException | None = None
        self._curve = curve                  # CURVE server keys + allow-list; None = plaintext (ipc/loopback)
        self._zap: zmq.Socket[bytes] | None = None
        self._user_id: str | None = None     # CURVE name (ZAP User-Id) of the message being dispatched
        self._auth_denied = 0
        self._auth_log_s = 0.0
        self._shm = shm
        self._shm_leased: dict[int, int] = {}   # LEASED shm slot -> generation named in its lease

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Bind (errors surface here, in the caller's thread) and start the loop. Idempotent."""
        if self._thread is not None:
            return
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A producer keeps its routing id when its DEALER reconnects (network cut, MAXMSGSIZE drop).
        # Without handover the ROUTER silently ignores the new connection for as long as it still
        # holds the old one (a cut sends no FIN): that producer is deaf for good (test_bad_input B14).
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self._buckets.max_batch_nbytes() + (1 << 20))
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.SNDHWM, 1000)
        try:
            if self._curve is not None:
                # ZAP handler first: libzmq asks it about every CURVE handshake; this thread answers.
                self._zap = self._ctx.socket(zmq.REP)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(ZAP_ENDPOINT)
                self._curve.apply(sock)
            sock.bind(self.endpoint)
        except zmq.ZMQError:
            sock.close()
            if self._zap is not None:
                self._zap.close()
            self._ctx.term()
            raise
        self._sock = sock
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
            self._sock.close(0)
        if self._ctx is not None and (self._thread is None or not self._thread.is_alive()):
            self._ctx.term()
            self._ctx = None
        if self._wake_fd >= 0 and (self._thread is None or not self._thread.is_alive()):
            os.close(self._wake_fd)
            self._wake_fd = -1

    def wake(self) -> None:
        """Make the loop run now (a slot was freed or a batch applied). Any thread may call it."""
        if self._wake_fd >= 0:
            try:
                os.eventfd_write(self._wake_fd, 1)
            except OSError:
                pass

    def mark_applied(self, batch_id: int) -> None:
        """Called by the step loop after ``batch_id`` was applied (ids arrive in order)."""
        self._applied_through = batch_id
        self.wake()

    @property
    def context(self) -> zmq.Context[zmq.Socket[bytes]] | None:
        """This process's ZeroMQ context (from ``start()`` until ``stop()``), for other sockets of the consumer."""
        return self._ctx

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> ReceiverStats:
        c = self._counts
        return ReceiverStats(c["batches"], c["bytes"], c["dup"], c["stale"], self._book.outstanding,
                             c["reissued"], len(self._peers), self._peers.seen, self._rejects.snapshot(),
                             c["quarantined"], self._rejects.peer_snapshot(),
                             shm_retired=self._shm.retired if self._shm is not None else 0,
                             lease_window=self._book.window, producers=self._peers.reports())

    # --- loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._sock is not None  # set by start()
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_fd, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        next_hb_s = self._clock()
        applied_seen = -1
        try:
            while not self._stop.is_set():
                timeout_ms = max(0, int((next_hb_s - self._clock()) * 1000)) + 1
                events = dict(poller.poll(timeout_ms))
                if self._wake_fd in events:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
                if self._zap is not None and self._zap in events:
                    self._answer_zap()
                if sock in events:
                    for _ in range(_MAX_MSGS_PER_WAKE):
                        if not self._recv_one(sock):
                            break
                now = self._clock()
                applied = self._applied_through
                while applied_seen < applied:
                    applied_seen += 1
                    self._book.mark_applied(applied_seen)
                self._check_liveness(now)
                if now >= next_hb_s:
                    self._send_heartbeats()
                    next_hb_s = now + self._hb_s
                self._grant(now)
        except BaseException as err:  # the step loop re-raises it; never die silently
            self.error = err
            log.error("receiver loop failed", exc_info=True)
            self._ring.close()
        finally:
            sock.close(0)
            if self._zap is not None:
                self._zap.close(0)

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
            if now >= self._auth_log_s:        # rate-limited: a scanner must not flood the log
                log.warning("CURVE handshake refused (%s) from %s; %d refused so far", reply[3].decode(errors="replace"),
                            request[3].decode(errors="replace") if len(request) > 3 else "?", self._auth_denied)
                self._auth_log_s = now + 5.0
        self._zap.send_multipart(reply)

    def _recv_one(self, sock: zmq.Socket[bytes]) -> bool:
        try:
            ident = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if self._curve is not None and sock.getsockopt(zmq.RCVMORE):
            frame = sock.recv(copy=False)
            header, self._user_id = frame.bytes, frame.get("User-Id")
        else:
            header = sock.recv() if sock.getsockopt(zmq.RCVMORE) else b""
        now = self._clock()
        if self._peers.is_blocked(ident, now):
            self._drain(sock)
            self._rejects.ignore(peer_label(ident))
            return True
        try:
            msg = decode_header(header, self._max_header_bytes)
            self._dispatch(sock, ident, msg, now)
        except ProtocolError as err:
            self._drain(sock)
            self._reject(ident, err.code, err.why, now)
        return True

    def _dispatch(self, sock: zmq.Socket[bytes], ident: bytes, msg: Message, now: float) -> None:
        if isinstance(msg, BatchHeader):
            self._on_batch(sock, ident, msg, now)
            return
        if sock.getsockopt(zmq.RCVMORE):
            raise ProtocolError(RejectCode.FRAMES, f"{type(msg).__name__} must be a single frame")
        if isinstance(msg, Hello):
            self._on_hello(ident, msg, now)
        elif isinstance(msg, Heartbeat | Bye):
            peer = self._known(ident, msg.epoch)
            if isinstance(msg, Bye):
                self._drop_peer(ident, "said goodbye")
            else:
                peer.last_seen_s = now
                if msg.stats is not None:
                    peer.stage, peer.stage_at_s = msg.stats, now
        else:
            raise ProtocolError(RejectCode.TYPE, f"{type(msg).__name__} is not sent to the consumer")

    def _on_hello(self, ident: bytes, msg: Hello, now: float) -> None:
        if msg.proto not in SUPPORTED_VERSIONS:
            raise ProtocolError(RejectCode.PROTO, f"protocol {msg.proto} not supported; supported: "
                                                  f"{list(SUPPORTED_VERSIONS)}")
        if self._user_id is not None and not producer_id_matches(msg.producer_id, self._user_id):
            raise ProtocolError(RejectCode.CONTRACT, f"producer id {_short(msg.producer_id)} does not match its "
                                                     f"CURVE key {self._user_id!r} (ids must be {self._user_id}-<n>)")
        c = self._contract
        for name, theirs, ours in (("manifest fingerprint", msg.fingerprint, c.fingerprint),
                                   ("n_mels", msg.n_mels, c.n_mels), ("seed", msg.seed, c.seed),
                                   ("bucket shapes", msg.buckets, c.buckets)):
            if theirs != ours:   # reprlib: a peer's 1 MB list must not cost a full repr (why <= 200)
                raise ProtocolError(RejectCode.CONTRACT, f"{name} differs: producer {_short(theirs)}, "
                                                         f"consumer {_short(ours)}")
        if ident in self._peers:
            self._drop_peer(ident, "re-handshake")
        info = self._peers.add(ident, msg.producer_id, now)
        info.uses_shm = self._shm is not None and CAP_SHM in msg.caps
        log.info("producer joined id=%s peer=%s alive=%d transport=%s", msg.producer_id, peer_label(ident),
                 len(self._peers), "shm" if info.uses_shm else "zmq")
        shm_dir = str(self._shm.directory) if info.uses_shm and self._shm is not None else None
        self._send(ident, Welcome(self.epoch, self._book.window, self._hb_s, self._checksum, shm_dir))

    def _known(self, ident: bytes, epoch: int):  # type: ignore[no-untyped-def]
        peer = self._peers.get(ident)
        if peer is None or epoch != self.epoch:
            if epoch != self.epoch:
                self._counts["stale"] += 1
            raise ProtocolError(RejectCode.UNKNOWN_PEER, "unknown peer or old consumer epoch; send HELLO")
        return peer

    def _on_batch(self, sock: zmq.Socket[bytes], ident: bytes, hdr: BatchHeader, now: float) -> None:
        peer = self._known(ident, hdr.epoch)
        peer.last_seen_s = now
        self._check_shm_claim(ident, hdr)
        verdict, lease = self._book.accept(ident, hdr.batch_id)
        if verdict == Verdict.DUP:
            self._drain(sock)
            self._counts["dup"] += 1
            return
        if verdict == Verdict.NOT_LEASED or lease is None:
            raise ProtocolError(RejectCode.LEASE, f"batch {hdr.batch_id} is not leased to this producer")
        in_place = lease.slot in self._shm_leased
        try:
            expected = check_header(hdr, lease.planned.bucket, self._buckets)
            views = self._ring.views(lease.slot, expected.index)
            if in_place:        # built in the slot by the producer: the same bytes arrived, without a frame
                check_in_place(sock, views, hdr, expected, self._checksum)
                self._counts["bytes"] += sum(int(v.nbytes) for v in views.values())
            else:
                self._counts["bytes"] += fill_from_frames(sock, views, hdr, expected, self._checksum)
        except ProtocolError:
            self._book.requeue(lease)      # the lease stays open: rebuild it, never drop it
            self._cancel(lease)
            self._counts["reissued"] += 1
            raise
        self._shm_leased.pop(lease.slot, None)
        self._ring.mark_ready(lease.slot, lease.planned, 1 if in_place else PAYLOAD_COPIES)
        peer.batches += 1
        self._counts["batches"] += 1
        self._counts["quarantined"] += len(hdr.quarantined)

    def _check_shm_claim(self, ident: bytes, hdr: BatchHeader) -> None:
        """An shm lease takes a batch only from its own producer, naming its slot and generation.

        Checked before ``accept``: another producer's late copy (payload or header-only) must never
        be written into or read from a slot file the lease holder may be writing right now.
        """
        active = self._book.active(hdr.batch_id)
        if active is None:
            return                          # DUP or NOT_LEASED, decided by accept; no slot is touched
        gen = self._shm_leased.get(active.slot)
        if gen is None and hdr.shm is None:
            return                          # payload lease, payload header
        if gen is None or active.peer != ident or (hdr.shm is not None and hdr.shm != (active.slot, gen)):
            raise ProtocolError(RejectCode.LEASE, f"batch {hdr.batch_id}: slot/generation {hdr.shm} is not "
                                                  f"this producer's lease")

    # --- leases, liveness, heartbeats ------------------------------------------------------------
    def _grant(self, now: float) -> None:
        grants: dict[bytes, list[Lease]] = {}
        order = self._peers.by_fewest_leases(self._book)
        for lease in grant_round(self._book, order, self._ring.reserve, self._ring.cancel, now):
            self._peers.get(lease.peer).last_grant_s = now  # type: ignore[union-attr]  # ties go round-robin
            planned = lease.planned
            grants.setdefault(lease.peer, []).append(
                Lease(lease.batch_id, planned.bucket, list(planned.sample_ids), self._book.lease_timeout_s,
                      self._shm_slot_for(lease)))
        depth = self.queue_depth()
        for ident, leases in grants.items():
            self._send(ident, LeaseGrant(self.epoch, leases, depth))

    def _shm_slot_for(self, lease: ActiveLease) -> ShmSlot | None:
        """The slot file a new lease names, or ``None`` for a payload lease."""
        info = self._peers.get(lease.peer)
        if self._shm is None or info is None or not info.uses_shm or not self._shm.is_shared(lease.slot):
            return None
        gen = self._shm.generation(lease.slot)
        self._shm_leased[lease.slot] = gen
        return ShmSlot(self._shm.name(lease.slot), lease.slot, gen)

    def _cancel(self, lease: ActiveLease) -> None:
        """Give a lease's slot back unfilled; an shm slot is retired first (a zombie may write into it)."""
        if self._shm_leased.pop(lease.slot, None) is not None and self._shm is not None:
            self._shm.retire(lease.slot)
            log.debug("retired shm slot %d (batch %d not delivered); generation %d", lease.slot,
                      lease.batch_id, self._shm.generation(lease.slot))
        self._ring.cancel(lease.slot)

    def queue_depth(self) -> int:
        """Ready batches plus leases outstanding (what is sent back to producers)."""
        return len(self._ring.ready_ids()) + self._book.outstanding

    def _check_liveness(self, now: float) -> None:
        for ident in self._peers.silent_since(now - self._liveness_s):
            self._drop_peer(ident, f"silent for more than {self._liveness_s:.1f} s")
        for lease in self._book.expire(now):
            self._cancel(lease)
            self._counts["reissued"] += 1
            log.warning("lease expired batch=%d peer=%s; reissuing", lease.batch_id,
                        lease.peer.decode(errors="replace"))

    def _drop_peer(self, ident: bytes, why: str) -> None:
        for lease in self._book.revoke_peer(ident):
            self._cancel(lease)
            self._counts["reissued"] += 1
        info = self._peers.remove(ident)
        if info is not None:
            level = logging.INFO if why in ("said goodbye", "re-handshake") else logging.WARNING
            log.log(level, "producer left id=%s reason=%s alive=%d", info.producer_id, why, len(self._peers))

    def _send_heartbeats(self) -> None:
        hb = Heartbeat(self.epoch, self.queue_depth(), self._applied_through + 1)
        for ident in list(self._peers.idents()):
            self._send(ident, hb)

    def _send(self, ident: bytes, msg: Message) -> None:
        """Non-blocking ROUTER send that survives a vanished peer (E5)."""
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as err:
            log.debug("send to %r failed: %s", ident, err)
            if ident in self._peers and err.errno == zmq.EHOSTUNREACH:
                self._drop_peer(ident, "unreachable")

    def _reject(self, ident: bytes, code: str, why: str, now: float) -> None:
        # Counted and flood-checked by routing id: a producer id is chosen by the peer, so a
        # flooder claiming a good producer's id must not get that producer blocked.
        name = peer_label(ident)
        if self._rejects.record(name, code, why, now):
            log.warning("peer %s floods invalid messages; ignoring it for %.0f s", name, _BLOCK_S)
            self._drop_peer(ident, "flooding")
            self._peers.block(ident, now + _BLOCK_S)
            # The last answer it gets says why the others stop: every reject but an ignored one
            # (counted as FLOOD) is answered exactly once.
            code, why = RejectCode.FLOOD, f"{code}: too many invalid messages; ignored for {_BLOCK_S:.0f} s"
        self._send(ident, Err(code, why))

    @staticmethod
    def _drain(sock: zmq.Socket[bytes]) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)


_REPR = reprlib.Repr()
_REPR.maxlist, _REPR.maxstring, _REPR.maxother, _REPR.maxlevel = 8, 80, 80, 3


def _short(value: object) -> str:
    """A bounded repr of a peer-supplied value, cheap whatever its size."""
    return _REPR.repr(value)
