"""Table of connected producers, keyed by ZeroMQ routing id. Pure bookkeeping (times passed in).

Invariant: a routing id is in the table only between a valid HELLO and its removal (liveness
expiry, BYE, unreachable, flood, or a HELLO that is not a repeat of its join: ``PeerInfo.is_same_join``).
``seen`` counts distinct producer ids ever joined.
A peer that let ``limit`` leases in a row expire is benched (no leases) for a back-off period; a
delivered batch resets its count (docs/security.md "Hostile peers").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from melfeed.consumer.flow.rejects import peer_label as _label
from melfeed.shared.wire.protocol import StageCounters

__all__ = ["PeerInfo", "PeerTable", "ProducerReport"]


class _HasHeld(Protocol):
    def held_by(self, peer: bytes) -> int: ...


@dataclass(slots=True)
class PeerInfo:
    producer_id: str
    last_seen_s: float
    nonce: int  # its HELLO's join nonce
    batches: int = 0
    last_grant_s: float = 0.0
    uses_shm: bool = False  # offered CAP_SHM and the consumer has slot files: leases name them
    stage: StageCounters | None = None  # latest cumulative counters from its heartbeats
    stage_at_s: float = 0.0  # when they arrived
    expired_in_row: int = 0  # its leases that expired since its last delivered batch
    benched_until_s: float | None = None  # no leases for it until then (it let too many expire)

    def is_same_join(self, nonce: int, producer_id: str, uses_shm: bool) -> bool:
        """A HELLO repeating the one this peer joined with (sent again before our answer reached it).

        Only a HELLO carrying the same nonce, name and transport is a repeat; anything else (a new nonce
        after the producer dropped its leases) is a new join that returns the old leases.
        """
        return nonce == self.nonce and producer_id == self.producer_id and uses_shm == self.uses_shm


@dataclass(frozen=True, slots=True)
class ProducerReport:
    """What the consumer knows about one connected producer, for the live figures."""

    producer_id: str
    batches_received: int
    stage: StageCounters | None
    stage_at_s: float
    peer: str = ""  # its routing id (``peer_label``): assigned by the ROUTER, one per connection


class PeerTable:
    def __init__(self) -> None:
        self._peers: dict[bytes, PeerInfo] = {}
        self._blocked_until: dict[bytes, float] = {}
        self._seen_ids: set[str] = set()

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, ident: bytes) -> bool:
        return ident in self._peers

    @property
    def seen(self) -> int:
        return len(self._seen_ids)

    def add(self, ident: bytes, producer_id: str, now_s: float, nonce: int) -> PeerInfo:
        info = PeerInfo(producer_id, last_seen_s=now_s, nonce=nonce)
        self._peers[ident] = info
        self._seen_ids.add(producer_id)
        return info

    def get(self, ident: bytes) -> PeerInfo | None:
        return self._peers.get(ident)

    def remove(self, ident: bytes) -> PeerInfo | None:
        return self._peers.pop(ident, None)

    def idents(self) -> Iterator[bytes]:
        return iter(list(self._peers))

    def name(self, ident: bytes) -> str:
        info = self._peers.get(ident)
        if info is not None:
            return info.producer_id
        text = ident.decode("ascii", errors="replace")
        return text[:64] if text.isprintable() and "\ufffd" not in text else "0x" + ident.hex()[:32]

    def silent_since(self, cutoff_s: float) -> list[bytes]:
        """Routing ids not heard from since ``cutoff_s``."""
        return [i for i, p in self._peers.items() if p.last_seen_s < cutoff_s]

    def by_fewest_leases(self, book: _HasHeld) -> list[bytes]:
        """Peers ordered so the least-loaded producer is offered work first."""
        return sorted(self._peers, key=lambda i: (book.held_by(i), self._peers[i].last_grant_s))

    def grantable(self, book: _HasHeld, now_s: float) -> list[bytes]:
        """``by_fewest_leases`` without benched peers; a bench that ran out is lifted (count back to 0)."""
        order = []
        for ident in self.by_fewest_leases(book):
            info = self._peers[ident]
            if info.benched_until_s is not None and now_s >= info.benched_until_s:
                info.benched_until_s, info.expired_in_row = None, 0
            if info.benched_until_s is None:
                order.append(ident)
        return order

    def note_expiry(self, ident: bytes, now_s: float, limit: int, backoff_s: float) -> PeerInfo | None:
        """Count one expired lease of ``ident``. Returns its info when this benches it (once per bench)."""
        info = self._peers.get(ident)
        if info is None or info.benched_until_s is not None:
            return None
        info.expired_in_row += 1
        if info.expired_in_row < limit:
            return None
        info.benched_until_s = now_s + backoff_s
        return info

    def benched(self) -> tuple[str, ...]:
        """Producer ids of the benched peers (peer-chosen: callers escape them before showing them)."""
        return tuple(p.producer_id for p in list(self._peers.values()) if p.benched_until_s is not None)

    def block(self, ident: bytes, until_s: float) -> None:
        self._blocked_until[ident] = until_s

    def is_blocked(self, ident: bytes, now_s: float) -> bool:
        until = self._blocked_until.get(ident)
        if until is None:
            return False
        if now_s >= until:
            del self._blocked_until[ident]
            return False
        return True

    def reports(self) -> tuple[ProducerReport, ...]:
        """One report per connected producer (a copy: safe to hand to another thread)."""
        return tuple(
            ProducerReport(p.producer_id, p.batches, p.stage, p.stage_at_s, _label(i))
            for i, p in list(self._peers.items())
        )
