"""Counting and rate-limited logging of rejected messages (DESIGN invariant 7).

Pure bookkeeping with an injected clock value; the receiver owns one instance.
A peer whose rejects exceed ``flood_limit`` within ``flood_window_s`` is flagged so the receiver
can stop answering it (its messages are then dropped unread and counted as ``FLOOD``).
"""

from __future__ import annotations

import logging
from collections import Counter, deque

__all__ = ["RejectLog"]

log = logging.getLogger(__name__)


class RejectLog:
    def __init__(self, log_interval_s: float = 5.0, flood_limit: int = 200,
                 flood_window_s: float = 10.0) -> None:
        self.by_code: Counter[str] = Counter()
        self.by_peer: Counter[str] = Counter()
        self._last_log_s: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()
        self._recent: dict[str, deque[float]] = {}
        self._log_interval_s = log_interval_s
        self._flood_limit = flood_limit
        self._flood_window_s = flood_window_s

    @property
    def total(self) -> int:
        return sum(self.by_code.values())

    def record(self, peer: str, code: str, why: str, now_s: float) -> bool:
        """Count one reject; log it unless this code logged recently.

        Returns:
            True when ``peer`` is now flooding (over the limit within the window).
        """
        self.by_code[code] += 1
        self.by_peer[peer] += 1
        last = self._last_log_s.get(code)
        if last is None or now_s - last >= self._log_interval_s:
            extra = self._suppressed.pop(code, 0)
            more = f" (+{extra} similar suppressed)" if extra else ""
            log.warning("rejected peer=%s code=%s why=%s%s", peer, code, why, more)
            self._last_log_s[code] = now_s
        else:
            self._suppressed[code] += 1
        window = self._recent.setdefault(peer, deque())
        window.append(now_s)
        while window and now_s - window[0] > self._flood_window_s:
            window.popleft()
        return len(window) > self._flood_limit

    def snapshot(self) -> dict[str, int]:
        return dict(self.by_code)
