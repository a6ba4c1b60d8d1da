"""Lower this process's CPU priority (``producer.nice``): the data side yields the CPU to the step.

Where producers and the training step share cores, the step should win the CPU and producers fill the
idle gaps; the ring (and the lease window) absorbs their delay (docs/ARCHITECTURE.md "Lifecycle").
Invariants: the niceness only ever goes up here (raising it needs no privilege; lowering does), so a
value set from outside (systemd's ``Nice=``, ``nice -n``) that is already as high is left alone, and
calling this again is a no-op. On Linux the niceness belongs to the calling thread and is inherited by
the threads it starts, so call it first thing in the process's main thread, before ZeroMQ or
TensorFlow start theirs. The consumer never calls it.
"""

from __future__ import annotations

import logging
import os

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
    if nice <= before:
        return before
    try:
        after = os.nice(nice - before)
    except OSError as err:
        log.warning("cannot lower the CPU priority to nice %d (producer.nice): %s; running at nice %d",
                    nice, err.strerror or err, before)
        return before
    log.debug("CPU priority lowered: nice %d -> %d", before, after)
    return after
