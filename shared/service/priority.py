"""Lower this process's CPU priority (``producer.nice``): the data side yields the CPU to the step.

Where producers and the training step share cores, the step should win the CPU and producers fill the
idle gaps; the ring (and the lease window) absorbs their delay (docs/design.md "Lifecycle").
Invariants: the niceness only ever goes up here (raising it needs no privilege; lowering does), so a
value set from outside (systemd's ``Nice=``, ``nice -n``) that is already as high is left alone, and
calling this again is a no-op. On Linux the niceness belongs to each thread and is inherited by the
threads it starts: call it first thing in the process's main thread, before ZeroMQ or TensorFlow start
theirs; threads that already run (numpy's BLAS pool starts at import) are raised one by one through
``/proc/self/task``. The consumer never calls it.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["current_nice", "lower_cpu_priority"]

log = logging.getLogger(__name__)


def current_nice() -> int:
    """This thread's niceness (on Linux, the main thread's is the process's ``/proc/PID/stat`` value)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def lower_cpu_priority(nice: int) -> int:
    """Raise this thread's niceness to ``nice`` (0..19) unless it is already at least that.

    Returns:
        The niceness in force afterwards. A refusal (a sandbox without ``setpriority``) is one WARNING,
        never an exit: running at the inherited priority only costs the step some CPU.
    """
    before = current_nice()
    after = before
    for tid in _thread_ids():
        try:
            current = os.getpriority(os.PRIO_PROCESS, tid)
            if nice > current:
                os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: a thread id names that thread alone
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as err:
            log.warning(
                "cannot lower the CPU priority to nice %d (producer.nice): %s; running at nice %d",
                nice,
                err.strerror or err,
                before,
            )
            return before
    after = current_nice()
    if after != before:
        log.debug("CPU priority lowered: nice %d -> %d", before, after)
    return after


def _thread_ids() -> list[int]:
    """Every thread of this process, the calling one first (``/proc/self/task``; just this one without /proc)."""
    me = threading.get_native_id()
    try:
        others = [int(name) for name in os.listdir("/proc/self/task") if int(name) != me]
    except OSError:
        others = []
    return [me, *others]
