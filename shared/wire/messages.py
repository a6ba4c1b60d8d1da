"""The wire protocol's messages: one frozen dataclass per message kind, the kinds and the reject codes.

Role: what producers and the consumer say to each other, free of any encoding. ``shared/wire/protocol.py``
turns these into msgpack headers and back (it is the only module that knows msgpack and the header
layout) and re-exports every name here, so callers import from either. Invariant: a decoded message
is fully validated before it becomes one of these; field order is the constructor's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum

__all__ = [
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "CAP_SHM",
    "LEARN_ROWS",
    "ShmSlot",
    "MsgKind",
    "RejectCode",
    "FATAL_REJECTS",
    "Hello",
    "Welcome",
    "LeaseGrant",
    "Lease",
    "BatchHeader",
    "Heartbeat",
    "StageCounters",
    "Err",
    "Bye",
    "Message",
]

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
CAP_SHM = "shm"  # HELLO capability: this producer can build into the consumer's slot files
# A HELLO bucket's row count B meaning "the consumer's rows": the producer learns them from the WELCOME
# (``buckets.batch_size: auto`` without ``buckets.rows``); every other field of the bucket is still compared.
LEARN_ROWS = 0


class MsgKind(IntEnum):
    HELLO = 1
    WELCOME = 2
    LEASE = 3
    BATCH = 4
    HB = 5
    ERR = 6
    BYE = 7


class RejectCode(str, Enum):  # enum.StrEnum needs Python 3.11; __str__ below does what it adds
    """Why the consumer rejected a message: the ``code`` of an ERR, on the wire as the member's string.

    docs/design.md "Wire protocol" (invariant 7) says what each one answers.
    """

    DECODE = "DECODE"  # not msgpack, truncated, trailing bytes, or over a size limit
    FRAMES = "FRAMES"  # frames missing, extra, or not the lease's kind (payload or shared memory)
    SCHEMA = "SCHEMA"  # a key missing or of the wrong type
    TYPE = "TYPE"  # an unknown message kind, or one the consumer is never sent
    PROTO = "PROTO"  # a protocol version this consumer does not speak
    CONTRACT = "CONTRACT"  # another dataset, n_mels, seed, buckets or mel dtype; an id its key does not own
    UNKNOWN_PEER = "UNKNOWN_PEER"  # no HELLO from this peer in this consumer epoch: send HELLO
    LEASE = "LEASE"  # a batch not leased to this peer
    SHAPE = "SHAPE"  # an array's shape, size or lengths do not fit the leased bucket
    DTYPE = "DTYPE"  # an array's dtype is not one the wire allows
    CRC = "CRC"  # the payload's checksum does not match
    FLOOD = "FLOOD"  # too many rejects from one peer: it is ignored for a while

    def __str__(self) -> str:
        return self.value


FATAL_REJECTS = frozenset({RejectCode.PROTO, RejectCode.CONTRACT})  # retrying cannot fix these: the producer exits 78


@dataclass(frozen=True, slots=True)
class Hello:
    """P->C: who I am and what data contract I was configured with.

    No ``buckets`` (an empty list) asks for the consumer's whole plan: a producer under ``buckets.cost: measured``
    has no shapes until the WELCOME gives the weights (``costs``) and the shapes they make (``buckets``).
    """

    proto: int
    producer_id: str
    fingerprint: str
    buckets: list[list[int]]  # ``BucketSet.as_wire()``: [index, B, T, L, n_mels, *S]; B may be LEARN_ROWS; [] = learn
    n_mels: int
    seed: int
    # Names one join of this producer: the same in every HELLO it repeats until answered, new once it
    # drops its leases. A repeat from the same peer is answered again and keeps its leases
    # (docs/design.md "Wire protocol").
    nonce: int
    caps: list[str] = field(default_factory=list)  # CAP_SHM when the producer may use slot files
    mel_dtype: str = "float32"  # transport.mel_dtype; wire key ``mel``

    @property
    def learns_plan(self) -> bool:
        """No shapes: the producer learns the consumer's plan (weights and shapes) from the WELCOME."""
        return not self.buckets


@dataclass(frozen=True, slots=True)
class Welcome:
    """C->P: the consumer epoch (new on every consumer start) and the lease window."""

    epoch: int
    window: int
    heartbeat_interval_s: float
    checksum: bool
    nonce: int  # the answered HELLO's nonce
    shm_dir: str | None = None  # set: this producer's leases name slot files in this directory
    # Every bucket's rows (index order), sent when the HELLO asked for any with LEARN_ROWS: the producer builds
    # with them for this consumer epoch. None = not sent (the HELLO named every bucket's rows).
    rows: list[int] | None = None
    # Sent when the HELLO had no buckets (``Hello.learns_plan``), else None: the 2-D planner's weights
    # [token_cost, attention_cost] the consumer planned with, and its shapes with their rows (``BucketSet.as_wire()``).
    # The producer plans with those weights and joins only if its shapes are these.
    costs: list[float] | None = None
    buckets: list[list[int]] | None = None


@dataclass(frozen=True, slots=True)
class ShmSlot:
    """Where a shared-memory lease is built: a file in the WELCOME's ``shm_dir`` (a bare name)."""

    name: str
    slot: int
    generation: int


@dataclass(frozen=True, slots=True)
class Lease:
    """One batch a producer may build: id, bucket, manifest indices; deadline relative to receipt."""

    batch_id: int
    bucket: int
    sample_ids: list[int]
    deadline_s: float
    shm: ShmSlot | None = None  # None = payload lease (build into your own buffer, send frames)


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """C->P: new leases plus the consumer's queue depth (ready batches + leases outstanding)."""

    epoch: int
    leases: list[Lease]
    queue_depth: int


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """P->C: header of a built batch; its arrays follow as raw frames (base arrays, then extras)."""

    epoch: int
    batch_id: int
    bucket: int
    shapes: list[list[int]]
    dtypes: list[str]
    crc32: int | None
    quarantined: list[int]
    shm: tuple[int, int] | None = None  # (slot, generation) on the shm path: header only, no frames
    # The first quarantined row's file and reason (``PATH: REASON``, <= MAX_REASON_CHARS; "" = none):
    # the consumer names it when quarantined rows stop a run.
    quarantine_note: str = ""


@dataclass(frozen=True, slots=True)
class StageCounters:
    """A producer process's cumulative build counters since it started (P->C heartbeats).

    Wire form: ``[batches, read_s, assemble_s, send_s]``; times are seconds, all >= 0.
    """

    batches: int  # batches built and handed to ZeroMQ
    read_s: float  # preadv of the cache files into the batch rows
    assemble_s: float  # the rest of building a batch: padding, checks, buffer reuse
    send_s: float  # header encoding and send_multipart


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Both ways. From the consumer it carries queue depth and the applied count; from a producer,
    its stage counters (the consumer's carry none).

    ``done`` (consumer only; on the wire only when true): this consumer's
    plan is finished -- every batch id up to its end was applied -- and nothing more will be leased.
    Every heartbeat after the end repeats it; a producer stops building and says BYE.
    """

    epoch: int
    queue_depth: int = 0
    applied: int = 0
    stats: StageCounters | None = None
    done: bool = False


@dataclass(frozen=True, slots=True)
class Err:
    """C->P: a rejected message and why."""

    code: RejectCode
    why: str


@dataclass(frozen=True, slots=True)
class Bye:
    """P->C: leaving; the consumer returns this producer's leases at once.

    A producer that is about to fail (a bad cache file under ``producer.bad_samples: fail``, a crash
    while building) says why before it exits, so the consumer logs the reason with the producer's
    id before any exit code reaches a supervisor: ``exit_code`` is what the producer exits with
    (0 = a planned leave) and ``reason`` one line (``"CacheError: PATH: REASON"``), cut to
    ``MAX_REASON_CHARS`` on the wire.
    """

    epoch: int
    exit_code: int = 0
    reason: str = ""


Message = Hello | Welcome | LeaseGrant | BatchHeader | Heartbeat | Err | Bye
