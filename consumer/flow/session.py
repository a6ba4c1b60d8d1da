"""The consumer's side of the wire protocol as a pure object: messages in, decisions and replies out.

The receiver thread (``consumer/transport/receiver.py``) owns the ROUTER socket; it decodes each
message and hands it here with the time, and sends what comes back. Nothing here touches a socket,
a thread or a clock (trio's and httpx's transport seam), so every rule is unit-tested with fake
messages and a fake clock. The session owns: the handshake (HELLO: protocol version, contract, the
CURVE user-id binding; a bucket row count of ``LEARN_ROWS`` is the one field not compared, and is answered
with the consumer's rows in the WELCOME; a HELLO with no buckets at all is answered with the consumer's shapes and
the cost weights that planned them, every other field compared as ever) and WELCOME (a HELLO repeating a peer's
join nonce is answered again and keeps its leases; any other HELLO from a joined peer is a re-handshake that returns
them); lease grants into free ring slots; liveness and lease deadlines (leases back to pending); the shared-memory
fencing (``melfeed.consumer.flow.shm_leases``); duplicate and stale-epoch drops; reject counting and flood blocking;
BYE (with a failed producer's exit code); the end of a finite plan (every heartbeat after it says ``done``,
and ``closing`` gives a last one to send).
A BATCH is taken in two steps because its payload is received straight into a ring slot:
``on_message`` returns a ``BatchIntake`` (the lease and its slot), the shell fills or checks the slot,
then calls ``on_batch_taken`` or ``on_batch_refused``.
Invariants (docs/design.md, invariants 2, 3 and 7): only leased ids are accepted; every
message not taken is counted once -- as a reject (answered by exactly one ERR), a duplicate, or,
from a peer blocked for flooding, FLOOD (dropped unread, unanswered).
Threads: one writer (the receiver thread); ``stats()`` and ``queue_depth()`` may be read from any
thread (plain counters, copied). Shutdown: nothing to release; the shell closes the socket.
"""

from __future__ import annotations

import logging
import reprlib

from melfeed.consumer.flow.credit import ActiveLease, Arrival, LeaseBook, grant_round
from melfeed.consumer.flow.decisions import (
    BatchIntake,
    Decision,
    HandshakeContract,
    Outgoing,
    ReceiverSessionConfig,
    ReceiverStats,
)
from melfeed.consumer.flow.peers import PeerInfo, PeerTable
from melfeed.consumer.flow.rejects import RejectLog, peer_label
from melfeed.consumer.flow.ring import BatchRing
from melfeed.consumer.flow.shm_leases import ShmLeases, SlotFiles
from melfeed.shared.errors import MAX_REASON_CHARS, ProtocolError
from melfeed.shared.printable import escape_line
from melfeed.shared.wire.curve import producer_id_matches
from melfeed.shared.wire.layout import PAYLOAD_COPIES
from melfeed.shared.wire.protocol import (
    CAP_SHM,
    LEARN_ROWS,
    SUPPORTED_VERSIONS,
    BatchHeader,
    Bye,
    Err,
    Heartbeat,
    Hello,
    Lease,
    LeaseGrant,
    Message,
    RejectCode,
    Welcome,
)

__all__ = [
    "BatchIntake",
    "Decision",
    "HandshakeContract",
    "Outgoing",
    "ReceiverSession",
    "ReceiverStats",
    "ReceiverSessionConfig",
    "escape_line",
]

log = logging.getLogger(__name__)

BLOCK_S = 30.0  # a flooding peer is ignored this long


class ReceiverSession:
    """Handshake, leases, liveness, fencing and rejects for one consumer epoch.

    Args:
        cfg: contract, run id and timing.
        ring, book: the ring (shared with the step loop) and the lease book (each lease carries its planned batch).
        shm: the ring's slot files when the shared-memory path is on, else ``None``.
        rejects: reject counters and flood detection (injectable for tests).
    """

    def __init__(
        self,
        cfg: ReceiverSessionConfig,
        ring: BatchRing,
        book: LeaseBook,
        *,
        shm: SlotFiles | None = None,
        rejects: RejectLog | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_id = cfg.run_id
        self._ring, self._book = ring, book
        self._peers = PeerTable()
        self._rejects = rejects if rejects is not None else RejectLog()
        self._shm = ShmLeases(shm)
        self._counts = {
            "batches": 0,
            "bytes": 0,
            "dup": 0,
            "stale": 0,
            "reissued": 0,
            "quarantined": 0,
            "failures": 0,
            "hello_repeats": 0,
        }
        self._applied_seen = -1  # the last applied id handed to the lease book
        self.next_heartbeat_s: float | None = None  # None: due at the next tick
        self.plan_ended = False  # every planned batch applied: heartbeats say ``done``
        self.slot_starved = False  # the last grant stopped for want of a free slot

    # --- queries (any thread) -------------------------------------------------------------------
    def stats(self) -> ReceiverStats:
        c = self._counts
        return ReceiverStats(
            c["batches"],
            c["bytes"],
            c["dup"],
            c["stale"],
            self._book.outstanding,
            c["reissued"],
            len(self._peers),
            self._peers.seen,
            self._rejects.snapshot(),
            c["quarantined"],
            self._rejects.peer_snapshot(),
            shm_retired=self._shm.retired,
            lease_window=self._book.window,
            producers=self._peers.reports(),
            producer_failures=c["failures"],
            producers_benched=tuple(escape_line(p) for p in self._peers.benched()),
            hello_repeats=c["hello_repeats"],
        )

    def queue_depth(self) -> int:
        """Ready batches plus leases outstanding (what is sent back to producers)."""
        return len(self._ring.ready_ids()) + self._book.outstanding

    def poll_timeout_ms(self, now_s: float) -> int:
        """How long the shell may wait for a message before the next heartbeat is due."""
        if self.next_heartbeat_s is None:
            return 1
        return max(0, int((self.next_heartbeat_s - now_s) * 1000)) + 1

    # --- inbound ------------------------------------------------------------------------------
    def admit(self, ident: bytes, now_s: float) -> bool:
        """False for a peer blocked for flooding: drop its message unread (counted as FLOOD)."""
        if self._peers.is_blocked(ident, now_s):
            self._rejects.ignore(peer_label(ident))
            return False
        return True

    def on_message(
        self, ident: bytes, msg: Message, now_s: float, *, more: bool = False, user_id: str | None = None
    ) -> Decision:
        """Decide on one decoded message.

        Args:
            more: frames follow the header (only a BATCH on a payload lease may have them).
            user_id: the CURVE name (ZAP User-Id) the message arrived under; ``None`` without CURVE.
        """
        try:
            if isinstance(msg, BatchHeader):
                return self._on_batch(ident, msg, now_s)
            if more:
                raise ProtocolError(RejectCode.FRAMES, f"{type(msg).__name__} must be a single frame")
            if isinstance(msg, Hello):
                return Decision(self._on_hello(ident, msg, now_s, user_id))
            if isinstance(msg, Heartbeat | Bye):
                peer = self._known(ident, msg.epoch)
                if isinstance(msg, Bye):
                    self._on_bye(ident, peer, msg)
                else:
                    peer.last_seen_s = now_s
                    if msg.stats is not None:
                        peer.stage, peer.stage_at_s = msg.stats, now_s
                return Decision()
            raise ProtocolError(RejectCode.TYPE, f"{type(msg).__name__} is not sent to the consumer")
        except ProtocolError as err:
            return self.on_invalid(ident, err, now_s)

    def on_invalid(self, ident: bytes, err: ProtocolError, now_s: float) -> Decision:
        """A message that cannot be taken (undecodable, or refused above): count it and answer ERR."""
        return Decision(self._reject(ident, err.code, err.why, now_s, reply=err.reply), drain=True)

    def on_batch_taken(self, intake: BatchIntake, n_bytes: int) -> None:
        """The shell filled (or checked in place) the lease's slot: the batch is READY."""
        lease, hdr = intake.lease, intake.hdr
        self._counts["bytes"] += n_bytes
        self._shm.settle(lease.slot)
        listed = set(hdr.quarantined)  # only the batch's own rows count, each once (peer-supplied)
        quarantined = tuple(sid for sid in lease.planned.sample_ids if sid in listed) if listed else ()
        note = escape_line(hdr.quarantine_note[:MAX_REASON_CHARS]) if quarantined else ""
        self._ring.mark_ready(lease.slot, lease.planned, 1 if intake.in_place else PAYLOAD_COPIES, quarantined, note)
        peer = self._peers.get(intake.ident)
        if peer is not None:
            peer.batches += 1
            peer.expired_in_row = 0
        self._counts["batches"] += 1
        self._counts["quarantined"] += len(quarantined)

    def on_batch_refused(self, intake: BatchIntake, err: ProtocolError, now_s: float) -> Decision:
        """The payload failed its checks: the lease stays open (rebuild it, never drop it)."""
        self._book.requeue(intake.lease)
        self._cancel(intake.lease)
        self._counts["reissued"] += 1
        return self.on_invalid(intake.ident, err, now_s)

    def on_unreachable(self, ident: bytes) -> None:
        """A send to ``ident`` found no such peer (it vanished): drop it if it was connected."""
        if ident in self._peers:
            self._drop_peer(ident, "unreachable")

    # --- periodic -----------------------------------------------------------------------------
    def tick(self, now_s: float, applied_through: int) -> list[Outgoing]:
        """Forget applied batches, expire silent peers and late leases; heartbeats when due.

        Args:
            applied_through: the last batch id the step loop applied (-1: none yet).
        """
        while self._applied_seen < applied_through:
            self._applied_seen += 1
            self._book.mark_applied(self._applied_seen)
        self._note_plan_end()
        self._check_liveness(now_s)
        if self.next_heartbeat_s is not None and now_s < self.next_heartbeat_s:
            return []
        self.next_heartbeat_s = now_s + self.cfg.heartbeat_interval_s
        hb = Heartbeat(self.run_id, self.queue_depth(), applied_through + 1, done=self.plan_ended)
        return [Outgoing(ident, hb) for ident in self._peers.idents()]

    def closing(self, now_s: float, applied_through: int) -> list[Outgoing]:
        """Before the shell closes the socket: a last ``done`` heartbeat to every peer if the plan is finished."""
        self.next_heartbeat_s = None  # also covers a close before the tick that saw the last batch applied
        sends = self.tick(now_s, applied_through)
        return sends if self.plan_ended else []

    def _note_plan_end(self) -> None:
        if not self.plan_ended and self._book.is_finished:  # the first tick to see it: a heartbeat at once
            self.plan_ended, self.next_heartbeat_s = True, None
            log.info(
                "plan finished (batches through %d applied); telling %d producers", self._applied_seen, len(self._peers)
            )

    def grant(self, now_s: float) -> list[Outgoing]:
        """Lease free ring slots to producers with room in their window, least loaded first.

        Sets ``slot_starved``: a grantable producer still has room and work remains, so only a free
        slot is missing (a freed slot must wake the shell; otherwise the next BATCH will).
        """
        grants: dict[bytes, list[Lease]] = {}
        order = self._peers.grantable(self._book, now_s)
        book = self._book
        leases = grant_round(book, order, self._ring.reserve, self._ring.cancel, now_s)
        self.slot_starved = book.has_work() and any(book.room(peer) > 0 for peer in order)
        for lease in leases:
            info = self._peers.get(lease.peer)
            assert info is not None  # grant_round only leases to peers in ``order``
            info.last_grant_s = now_s  # ties go round-robin
            planned = lease.planned
            grants.setdefault(lease.peer, []).append(
                Lease(
                    lease.batch_id,
                    planned.bucket,
                    list(planned.sample_ids),
                    self._book.lease_timeout_s,
                    self._shm.slot_for(lease, info.uses_shm),
                )
            )
        depth = self.queue_depth()
        return [Outgoing(ident, LeaseGrant(self.run_id, leases, depth)) for ident, leases in grants.items()]

    # --- handlers -----------------------------------------------------------------------------
    def _on_hello(self, ident: bytes, msg: Hello, now_s: float, user_id: str | None) -> list[Outgoing]:
        if msg.proto not in SUPPORTED_VERSIONS:
            raise ProtocolError(
                RejectCode.PROTO, f"protocol {msg.proto} not supported; supported: {list(SUPPORTED_VERSIONS)}"
            )
        if user_id is not None and not producer_id_matches(msg.producer_id, user_id):
            raise ProtocolError(
                RejectCode.CONTRACT,
                f"producer id {_short(msg.producer_id)} does not match its "
                f"CURVE key {user_id!r} (ids must be {user_id}-<n>)",
            )
        c = self.cfg.contract
        learns_plan = msg.learns_plan  # no shapes: the WELCOME gives ours and the weights they were planned with
        buckets, learns_rows = (c.buckets, False) if learns_plan else _fill_rows(msg.buckets, c.buckets)
        for name, theirs, ours in (
            ("manifest fingerprint", msg.fingerprint, c.fingerprint),
            ("n_mels", msg.n_mels, c.n_mels),
            ("seed", msg.seed, c.seed),
            ("bucket shapes", buckets, c.buckets),
            ("transport.mel_dtype", msg.mel_dtype, c.mel_dtype),
        ):
            if theirs != ours:  # reprlib: a peer's 1 MB list must not cost a full repr (why <= 200)
                theirs = msg.buckets if theirs is buckets else theirs  # as it said them
                # The peer is not authenticated yet: the reply names only its own value (the log has ours).
                raise ProtocolError(
                    RejectCode.CONTRACT,
                    f"{name} differs: producer {_short(theirs)}, consumer {_short(ours)}",
                    reply=f"{name} differs from the consumer's (see its log): producer {_short(theirs)}",
                )
        # Peer-chosen text: escaped once here, so no log line, status row or label shows it raw (invariant 7).
        producer_id = escape_line(msg.producer_id)
        uses_shm = self._shm.is_enabled and CAP_SHM in msg.caps
        old = self._peers.get(ident)
        if old is not None and old.is_same_join(msg.nonce, producer_id, uses_shm):
            # A retried HELLO that crossed our WELCOME: answer it again, keep the leases (no churn).
            old.last_seen_s = now_s
            self._counts["hello_repeats"] += 1
            log.debug("repeated HELLO id=%s peer=%s; answered again, leases kept", producer_id, peer_label(ident))
            return [self._welcome(ident, old, learns_rows, learns_plan)]
        if old is not None:
            self._drop_peer(ident, "re-handshake")
        info = self._peers.add(ident, producer_id, now_s, msg.nonce)
        if old is not None:  # a HELLO does not lift a bench nor reset its count
            info.expired_in_row, info.benched_until_s = old.expired_in_row, old.benched_until_s
        info.uses_shm = uses_shm
        log.info(
            "producer joined id=%s peer=%s alive=%d transport=%s%s",
            info.producer_id,
            peer_label(ident),
            len(self._peers),
            "shm" if info.uses_shm else "zmq",
            " rows=learned" if learns_rows else " plan=learned" if learns_plan else "",
        )
        return [self._welcome(ident, info, learns_rows, learns_plan)]

    def _welcome(self, ident: bytes, info: PeerInfo, learns_rows: bool, learns_plan: bool) -> Outgoing:
        """The WELCOME for a HELLO that passed; ``learns_rows``: it asked for rows, so it carries every bucket's;
        ``learns_plan``: it had no shapes, so it carries ours (rows included) and the weights that planned them."""
        cfg, c = self.cfg, self.cfg.contract
        shm_dir = self._shm.directory if info.uses_shm else None
        rows = [b[1] for b in c.buckets] if learns_rows else None
        costs = [*c.costs] if learns_plan else None
        buckets = [list(b) for b in c.buckets] if learns_plan else None
        return Outgoing(
            ident,
            Welcome(
                self.run_id,
                self._book.window,
                cfg.heartbeat_interval_s,
                cfg.checksum,
                info.nonce,
                shm_dir,
                rows,
                costs,
                buckets,
            ),
        )

    def _on_bye(self, ident: bytes, peer: PeerInfo, msg: Bye) -> None:
        if msg.exit_code != 0:
            # Peer-supplied text: escaped, so a reason cannot forge log lines (invariant 7).
            self._counts["failures"] += 1
            log.error(
                "producer failed id=%s exit=%d: %s",
                escape_line(peer.producer_id),
                msg.exit_code,
                escape_line(msg.reason[:MAX_REASON_CHARS]),
            )
        self._drop_peer(ident, "said goodbye")

    def _known(self, ident: bytes, epoch: int) -> PeerInfo:
        peer = self._peers.get(ident)
        if peer is None or epoch != self.run_id:
            if epoch != self.run_id:
                self._counts["stale"] += 1
            raise ProtocolError(RejectCode.UNKNOWN_PEER, "unknown peer or old consumer epoch; send HELLO")
        return peer

    def _on_batch(self, ident: bytes, hdr: BatchHeader, now_s: float) -> Decision:
        peer = self._known(ident, hdr.epoch)
        peer.last_seen_s = now_s
        self._shm.check_claim(ident, hdr, self._book.active(hdr.batch_id))
        arrival, lease = self._book.accept(ident, hdr.batch_id)
        if arrival is Arrival.DUP:
            self._counts["dup"] += 1
            return Decision(drain=True)
        if arrival is Arrival.NOT_LEASED or lease is None:
            raise ProtocolError(RejectCode.LEASE, f"batch {hdr.batch_id} is not leased to this producer")
        return Decision(intake=BatchIntake(ident, hdr, lease, lease.planned.bucket, self._shm.is_in_place(lease.slot)))

    # --- leases, liveness, rejects --------------------------------------------------------------
    def _cancel(self, lease: ActiveLease) -> None:
        """Give a lease's slot back unfilled; an shm slot is retired first (a zombie may write into it)."""
        self._shm.cancel(lease)
        self._ring.cancel(lease.slot)

    def _check_liveness(self, now_s: float) -> None:
        for ident in self._peers.silent_since(now_s - self.cfg.liveness_s):
            self._drop_peer(ident, f"silent for more than {self.cfg.liveness_s:.1f} s")
        cfg = self.cfg
        for lease in self._book.expire(now_s):
            self._cancel(lease)
            self._counts["reissued"] += 1
            log.warning("lease expired batch=%d peer=%s; reissuing", lease.batch_id, peer_label(lease.peer))
            benched = self._peers.note_expiry(lease.peer, now_s, cfg.lease_expiry_limit, cfg.lease_backoff_s)
            if benched is not None:  # it heartbeats but does not deliver: its other leases go too
                log.warning(
                    "producer %s (peer=%s) let %d leases in a row expire; no leases for it for %.0f s",
                    escape_line(benched.producer_id),
                    peer_label(lease.peer),
                    benched.expired_in_row,
                    cfg.lease_backoff_s,
                )
                for held in self._book.revoke_peer(lease.peer):
                    self._cancel(held)
                    self._counts["reissued"] += 1

    def _drop_peer(self, ident: bytes, why: str) -> None:
        for lease in self._book.revoke_peer(ident):
            self._cancel(lease)
            self._counts["reissued"] += 1
        info = self._peers.remove(ident)
        if info is not None:
            level = logging.INFO if why in ("said goodbye", "re-handshake") else logging.WARNING
            log.log(
                level, "producer left id=%s reason=%s alive=%d", escape_line(info.producer_id), why, len(self._peers)
            )

    def _reject(
        self, ident: bytes, code: RejectCode, why: str, now_s: float, *, reply: str | None = None
    ) -> list[Outgoing]:
        # Counted and flood-checked by routing id: a producer id is chosen by the peer, so a
        # flooder claiming a good producer's id must not get that producer blocked.
        name = peer_label(ident)
        if self._rejects.record(name, code, why, now_s):
            log.warning("peer %s floods invalid messages; ignoring it for %.0f s", name, BLOCK_S)
            self._drop_peer(ident, "flooding")
            self._peers.block(ident, now_s + BLOCK_S)
            # The last answer it gets says why the others stop: every reject but an ignored one
            # (counted as FLOOD) is answered exactly once.
            reply = f"{code}: too many invalid messages; ignored for {BLOCK_S:.0f} s"
            code = RejectCode.FLOOD
        return [Outgoing(ident, Err(code, why if reply is None else reply))]


def _fill_rows(theirs: list[list[int]], ours: list[list[int]]) -> tuple[list[list[int]], bool]:
    """The HELLO's bucket shapes with each ``LEARN_ROWS`` row count replaced by ours, and whether there was one.

    Only the row count is the consumer's to give: the bucket count and every other field (index, T, L, n_mels,
    each S) are compared as sent. A list of another length is returned as it came, so it can never match.
    """
    if len(theirs) != len(ours):
        return theirs, False
    filled = [
        [b[0], o[1], *b[2:]] if len(b) >= 2 and b[1] == LEARN_ROWS and len(o) >= 2 else b for b, o in zip(theirs, ours)
    ]
    return filled, filled != theirs


_REPR = reprlib.Repr()
_REPR.maxlist, _REPR.maxstring, _REPR.maxother, _REPR.maxlevel = 8, 80, 80, 3


def _short(value: object) -> str:
    """A bounded repr of a peer-supplied value, cheap whatever its size."""
    return _REPR.repr(value)
