"""Progress display for long offline commands (``prepare``, ``index``, ``verify-cache``).

Role: ``Progress`` shows how far a counted job is: a label, done/total, percent, rate and ETA.
On a terminal it is a bar redrawn in place (``\\r``, at most 10 times a second); elsewhere (logs, CI,
systemd) it is one plain line every ``interval_s``. ``finish()`` always draws the final state once.
``progress_interval_s`` reads the ``MELFEED_PROGRESS_S`` override for the CLI entry functions.

Invariants: never draws more often than its interval; holds no resource (the stream belongs to the
caller). Time is injected (``clock``), so the logic is testable without sleeping.
Shutdown: nothing to shut down; ``finish()`` ends the bar's line and is idempotent.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from melfeed.shared.errors import ConfigError

__all__ = ["Progress", "progress_interval_s", "PROGRESS_ENV"]

PROGRESS_ENV = "MELFEED_PROGRESS_S"  # seconds between plain progress lines (tests set it tiny)
_TTY_REDRAW_S = 0.1  # a bar redrawn faster than this only costs CPU
_BAR_WIDTH = 30


def progress_interval_s(default_s: float, environ: Mapping[str, str] | None = None) -> float:
    """The plain-line interval: ``$MELFEED_PROGRESS_S`` when set, else ``default_s``.

    Raises:
        ConfigError: The variable is set but is not a number >= 0 (names the variable).
    """
    raw = (os.environ if environ is None else environ).get(PROGRESS_ENV)
    if raw is None or raw == "":
        return default_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError("must be a number of seconds >= 0", path=(PROGRESS_ENV,), got=raw)
    return value


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{secs:02d}s"


class Progress:
    """A bar on a terminal, else a plain line every ``interval_s``; both go to ``stream``.

    Rate and ETA count from ``start()`` (work begins, start-up is over), or from construction.
    ``done`` counts items processed; ``skipped`` items count towards the total and the ETA, not
    the rate. ``label`` starts each line, ``unit`` names what is counted. ``count_skipped=True``
    always shows the skip count (``prepare``); otherwise it appears only once something is skipped.
    """

    def __init__(
        self,
        total: int,
        stream: TextIO,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        label: str = "progress",
        unit: str = "items",
        count_skipped: bool = False,
    ) -> None:
        self._total, self._stream, self._interval_s, self._clock = total, stream, interval_s, clock
        self._label, self._unit, self._count_skipped = label, unit, count_skipped
        self._is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self._started = self._last = clock()
        self._done = self._skipped = 0
        self._finished = False

    def start(self) -> None:
        """Count rate and ETA from now (work begins; start-up is over)."""
        self._started = self._clock()

    def _line(self) -> str:
        elapsed_s = max(self._clock() - self._started, 1e-9)
        handled = self._done + self._skipped
        rate = self._done / elapsed_s
        eta = _clock_text((self._total - handled) * elapsed_s / handled) if handled else "?"
        pct = min(100.0, 100.0 * handled / self._total) if self._total else 100.0
        text = f"{handled}/{self._total} ({pct:.0f}%) {rate:.1f} {self._unit}/s, eta {eta}"
        if self._skipped or self._count_skipped:
            text += f", skipped {self._skipped}"
        if not self._is_tty:
            return f"{self._label}: {text}"
        filled = int(_BAR_WIDTH * pct / 100)
        return f"\r{self._label} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {text}\x1b[K"

    def update(self, done: int, skipped: int = 0) -> None:
        """Record progress (absolute counts); draw if the bar or line is due."""
        self._done, self._skipped = done, skipped
        now = self._clock()
        if now - self._last >= (_TTY_REDRAW_S if self._is_tty else self._interval_s):
            self._last = now
            self._write(self._line(), end="" if self._is_tty else "\n")

    def callback(self) -> Callable[[int, int], None]:
        """A ``progress(done, total)`` callback for ``build_manifest``/``verify_cache``."""

        def progress(done: int, total: int) -> None:
            self._total = total
            self.update(done)

        return progress

    def note(self, text: str) -> None:
        """Print one line (a skip report) without tearing the bar."""
        self._write(("\r\x1b[K" if self._is_tty else "") + text, end="\n")

    def finish(self) -> None:
        """Draw the final state once, ending the bar's line; idempotent; silent for an empty job."""
        if self._finished:
            return
        self._finished = True
        if self._total:
            self._write(self._line(), end="\n")

    def _write(self, text: str, end: str) -> None:
        self._stream.write(text + end)
        self._stream.flush()
