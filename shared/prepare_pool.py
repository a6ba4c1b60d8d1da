"""Process plumbing of ``prepare``: the worker pool and the progress display.

Role: ``WorkerPool`` runs N ``shared.prepare_worker`` processes (spawn: TensorFlow is not
fork-safe) fed from one task queue and yields their results as they come; ``Progress`` draws a
bar on a terminal and prints a plain line every ``interval_s`` otherwise (logs, CI, systemd).

Invariants:
- Nothing blocks forever: every queue read has a timeout and re-checks ``stop`` and whether
  each worker is still alive; a worker that dies or fails to start ends the run with a
  ``CacheError`` naming the cache (its outputs so far are kept: the run can be resumed).
- ``WorkerPool`` is a context manager and always reaps its workers on exit.
Shutdown: ``close()`` is the stop ladder: set stop -> ``join(_JOIN_TIMEOUT_S)`` ->
``terminate()`` -> ``join`` -> ``kill()``, logging each escalation; a worker that never
reported ready holds no item and is terminated at once. Outputs are atomic, so
escalating loses at most the item in hand; its temp file is removed by the next run.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TextIO

from shared.errors import CacheError
from shared.prepare_worker import WorkerEvent, WorkerSpec, WorkItem, WorkResult, worker_main

__all__ = ["WorkerPool", "Progress"]

log = logging.getLogger(__name__)

_POLL_S = 0.5  # one bounded wait for a result; the stop and liveness checks run at least this often
_JOIN_TIMEOUT_S = 5.0  # > one clip (<1 s); a worker still importing TensorFlow is terminated, safely


class WorkerPool:
    """N prepare workers on one task queue; use as a context manager."""

    def __init__(self, spec: WorkerSpec, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        ctx = mp.get_context("spawn")
        self._cache = spec.cache_dir
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._stop = ctx.Event()
        self._procs = [ctx.Process(target=worker_main, name=f"prepare-{i + 1}", daemon=True,
                                   args=(spec, i + 1, self._tasks, self._results, self._stop, os.getpid()))
                       for i in range(count)]
        self._ready: set[str] = set()  # names of workers that reported ready (may hold an item)
        self._closed = False

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def run(self, items: list[WorkItem], stop: threading.Event,
            on_ready: Callable[[], None] | None = None) -> Iterator[WorkResult]:
        """Start the workers on ``items`` and yield one result per item, until done or ``stop``.

        ``on_ready`` is called once, when the first worker is ready (TensorFlow imported):
        worker start-up takes seconds and should not count against throughput.

        Raises:
            CacheError: A worker failed to start or to write, or died.
        """
        for item in items:
            self._tasks.put(item)
        for _ in self._procs:
            self._tasks.put(None)  # one end marker per worker
        for proc in self._procs:
            proc.start()
        pending = len(items)
        while pending and not stop.is_set():
            try:
                msg = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()
                continue
            if isinstance(msg, WorkerEvent):
                if msg.kind == "failed":
                    raise CacheError(self._cache, f"worker prepare-{msg.worker} failed: {msg.detail}")
                log.info("worker prepare-%d ready device=%s", msg.worker, msg.detail)
                if not self._ready and on_ready is not None:
                    on_ready()
                self._ready.add(f"prepare-{msg.worker}")
                continue
            pending -= 1
            yield msg

    def _check_alive(self) -> None:
        for proc in self._procs:
            if proc.exitcode is not None and proc.exitcode != 0:
                raise CacheError(self._cache, f"worker {proc.name} died with exit code {proc.exitcode}; "
                                              "run again to resume")
        if all(proc.exitcode == 0 for proc in self._procs):
            raise CacheError(self._cache, "every worker exited with work left; run again to resume")

    def close(self) -> None:
        """Stop ladder (see module docstring); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        started = [p for p in self._procs if p.pid is not None]
        for proc in started:
            if proc.name not in self._ready and proc.is_alive():
                proc.terminate()  # still importing TensorFlow: it holds no item, nothing to wait for
            proc.join(_JOIN_TIMEOUT_S)
        for proc in started:
            if proc.is_alive():
                log.warning("worker %s still running after %.1f s; terminating", proc.name, _JOIN_TIMEOUT_S)
                proc.terminate()
                proc.join(_JOIN_TIMEOUT_S)
            if proc.is_alive():
                log.warning("worker %s ignored SIGTERM; killing", proc.name)
                proc.kill()
                proc.join()
        self._tasks.cancel_join_thread()  # items never taken must not block our exit
        self._tasks.close()
        self._results.close()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{secs:02d}s"


class Progress:
    """A bar on a terminal (redrawn at most 10 times a second), else a line every ``interval_s``.

    Rate and ETA count from ``start()`` (the first worker ready), or from construction.
    ``label`` prefixes the plain lines, ``unit`` names what is counted; ``count_skipped=False``
    leaves the skip count out (``run_pipeline.py doctor`` counts stages, none of them skipped).
    """

    def __init__(self, total: int, stream: TextIO, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, *, label: str = "prepare",
                 unit: str = "utterances", count_skipped: bool = True) -> None:
        self._total, self._stream, self._interval_s, self._clock = total, stream, interval_s, clock
        self._label, self._unit, self._count_skipped = label, unit, count_skipped
        self._is_tty = stream.isatty()
        self._started = self._last = clock()
        self._done = self._skipped = 0

    def start(self) -> None:
        """Count rate and ETA from now (work begins; start-up is over)."""
        self._started = self._clock()

    def _line(self) -> str:
        elapsed = max(self._clock() - self._started, 1e-9)
        handled = self._done + self._skipped
        rate = self._done / elapsed
        eta = _clock((self._total - handled) * elapsed / handled) if handled else "?"
        pct = 100.0 * handled / self._total if self._total else 100.0
        text = f"{handled}/{self._total} ({pct:.0f}%) {rate:.1f} {self._unit}/s, eta {eta}"
        if self._count_skipped:
            text += f", skipped {self._skipped}"
        if not self._is_tty:
            return f"{self._label}: {text}"
        filled = int(30 * pct / 100)
        return f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}\x1b[K"

    def update(self, done: int, skipped: int) -> None:
        """Record progress; draw if the bar or line is due."""
        self._done, self._skipped = done, skipped
        now = self._clock()
        if now - self._last >= (0.1 if self._is_tty else self._interval_s):
            self._last = now
            self._write(self._line(), end="" if self._is_tty else "\n")

    def note(self, text: str) -> None:
        """Print one line (a skip report) without tearing the bar."""
        self._write(("\r\x1b[K" if self._is_tty else "") + text, end="\n")

    def finish(self) -> None:
        """Draw the final state once, ending the bar's line."""
        if self._total:
            self._write(self._line(), end="\n")

    def _write(self, text: str, end: str) -> None:
        self._stream.write(text + end)
        self._stream.flush()
