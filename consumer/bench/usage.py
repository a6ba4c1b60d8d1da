"""CPU seconds and peak memory of one bench trial: this process and every process below it.

Role: a trial process (``melfeed.consumer.bench.trial``) opens a ``UsageWindow`` after its warm-up batches
and closes it after the last measured batch; ``children_cpu_s()`` then gives the CPU the helper
processes (producers, tf.data service servers) spent inside the window.
How: the trainer's own CPU is ``getrusage(RUSAGE_SELF)`` at both ends. Children are counted the same
way at both ends: ``getrusage(RUSAGE_CHILDREN)`` (children reaped by then) plus utime+stime+cutime+cstime
of every live descendant (from /proc, in clock ticks), so the start-up of helpers (imports,
TensorFlow) and their shutdown after the window are both excluded. Peak memory: the trainer's
``ru_maxrss`` plus the sum of every live descendant's ``VmHWM`` at the end of the window (an upper bound
of the simultaneous total), less the pages of a packed cache a producer maps (``*.pack`` in
/proc/PID/smaps): those are the kernel's page cache, as the files tf.data reads are, not the
producer's memory, and ``VmHWM`` would otherwise count the whole mapped pack once per producer.
Invariants: Linux only (/proc); a descendant that vanishes while being read is skipped.
Shutdown: nothing to release.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

__all__ = ["UsageWindow", "descendants"]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cpu_s(who: int) -> float:
    ru = resource.getrusage(who)
    return ru.ru_utime + ru.ru_stime


def descendants(root: int) -> list[int]:
    """Pids of every live process below ``root`` (children, grandchildren, ...)."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parent_of[int(entry)] = int(fields[1])
    found: list[int] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parent_of.items() if pp == pid]
        found.extend(kids)
        frontier.extend(kids)
    return found


def _tree_cpu_s(pids: list[int]) -> float:
    """utime + stime + cutime + cstime of each pid (seconds); vanished pids count 0."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) * _TICK_S  # fields 14-17 of proc(5)
    return total


def _hwm_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _mapped_pack_mb(pid: int) -> float:
    """Resident pages of the packed caches (``*.pack``) that ``pid`` maps (producer/pack/mapped.py)."""
    total_kb, in_pack = 0, False
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:  # a mapping's header
                    in_pack = line.rstrip().endswith(".pack")
                elif in_pack and line.startswith("Rss:"):
                    total_kb += int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return total_kb / 1024.0


class UsageWindow:
    """Wall time, trainer CPU and helper CPU between ``open()`` and ``close()``."""

    def __init__(self) -> None:
        self._t0 = self._t1 = 0.0
        self._self0 = self._self1 = 0.0
        self._children0 = self._children1 = 0.0
        self.helpers_rss_mb = 0.0

    def open(self) -> None:
        self._t0 = time.perf_counter()
        self._self0 = _cpu_s(resource.RUSAGE_SELF)
        self._children0 = _cpu_s(resource.RUSAGE_CHILDREN) + _tree_cpu_s(descendants(os.getpid()))

    def close(self) -> None:
        """End of the measured batches: wall time, trainer CPU and the helpers' peak memory."""
        self._t1 = time.perf_counter()
        self._self1 = _cpu_s(resource.RUSAGE_SELF)
        live = descendants(os.getpid())
        self._children1 = _cpu_s(resource.RUSAGE_CHILDREN) + _tree_cpu_s(live)
        self.helpers_rss_mb = sum(max(0.0, _hwm_mb(p) - _mapped_pack_mb(p)) for p in live)

    @property
    def wall_s(self) -> float:
        return self._t1 - self._t0

    @property
    def trainer_cpu_s(self) -> float:
        return self._self1 - self._self0

    def children_cpu_s(self) -> float:
        """Helpers' CPU in the window (after ``close``)."""
        return max(0.0, self._children1 - self._children0)

    @staticmethod
    def trainer_rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
