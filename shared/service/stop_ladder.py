"""The stop ladder for child processes: set stop -> SIGTERM -> wait -> SIGKILL -> wait, each escalation logged.

Role: the one definition of how a parent stops the interpreters it spawned. ``next_rung`` is the
pure decision (what comes after a rung, given whether a child is still running); ``escalate``
applies it and logs; ``stop_all`` / ``stop_process`` run the ladder for ``subprocess.Popen``
children (with ``group``: on each child's whole process group, until no member of it runs, even once
its lead has exited: a helper orphaned by a dead lead keeps the group, ``is_group_alive``); the asyncio supervisor
(``producer/supervisor.py``) runs the same rungs with the same
``escalate`` on its own loop. ``communicate_or_kill`` bounds a child whose output is awaited (a
probe, a bench trial): past its timeout the child's process group is killed.
Invariants: nothing blocks forever (docs/design.md, invariant 6): every wait takes a named
timeout, and after SIGKILL's bounded wait the ladder gives up (logged as an error) instead of
waiting on. Setting the caller's own stop flag (so an expected exit is not taken for a crash) is the
ladder's first step and stays with the caller. Signals to a child that is already gone are ignored.
Shutdown: nothing to shut down; nothing here starts a process.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "Rung",
    "Ladder",
    "PRODUCER_LADDER",
    "GROUP_LADDER",
    "SERVER_LADDER",
    "KILL_WAIT_S",
    "next_rung",
    "escalate",
    "signal_child",
    "is_group_alive",
    "stop_all",
    "stop_process",
    "communicate_or_kill",
]

log = logging.getLogger(__name__)

_PRODUCER_TERM_S = 10.0  # > one batch build + BYE; below systemd's TimeoutStopSec
_GROUP_TERM_S = 20.0  # > a producer group's own ladder (_PRODUCER_TERM_S) + BYE
_SERVER_TERM_S = 10.0  # > a tf.data service server's shutdown (it keeps no state worth saving)
KILL_WAIT_S = 10.0  # > the kernel reaping a SIGKILLed process, even on a loaded 2-core machine
_GROUP_POLL_S = 0.02  # a group whose lead is reaped has nothing to wait on: looked at again this often


class Rung(enum.Enum):
    """One step of the ladder: the signal it sends."""

    TERM = signal.SIGTERM
    KILL = signal.SIGKILL


@dataclass(frozen=True, slots=True)
class Ladder:
    """How long each rung waits for the children to exit before the next one."""

    term_wait_s: float
    kill_wait_s: float = KILL_WAIT_S

    def wait_s(self, rung: Rung) -> float:
        return self.term_wait_s if rung is Rung.TERM else self.kill_wait_s


PRODUCER_LADDER = Ladder(_PRODUCER_TERM_S, _PRODUCER_TERM_S)  # the uvloop supervisor's children
GROUP_LADDER = Ladder(_GROUP_TERM_S, _GROUP_TERM_S)  # ``melfeed producer`` as one child
SERVER_LADDER = Ladder(_SERVER_TERM_S, _SERVER_TERM_S)  # bench's tf.data service servers


def next_rung(rung: Rung | None, alive: bool) -> Rung | None:
    """The ladder's decision: None (not started) -> TERM -> KILL -> None (give up); None once none is alive."""
    if not alive:
        return None
    if rung is None:
        return Rung.TERM
    return Rung.KILL if rung is Rung.TERM else None


def escalate(what: str, rung: Rung, ladder: Ladder, alive: int) -> Rung | None:
    """``next_rung`` after ``rung`` waited its time with ``alive`` children still running, logged."""
    following = next_rung(rung, alive > 0)
    if following is not None:
        log.warning(
            "%s: %d still running %.0f s after %s; sending %s",
            what,
            alive,
            ladder.wait_s(rung),
            rung.name,
            following.name,
        )
    elif alive:
        log.error("%s: %d still running %.0f s after SIGKILL; giving up on them", what, alive, ladder.wait_s(rung))
    return following


class _Signalable(Protocol):
    @property
    def pid(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def signal_child(proc: _Signalable, rung: Rung, *, group: bool = False) -> None:
    """Send ``rung``'s signal to ``proc`` (its whole process group with ``group``); a gone child is fine."""
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, rung.value)
        else:
            proc.send_signal(rung.value)


def is_group_alive(pgid: int) -> bool:
    """A process of group ``pgid`` still runs. Zombies do not count: an orphan's may wait on a parent (PID 1 in
    a container) that never reaps it, and it can neither run nor hold anything."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False  # the cheap answer, and the usual one
    except PermissionError:
        return True
    try:
        pids = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return True  # no /proc: killpg found a member
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _is_running(proc: subprocess.Popen[Any], group: bool) -> bool:
    return proc.poll() is None or (group and is_group_alive(proc.pid))


def stop_all(
    procs: Sequence[subprocess.Popen[Any]], what: str, ladder: Ladder, *, group: bool = False, first: Rung = Rung.TERM
) -> list[int | None]:
    """Run the ladder from ``first`` on every live child at once; returns their exit codes (None: gave up).

    ``group``: each child leads its own process group (pgid = its pid); a child counts as live while any
    member of its group runs, so the ladder reaches helpers its lead left behind when it died.
    """
    live = [p for p in procs if _is_running(p, group)]
    rung: Rung | None = first if live else None
    while rung is not None:
        for p in live:
            signal_child(p, rung, group=group)
        deadline_s = time.monotonic() + ladder.wait_s(rung)
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline_s - time.monotonic()))
        while group and time.monotonic() < deadline_s and any(is_group_alive(p.pid) for p in live):
            time.sleep(_GROUP_POLL_S)  # members that are not our children: nothing to wait() on
        live = [p for p in live if _is_running(p, group)]
        rung = escalate(what, rung, ladder, len(live))
    return [p.returncode for p in procs]


def stop_process(
    proc: subprocess.Popen[Any], what: str, ladder: Ladder, *, group: bool = False, first: Rung = Rung.TERM
) -> int | None:
    """``stop_all`` for one child. Idempotent: a reaped child is left alone and its exit code returned."""
    return stop_all([proc], what, ladder, group=group, first=first)[0]


def communicate_or_kill(proc: subprocess.Popen[str], what: str, timeout_s: float) -> tuple[str, str, bool]:
    """``proc``'s stdout and stderr, and True if it ran past ``timeout_s`` and its process group was killed.

    ``proc`` must lead its own process group (``spawn(..., new_group=True)``), so its helpers die with it.
    """
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return out, err, False
    except subprocess.TimeoutExpired:
        log.warning("%s: no result within %.0f s; killing its process group", what, timeout_s)
    signal_child(proc, Rung.KILL, group=True)
    try:
        out, err = proc.communicate(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # a helper left the group and holds the pipes open
        log.error("%s: output still open %.0f s after SIGKILL; giving up on it", what, KILL_WAIT_S)
        out, err = "", ""
    return out, err, True
