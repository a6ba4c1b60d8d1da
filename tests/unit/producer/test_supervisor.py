"""The producer supervisor's restart decisions, with children that are tiny interpreters exiting with a given code.

Under ``exit_at_plan_end`` a child's exit 0 is the plan's end (no restart; all finished: the supervisor
returns 0 by itself); without it (systemd, by hand) an exit 0 is restarted as today. A stop that comes while a
child is still being started stops that child too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import uvloop

from melfeed.producer.supervisor import _Group, _main
from melfeed.shared.service.sdnotify import Notifier
from melfeed.shared.service.stop_ladder import PRODUCER_LADDER


class _ScriptedGroup(_Group):
    """Child ``index`` exits with the next code of ``codes[index]``; the last code repeats."""

    def __init__(
        self,
        codes: dict[int, list[int]],
        stop: threading.Event,
        *,
        exit_at_plan_end: bool,
        stop_after_spawns: int = 1000,
    ) -> None:
        super().__init__(Path("unused.yaml"), len(codes), 0.0, 0.0, exit_at_plan_end, stop)
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


def _supervise(group: _Group, stop: threading.Event) -> int:
    return uvloop.run(_main(group, stop, Notifier({})))


def test_with_exit_at_plan_end_children_exiting_0_are_not_restarted_and_the_group_exits_0_by_itself() -> None:
    stop = threading.Event()
    group = _ScriptedGroup({1: [0], 2: [0]}, stop, exit_at_plan_end=True)
    assert _supervise(group, stop) == 0
    assert not stop.is_set()  # nobody stopped it: it ended on its own
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


def test_a_child_that_exits_0_on_the_supervisors_own_stop_is_not_restarted(caplog: pytest.LogCaptureFixture) -> None:
    """A SIGTERM to the whole group (Ctrl-C, systemd) may end a child before the supervisor's loop sees its stop."""
    stop = threading.Event()
    group = _ScriptedGroup({1: [0]}, stop, exit_at_plan_end=False, stop_after_spawns=1)
    with caplog.at_level(logging.INFO, logger="melfeed.producer.supervisor"):
        assert _supervise(group, stop) == 0
    assert group.spawned == [1] and group.restarts == 0
    assert not [r for r in caplog.records if "restarting" in r.getMessage()]


class _StopWhileStartingGroup(_Group):
    """Its one child is still being started when the stop comes, and only joins ``procs`` after the ladder ran."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__(Path("unused.yaml"), 1, 0.0, 0.0)
        self._stop = stop
        self.ladder_ran: asyncio.Event | None = None
        self.child: asyncio.subprocess.Process | None = None

    async def spawn(self, index: int) -> asyncio.subprocess.Process:
        self.ladder_ran = asyncio.Event()
        self.child = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(300)")
        self._stop.set()  # SIGTERM to the supervisor, as its parent's death sends it
        await self.ladder_ran.wait()  # the ladder ran over the children it knew: not this one
        self.procs[index] = self.child
        return self.child

    async def terminate_all(self) -> None:
        await super().terminate_all()
        assert self.ladder_ran is not None
        self.ladder_ran.set()


def test_a_child_still_starting_when_the_stop_comes_gets_the_ladder_too() -> None:
    stop = threading.Event()
    group = _StopWhileStartingGroup(stop)
    started = time.monotonic()
    try:
        assert _supervise(group, stop) == 0
        assert group.child is not None and group.child.returncode == -signal.SIGTERM  # stopped, not left running
        assert time.monotonic() - started < PRODUCER_LADDER.term_wait_s  # by SIGTERM, not after the tasks' wait
    finally:
        if group.child is not None and group.child.returncode is None:
            os.kill(group.child.pid, signal.SIGKILL)


def test_a_producer_child_ignores_sigint_from_its_first_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in a terminal reaches the supervisor's children too; one still importing printed a KeyboardInterrupt
    traceback. The child ignores SIGINT before it loads anything (its supervisor stops it with SIGTERM)."""
    from melfeed.producer import process
    from melfeed.shared.errors import ConfigError

    seen: list[object] = []

    def load_config(path: str) -> None:
        seen.append(signal.getsignal(signal.SIGINT))
        raise ConfigError("stop here", path=("cache_dir",))

    monkeypatch.setattr("melfeed.shared.config.loader.load_config", load_config)
    monkeypatch.setattr(
        "melfeed.shared.service.lifecycle.die_with_parent", lambda parent_pid=None: None
    )  # not pytest's
    monkeypatch.setattr("melfeed.shared.service.lifecycle.setup_logging", lambda level: None)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert process.main(["--config", "/nonexistent.yaml", "--index", "1"]) == 78
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.SIG_IGN]
