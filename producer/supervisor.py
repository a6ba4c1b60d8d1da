"""Parent of N producer processes (``melfeed producer --producers N``), supervised on uvloop.

Each child is a fresh interpreter (``python -m melfeed.producer.process``; never fork a process that may hold a
ZeroMQ context or TensorFlow). A child that crashes is restarted with exponential back-off (reset
after it stayed up ``_HEALTHY_S``); a child that exits 78 (configuration or contract error) stops
the whole group with 78, so systemd's ``RestartPreventExitStatus=78`` applies. Under
``producer.exit_at_plan_end`` (set by ``run``) a child that exits 0 has finished (the consumer's plan
ended): it is not restarted, and once every child has finished the supervisor exits 0 by itself.
Shutdown ladder on stop (``melfeed.shared.service.stop_ladder``: the same rungs, timeouts and ``escalate``
as every other parent, run here on the event loop): set stop -> SIGTERM every child -> wait
``PRODUCER_LADDER.term_wait_s`` -> SIGKILL -> wait; each escalation is logged. A child whose start was
still under way when the stop came (not yet in the ladder's list) gets the same ladder once started. Children
die with the parent (PR_SET_PDEATHSIG) if the parent is killed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import uvloop

from melfeed.shared.errors import EXIT_CONFIG
from melfeed.shared.service.children import child_env, module_argv
from melfeed.shared.service.lifecycle import PARENT_PID_ENV
from melfeed.shared.service.sdnotify import Notifier
from melfeed.shared.service.stop_ladder import PRODUCER_LADDER, Rung, escalate, next_rung, signal_child

__all__ = ["supervise_producers"]

log = logging.getLogger(__name__)

_HEALTHY_S = 30.0
_BACKOFF_MAX_S = 30.0


class _Group:
    def __init__(
        self,
        config_path: Path,
        count: int,
        backoff_s: float,
        debug_delay_ms: float,
        exit_at_plan_end: bool = False,
        stop: threading.Event | None = None,
    ) -> None:
        self.config_path = config_path
        self.exit_at_plan_end = exit_at_plan_end  # a child's exit 0 is the end of the plan: no restart
        self.count = count
        self.backoff_s = backoff_s
        self.debug_delay_ms = debug_delay_ms
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.exit_code = 0
        self.restarts = 0
        self.finished = 0  # children that exited 0 at the plan's end
        self.stop = stop if stop is not None else threading.Event()  # set by the supervisor's signal handlers

    async def spawn(self, index: int) -> asyncio.subprocess.Process:
        extra = ["--debug-delay-ms", str(self.debug_delay_ms)] if self.debug_delay_ms else []
        argv = module_argv("melfeed.producer.process", "--config", str(self.config_path), "--index", str(index), *extra)
        proc = await asyncio.create_subprocess_exec(*argv, env=child_env({PARENT_PID_ENV: str(os.getpid())}))
        self.procs[index] = proc
        log.info("started producer-%d pid=%d", index, proc.pid)
        return proc

    async def keep_alive(self, index: int, stopping: asyncio.Event) -> None:
        delay_s = self.backoff_s
        while not stopping.is_set():
            started = time.monotonic()
            proc = await self.spawn(index)
            if stopping.is_set():  # the stop came while it started: the ladder may have run without it
                await self.terminate([proc])
                return
            code = await proc.wait()
            if stopping.is_set() or self.stop.is_set():  # a group SIGTERM (Ctrl-C, systemd) reached it first
                return
            if code == EXIT_CONFIG:
                log.error("producer-%d exited %d (configuration error); stopping all producers", index, code)
                self.exit_code = EXIT_CONFIG
                stopping.set()
                return
            if code == 0 and self.exit_at_plan_end:
                log.info("producer-%d finished: the consumer's plan ended", index)
                self.finished += 1
                return
            if time.monotonic() - started > _HEALTHY_S:
                delay_s = self.backoff_s
            log.warning("producer-%d exited with %d; restarting in %.1f s", index, code, delay_s)
            self.restarts += 1
            try:
                await asyncio.wait_for(stopping.wait(), delay_s)
            except TimeoutError:
                pass
            delay_s = min(max(delay_s * 2, 0.5), _BACKOFF_MAX_S)

    async def terminate_all(self) -> None:
        """The stop ladder on every live child at once; ``stopping`` (the first rung) is already set."""
        await self.terminate([p for p in self.procs.values() if p.returncode is None])

    async def terminate(self, live: list[asyncio.subprocess.Process]) -> None:
        """The stop ladder on ``live``: SIGTERM, ``PRODUCER_LADDER``'s wait, SIGKILL, its wait."""
        rung: Rung | None = next_rung(None, alive=bool(live))
        while rung is not None:
            for p in live:
                signal_child(p, rung)
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=PRODUCER_LADDER.wait_s(rung))
            live = [p for p in live if p.returncode is None]
            rung = escalate("producers", rung, PRODUCER_LADDER, len(live))


async def _main(group: _Group, stop: threading.Event, notifier: Notifier) -> int:
    stopping = asyncio.Event()
    tasks = [asyncio.ensure_future(group.keep_alive(i, stopping)) for i in range(1, group.count + 1)]
    notifier.ready(f"supervising {group.count} producers")
    next_status_s = 0.0
    while not stopping.is_set() and not stop.is_set() and group.finished < group.count:
        await asyncio.sleep(0.1)  # the threading.Event is set by a signal handler; poll it cheaply
        notifier.watchdog()  # this loop turning is the supervisor's progress
        if notifier.enabled and time.monotonic() >= next_status_s:
            alive = sum(1 for p in group.procs.values() if p.returncode is None)
            notifier.status(f"{alive}/{group.count} producers alive; {group.restarts} restarts")
            next_status_s = time.monotonic() + 2.0
    if group.finished == group.count:
        log.info("all %d producers finished (the consumer's plan ended); exiting 0", group.count)
    notifier.stopping()
    stopping.set()
    await group.terminate_all()
    # They end once their child is reaped; one whose child was still starting runs the ladder on it itself.
    await asyncio.wait(tasks, timeout=PRODUCER_LADDER.term_wait_s + PRODUCER_LADDER.kill_wait_s)
    return group.exit_code


def supervise_producers(
    config_path: Path,
    count: int,
    stop: threading.Event,
    *,
    backoff_s: float = 1.0,
    debug_delay_ms: float = 0.0,
    notifier: Notifier | None = None,
    exit_at_plan_end: bool = False,
) -> int:
    """Run ``count`` producers until ``stop`` is set, one reports a configuration error or, with
    ``exit_at_plan_end``, every one has exited 0 because the consumer's plan ended.

    Returns:
        0 after a clean stop or the plan's end, 78 when a producer exited with a configuration error.
    """
    group = _Group(config_path, count, backoff_s, debug_delay_ms, exit_at_plan_end, stop)
    return uvloop.run(_main(group, stop, notifier if notifier is not None else Notifier({})))
