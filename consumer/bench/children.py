"""bench's children and the signals that stop bench: no trial, probe or server outlives it.

Role: every trial and build probe of ``run_pipeline.py bench`` is a child leading its own process group
(``spawn(new_group=True)``: a terminal's Ctrl-C reaches bench alone, a timeout kills a trial with its
helpers). Without a handler, SIGTERM or SIGINT ended bench alone and left the running trial, its
producers and its tf.data service servers alive with parent 1. ``BenchChildren`` (one per run, a
context manager) closes that gap:

- SIGTERM and SIGINT only record the signal and send SIGTERM to every live child's process group
  (nothing that blocks runs in the handler); the trial then ends, ``communicate`` returns, and the next
  ``spawn`` raises ``Interrupted`` instead of starting another child;
- on leaving the block, the stop ladder (``GROUP_LADDER``: SIGTERM, bounded wait, SIGKILL, bounded wait,
  whole groups) runs on every child still alive, and the old handlers come back;
- each child gets ``MELFEED_PARENT_PID`` (``PARENT_PID_ENV``): a trial calls ``die_with_parent`` with it,
  so a bench killed with SIGKILL (no handler runs) still takes its trial down.

Invariant: once ``__exit__`` returns, every child this object spawned has exited (or the ladder gave
up on it after SIGKILL, logged as an error). Shutdown: ``__exit__``; idempotent per child.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any

from shared.service.children import child_env, spawn
from shared.service.lifecycle import PARENT_PID_ENV
from shared.service.stop_ladder import GROUP_LADDER, Rung, signal_child, stop_all

__all__ = ["BenchChildren", "Interrupted"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
    """bench got SIGTERM or SIGINT; ``signum`` says which (exit ``128 + signum``)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class BenchChildren:
    """The children of one bench run and the signal handlers that stop them (see the module docstring)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._live: list[subprocess.Popen[Any]] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> BenchChildren:
        self._old = {s: signal.signal(s, self._on_signal) for s in _SIGNALS}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            stop_all(self._live, "bench children", GROUP_LADDER, group=True)
        finally:
            for s, handler in self._old.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        for proc in self._live:
            if proc.returncode is None:     # not reaped: its group may still run
                signal_child(proc, Rung.TERM, group=True)

    def check(self) -> None:
        """Raise ``Interrupted`` once a signal came."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen: Any) -> subprocess.Popen[Any]:
        """``shared.service.children.spawn`` in a new process group, registered; none after a signal."""
        self.check()
        proc = spawn(argv, env={**(env if env is not None else child_env()), PARENT_PID_ENV: str(os.getpid())},
                     new_group=True, **popen)
        self._live = [p for p in self._live if p.returncode is None] + [proc]
        if self.signum is not None:         # the signal came between the check and the start
            signal_child(proc, Rung.TERM, group=True)
        return proc
