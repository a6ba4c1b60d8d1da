"""The TensorFlow hand-off's copy thread: each batch's device copy issued ahead of the step before it.

Role: on a GPU, TensorFlow orders an eager host->device copy after everything already queued on the compute
stream when the copy is issued, and the issuing thread blocks until the copy is done (docs/design.md "The path
of one batch", its TensorFlow hand-off). Issued from the loop's thread right after step k, the copy of batch k+1
starts only when step k has finished, and the device idles for the copy and the next dispatch. ``CopyThread``
runs the copies on a thread of their own, in submission order, so that the loop can issue the copy of batch k+1
before it dispatches step k and dispatch step k while that copy waits for step k-1 and then runs beside step k.
``Copy`` is one submitted copy: whether it started and completed, and its result.
Invariants:
    * Copies run one at a time, in submission order: a copy starts when the one before it completed.
    * ``Copy.started`` is set just before the copy is called, ``done()`` after it returned or raised.
    * Every wait is bounded: ``result`` raises ``PipelineError`` after ``COPY_TIMEOUT_S``.
Errors: a copy's exception is raised by its ``result``; the thread goes on with the next.
Shutdown: ``close`` (idempotent) cancels the copies not yet started (their ``result`` raises
``PipelineError``) and waits, bounded by ``CLOSE_WAIT_S``, for the one running to end: a copy reads a ring
slot, which must not be unmapped under it. The thread is a daemon: a copy stuck in the driver past that bound
does not hold the process at exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from melfeed.shared.errors import PipelineError

__all__ = ["CLOSE_WAIT_S", "COPY_TIMEOUT_S", "NEXT_COPY_START_S", "Copy", "CopyThread"]

T = TypeVar("T")

COPY_TIMEOUT_S = 600.0  # a copy waits for the steps queued before it: generous, for long steps on a shared GPU
NEXT_COPY_START_S = 1.0  # how long a dispatch waits for the next copy to be issued (overlap only, not safety)
CLOSE_WAIT_S = 60.0  # how long close waits for the copy running: one step queued before it, then the copy


class Copy(Generic[T]):
    """One submitted copy: ``started`` (an event), ``done()`` (never blocks) and ``result(timeout_s)``."""

    def __init__(self, run: Callable[[], T]) -> None:
        self._run = run
        self.started = threading.Event()
        self._finished = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._finished.is_set()

    def wait_started(self, timeout_s: float) -> bool:
        return self.started.wait(timeout_s)

    def result(self, timeout_s: float) -> T:
        if not self._finished.wait(timeout_s):
            raise PipelineError(f"a device copy did not complete within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set before _finished

    def execute(self) -> None:
        self.started.set()
        try:
            self._value = self._run()
        except BaseException as err:  # handed to the caller of result()
            self._error = err
        finally:
            self._finished.set()

    def cancel(self) -> None:
        self._error = PipelineError("the copy thread was closed before this copy started")
        self._finished.set()


class CopyThread:
    """Runs submitted copies one at a time, in order, on a daemon thread started at the first ``submit``."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Copy[object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, run: Callable[[], T]) -> Copy[T]:
        copy = Copy(run)
        with self._lock:
            if self._closed:
                raise PipelineError("the copy thread is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="melfeed-copy", daemon=True)
                self._thread.start()
            self._jobs.put(copy)  # type: ignore[arg-type]  # Copy is invariant in T; the thread ignores T
        return copy

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Cancel the copies not started and wait up to ``timeout_s`` for the one running (it may read a ring
        slot the caller is about to unmap); True when the thread has ended. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def _serve(self) -> None:
        while True:
            copy = self._jobs.get()
            if copy is None:  # close()'s mark: every copy before it was run or cancelled
                return
            if self._closed:
                copy.cancel()
            else:
                copy.execute()
