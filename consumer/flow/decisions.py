"""What the receiver session is configured with and what it hands back to its socket shell.

Plain frozen records (and one mutable ``Decision`` the session fills): the session's settings
(``ReceiverSessionConfig``, ``HandshakeContract``), its replies (``Outgoing``: a routing id and a message;
the shell encodes and sends it), a BATCH whose payload the shell must take (``BatchIntake``), and the
receiver's counters (``ReceiverStats``, a snapshot safe to hand to any thread).
Invariant: nothing here holds a socket, a thread or a clock. Shutdown: nothing to release.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from melfeed.consumer.flow.credit import ActiveLease
from melfeed.consumer.flow.peers import ProducerReport
from melfeed.shared.config import TransportConfig
from melfeed.shared.wire.protocol import BatchHeader, Message

__all__ = ["BatchIntake", "Decision", "HandshakeContract", "Outgoing", "ReceiverStats", "ReceiverSessionConfig"]


@dataclass(frozen=True, slots=True)
class HandshakeContract:
    """What a producer's HELLO must match."""

    fingerprint: str
    buckets: list[list[int]]
    n_mels: int
    seed: int
    mel_dtype: str = "float32"  # transport.mel_dtype: a producer writing the other dtype is refused
    # [buckets.token_cost, buckets.attention_cost] the shapes were planned with (resolved: never "measured"):
    # sent with ``buckets`` to a producer whose HELLO has none, so it plans the same shapes
    costs: tuple[float, float] = (1.0, 0.0)


@dataclass(frozen=True, slots=True)
class ReceiverSessionConfig:
    """The protocol settings of one consumer start."""

    contract: HandshakeContract
    run_id: int  # this consumer start's id (random, non-zero; the wire's ``epoch`` field)
    heartbeat_interval_s: float  # between two consumer heartbeats; also sent in WELCOME
    liveness_s: float  # a producer silent this long is dropped and its leases reissued
    checksum: bool  # producers must send crc32 (WELCOME tells them)
    lease_expiry_limit: int = 3  # leases a producer lets expire in a row before it is benched ...
    lease_backoff_s: float = 60.0  # ... and gets no leases for this long

    @classmethod
    def from_transport(
        cls, t: TransportConfig, contract: HandshakeContract, run_id: int, checksum: bool
    ) -> ReceiverSessionConfig:
        """The settings ``transport.*`` gives one consumer start (``checksum``: ``resolve_checksum``'s answer)."""
        return cls(
            contract,
            run_id,
            heartbeat_interval_s=t.heartbeat_interval_s,
            liveness_s=t.liveness_s,
            checksum=checksum,
            lease_expiry_limit=t.lease_expiry_limit,
            lease_backoff_s=t.lease_backoff_s,
        )


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    batches_received: int
    bytes_received: int  # batch bytes delivered into the ring (payload frames or built in place)
    duplicates_dropped: int
    stale_dropped: int
    leases_outstanding: int
    leases_reissued: int
    producers_alive: int
    producers_seen: int
    rejects: dict[str, int]  # by reject code; FLOOD = messages of a blocked peer, dropped unread
    quarantined: int
    # Rejected + ignored messages by routing id (``peer_label``), for the 256 most recently rejected peers.
    rejects_by_peer: dict[str, int] = field(default_factory=dict)
    shm_retired: int = 0  # shm slot files orphaned because their lease was cancelled (fencing)
    lease_window: int = 0  # leases one producer may hold
    producers: tuple[ProducerReport, ...] = ()  # connected producers and their stage counters
    producer_failures: int = 0  # BYEs with a non-zero exit code (the producer said why it fails)
    # Producers getting no leases because they let ``lease_expiry_limit`` leases in a row expire (escaped ids).
    producers_benched: tuple[str, ...] = ()
    hello_repeats: int = 0  # HELLOs repeating a peer's join (same nonce): answered again, leases kept


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message for the shell to send to ``ident`` (the frames are ``[ident, encode(msg)]``)."""

    ident: bytes
    msg: Message


@dataclass(frozen=True, slots=True)
class BatchIntake:
    """A BATCH header passed its lease checks: take its payload into ``lease.slot``.

    ``in_place``: the producer built the batch in the slot's shared-memory file (header alone);
    otherwise the payload frames follow. ``planned_bucket`` is the leased batch's bucket.
    """

    ident: bytes
    hdr: BatchHeader
    lease: ActiveLease
    planned_bucket: int
    in_place: bool


@dataclass(slots=True)
class Decision:
    """What the shell does with one received message."""

    sends: list[Outgoing] = field(default_factory=list)
    drain: bool = False  # discard the rest of the message's frames unread
    intake: BatchIntake | None = None  # take the payload, then on_batch_taken / on_batch_refused
