"""A ReceiverSession wired to a real ring and lease book, a fake plan and a fake clock, for unit tests.

Every reply the session returns is also encoded (``encode``), so a reply that could not be sent
fails the test that produced it.
"""

from __future__ import annotations

import itertools
from typing import Any

from melfeed.consumer.flow.credit import LeaseBook
from melfeed.consumer.flow.decisions import Decision, HandshakeContract, Outgoing, ReceiverSessionConfig
from melfeed.consumer.flow.rejects import RejectLog
from melfeed.consumer.flow.ring import BatchRing
from melfeed.consumer.flow.session import ReceiverSession
from melfeed.consumer.flow.shm_leases import SlotFiles
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.protocol import (
    PROTOCOL_VERSION,
    BatchHeader,
    Err,
    Heartbeat,
    Hello,
    Lease,
    LeaseGrant,
    Message,
    RejectCode,
    Welcome,
    decode_header,
    encode,
)
from tests.fakes import FakeClock, FakePlan

BUCKET = Bucket(index=0, batch_size=2, max_frames=8, max_tokens=4, n_mels=3)
EPOCH = 7
CONTRACT = HandshakeContract("ab" * 32, [BUCKET.as_wire()], BUCKET.n_mels, 42)
A, B = b"producer-a", b"producer-b"


class Rig:
    """One session and everything it decides with; ``clock`` is the only time there is."""

    def __init__(
        self,
        *,
        n_slots: int = 3,
        window: int = 2,
        lease_timeout_s: float = 10.0,
        liveness_s: float = 30.0,
        heartbeat_interval_s: float = 1.0,
        end_id: int | None = None,
        shm: SlotFiles | None = None,
        flood_limit: int = 200,
        start_s: float = 100.0,
        lease_expiry_limit: int = 3,
        lease_backoff_s: float = 60.0,
        contract: HandshakeContract = CONTRACT,
    ) -> None:
        self.clock = FakeClock(start_s)
        self.ring = BatchRing(n_slots, (BUCKET,))
        self.book = LeaseBook(FakePlan(BUCKET.batch_size), 0, end_id, window, lease_timeout_s)  # type: ignore[arg-type]
        cfg = ReceiverSessionConfig(
            contract,
            EPOCH,
            heartbeat_interval_s,
            liveness_s,
            checksum=False,
            lease_expiry_limit=lease_expiry_limit,
            lease_backoff_s=lease_backoff_s,
        )
        self.session = ReceiverSession(cfg, self.ring, self.book, shm=shm, rejects=RejectLog(flood_limit=flood_limit))
        self._nonces = itertools.count(1000)

    # --- inbound --------------------------------------------------------------------------------
    def send(self, ident: bytes, msg: Message, *, more: bool = False, user_id: str | None = None) -> Decision:
        """Deliver one decoded message as the receiver shell does (admit first)."""
        now = self.clock()
        if not self.session.admit(ident, now):
            return Decision(drain=True)
        decision = self.session.on_message(ident, msg, now, more=more, user_id=user_id)
        _check_encodable(decision.sends)
        return decision

    def hello(
        self, ident: bytes, *, caps: tuple[str, ...] = (), user_id: str | None = None, **overrides: Any
    ) -> Decision:
        """A HELLO; each carries a new join nonce (a new join) unless ``nonce=`` is given."""
        fields: dict[str, Any] = {
            "proto": PROTOCOL_VERSION,
            "producer_id": ident.decode(),
            "fingerprint": CONTRACT.fingerprint,
            "buckets": CONTRACT.buckets,
            "n_mels": CONTRACT.n_mels,
            "seed": CONTRACT.seed,
            "caps": list(caps),
            "nonce": next(self._nonces),
        }
        fields.update(overrides)
        return self.send(ident, Hello(**fields), user_id=user_id)

    def join(self, ident: bytes, caps: tuple[str, ...] = (), **overrides: Any) -> Welcome:
        """A good HELLO; returns the WELCOME it was answered with."""
        [out] = self.hello(ident, caps=caps, **overrides).sends
        assert out.ident == ident and isinstance(out.msg, Welcome)
        return out.msg

    def heartbeat(self, ident: bytes, epoch: int = EPOCH) -> Decision:
        return self.send(ident, Heartbeat(epoch))

    def deliver(
        self, ident: bytes, batch_id: int, *, epoch: int = EPOCH, shm: tuple[int, int] | None = None
    ) -> Decision:
        """A BATCH header; when the session asks for the payload, the slot is taken as filled."""
        decision = self.send(ident, header(batch_id, epoch=epoch, shm=shm), more=shm is None)
        if decision.intake is not None:
            self.session.on_batch_taken(decision.intake, BUCKET.nbytes())
        return decision

    # --- periodic -------------------------------------------------------------------------------
    def tick(self, applied_through: int = -1) -> list[Outgoing]:
        sends = self.session.tick(self.clock(), applied_through)
        _check_encodable(sends)
        return sends

    def grant(self) -> dict[bytes, list[Lease]]:
        """One grant round: the leases each peer was sent."""
        sends = self.session.grant(self.clock())
        _check_encodable(sends)
        grants: dict[bytes, list[Lease]] = {}
        for out in sends:
            assert isinstance(out.msg, LeaseGrant) and out.msg.epoch == EPOCH
            assert out.ident not in grants, "one LEASE message per peer and round"
            grants[out.ident] = out.msg.leases
        return grants

    def loop(self, applied_through: int = -1) -> dict[bytes, list[Lease]]:
        """What the shell does after each wake: tick, then grant."""
        self.tick(applied_through)
        return self.grant()


def header(batch_id: int, *, epoch: int = EPOCH, shm: tuple[int, int] | None = None) -> BatchHeader:
    shapes = [list(s) for s in BUCKET.shapes().values()]
    return BatchHeader(epoch, batch_id, BUCKET.index, shapes, list(BUCKET.dtypes().values()), None, [], shm)


def err_codes(decision: Decision) -> list[RejectCode]:
    """The ERR codes a decision answers with (every other reply kind fails the test)."""
    codes: list[RejectCode] = []
    for out in decision.sends:
        assert isinstance(out.msg, Err), out.msg
        codes.append(out.msg.code)
    return codes


def ids(leases: list[Lease]) -> list[int]:
    return [x.batch_id for x in leases]


def _check_encodable(sends: list[Outgoing]) -> None:
    for out in sends:
        back = decode_header(encode(out.msg))
        if isinstance(out.msg, Err):  # the reason is cut to one log line on the wire
            assert isinstance(back, Err) and back.code == out.msg.code and out.msg.why.startswith(back.why)
        else:
            assert back == out.msg
