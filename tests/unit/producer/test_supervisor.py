"""The producer supervisor's restart decisions, with children that are tiny interpreters exiting with a given code.

Under ``exit_at_plan_end`` a child's exit 0 is the plan's end (no restart; all finished: the supervisor
returns 0 by itself); without it (systemd, by hand) an exit 0 is restarted as today.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import uvloop

from producer.supervisor import _Group, _main
from shared.service.sdnotify import Notifier


class _ScriptedGroup(_Group):
    """Child ``index`` exits with the next code of ``codes[index]``; the last code repeats."""

    def __init__(self, codes: dict[int, list[int]], stop: threading.Event, *, exit_at_plan_end: bool,
                 stop_after_spawns: int = 1000) -> None:
        super().__init__(Path("unused.yaml"), len(codes), 0.0, 0.0, exit_at_plan_end)
        self.codes = codes
        self.spawned: list[int] = []
        self._stop, self._stop_after_spawns = stop, stop_after_spawns

    async def spawn(self, index: int) -> asyncio.subprocess.Process:
        code = self.codes[index].pop(0) if len(self.codes[index]) > 1 else self.codes[index][0]
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", f"raise SystemExit({code})")
        self.procs[index] = proc
        self.spawned.append(index)
        if len(self.spawned) >= self._stop_after_spawns:
            self._stop.set()
        return proc


def _supervise(group: _ScriptedGroup, stop: threading.Event) -> int:
    return uvloop.run(_main(group, stop, Notifier({})))


def test_with_exit_at_plan_end_children_exiting_0_are_not_restarted_and_the_group_exits_0_by_itself() -> None:
    stop = threading.Event()
    group = _ScriptedGroup({1: [0], 2: [0]}, stop, exit_at_plan_end=True)
    assert _supervise(group, stop) == 0
    assert not stop.is_set()                                 # nobody stopped it: it ended on its own
    assert sorted(group.spawned) == [1, 2] and group.restarts == 0 and group.finished == 2


def test_with_exit_at_plan_end_a_crash_is_still_restarted_before_the_child_finishes() -> None:
    stop = threading.Event()
    group = _ScriptedGroup({1: [1, 0]}, stop, exit_at_plan_end=True)
    assert _supervise(group, stop) == 0 and not stop.is_set()
    assert group.spawned == [1, 1] and group.restarts == 1


def test_without_it_a_child_exiting_0_is_restarted_until_the_supervisor_is_stopped() -> None:
    stop = threading.Event()
    group = _ScriptedGroup({1: [0]}, stop, exit_at_plan_end=False, stop_after_spawns=3)
    assert _supervise(group, stop) == 0
    assert stop.is_set() and len(group.spawned) >= 3 and group.finished == 0
