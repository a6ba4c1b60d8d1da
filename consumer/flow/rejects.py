"""Counting and rate-limited logging of rejected messages (docs/design.md, invariant 7).

Pure bookkeeping with an injected clock value; the receiver owns one instance and is its only
writer (``snapshot``/``peer_snapshot`` may be called from any thread: they copy plain dicts).
Counters: per reject code (exact, never evicted) and per peer (the ``max_peers`` most recently
rejected peers, so a client that reconnects under ever new routing ids cannot grow memory).
A peer whose rejects exceed ``flood_limit`` within ``flood_window_s`` is flagged so the receiver
can stop answering it; its messages are then dropped unread and counted with ``ignore`` (code
``FLOOD``). Every counted message is either rejected (``record``) or ignored (``ignore``).
Logging: at most one WARNING per code per ``log_interval_s``; the next one says how many were
suppressed in between.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any

from melfeed.shared.printable import escape_line
from melfeed.shared.wire.protocol import RejectCode

__all__ = ["RejectLog", "peer_label"]

log = logging.getLogger(__name__)

_MAX_PEERS = 256  # per-peer counters and flood windows kept (least recently rejected evicted)


def peer_label(ident: bytes) -> str:
    """A printable, injective name for a ZeroMQ routing id (at most 255 bytes, so <= 512 chars).

    Printable ASCII ids (``producer-3-4711``) are kept as they are; anything else, and any id
    that itself starts with ``0x``, is written in hex, so two different ids never share counters.
    """
    text = ident.decode("ascii", errors="replace")
    if ident and text.isprintable() and "\ufffd" not in text and not text.startswith("0x"):
        return text
    return "0x" + ident.hex()


class RejectLog:
    """Reject counters, flood detection and rate-limited reject logging.

    Args:
        log_interval_s: least time between two WARNING lines for the same code.
        flood_limit: rejects within ``flood_window_s`` above which a peer counts as flooding.
        flood_window_s: length of the sliding flood window.
        max_peers: peers whose counters and windows are kept; the least recently rejected
            one is evicted first (its count is then lost; the per-code totals stay exact).
    """

    def __init__(
        self,
        log_interval_s: float = 5.0,
        flood_limit: int = 200,
        flood_window_s: float = 10.0,
        max_peers: int = _MAX_PEERS,
    ) -> None:
        if flood_limit < 1 or max_peers < 1:
            raise ValueError("flood_limit and max_peers must be >= 1")
        self.by_code: Counter[str] = Counter()
        self._by_peer: dict[str, int] = {}  # insertion order = least recently rejected first
        self._recent: dict[str, deque[float]] = {}  # same order; each deque holds <= flood_limit + 1
        self._last_log_s: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()
        self._log_interval_s = log_interval_s
        self._flood_limit = flood_limit
        self._flood_window_s = flood_window_s
        self._max_peers = max_peers

    @property
    def total(self) -> int:
        return sum(self.by_code.values())

    def record(self, peer: str, code: str, why: str, now_s: float) -> bool:
        """Count one reject; log it unless this code logged recently.

        Returns:
            True when ``peer`` is now flooding (over the limit within the window).
        """
        self.by_code[code] += 1
        self._count_peer(peer)
        last = self._last_log_s.get(code)
        if last is None or now_s - last >= self._log_interval_s:
            extra = self._suppressed.pop(code, 0)
            more = f" (+{extra} similar suppressed)" if extra else ""
            log.warning("rejected peer=%s code=%s why=%s%s", peer, escape_line(code), escape_line(why), more)
            self._last_log_s[code] = now_s
        else:
            self._suppressed[code] += 1
        window = self._recent.pop(peer, None)
        if window is None:
            window = deque(maxlen=self._flood_limit + 1)  # more entries are never needed
        self._recent[peer] = window
        window.append(now_s)
        while window and now_s - window[0] > self._flood_window_s:
            window.popleft()
        self._evict(self._recent)
        return len(window) > self._flood_limit

    def ignore(self, peer: str) -> None:
        """Count one message from a blocked peer, dropped unread and unanswered (not logged)."""
        self.by_code[RejectCode.FLOOD] += 1
        self._count_peer(peer)

    def snapshot(self) -> dict[str, int]:
        """Rejects (and ignored flood messages) by code since start."""
        return dict(self.by_code)

    def peer_snapshot(self) -> dict[str, int]:
        """Rejected plus ignored messages of each of the last ``max_peers`` rejected peers."""
        return dict(self._by_peer)

    def _count_peer(self, peer: str) -> None:
        self._by_peer[peer] = self._by_peer.pop(peer, 0) + 1  # re-insert: now the most recent
        self._evict(self._by_peer)

    def _evict(self, table: dict[str, Any]) -> None:
        while len(table) > self._max_peers:
            del table[next(iter(table))]
