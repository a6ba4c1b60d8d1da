"""Process plumbing of ``prepare``: the worker pool.

Role: ``WorkerPool`` runs N ``melfeed.producer.prepare.worker`` processes (spawn: TensorFlow is not
fork-safe) fed from one task queue and yields their results as they come.

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
from collections.abc import Callable, Iterator
from types import TracebackType

from melfeed.producer.prepare.worker import WorkerEvent, WorkerSpec, WorkItem, WorkResult, worker_main
from melfeed.shared.errors import CacheError

__all__ = ["WorkerPool"]

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
        self._procs = [
            ctx.Process(
                target=worker_main,
                name=f"prepare-{i + 1}",
                daemon=True,
                args=(spec, i + 1, self._tasks, self._results, self._stop, os.getpid()),
            )
            for i in range(count)
        ]
        self._ready: set[str] = set()  # names of workers that reported ready (may hold an item)
        self._closed = False

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def run(
        self, items: list[WorkItem], stop: threading.Event, on_ready: Callable[[], None] | None = None
    ) -> Iterator[WorkResult]:
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
                raise CacheError(
                    self._cache, f"worker {proc.name} died with exit code {proc.exitcode}; run again to resume"
                )
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
