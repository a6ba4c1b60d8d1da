"""The stop ladder: the pure decisions, and real children that obey or ignore SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import selectors
import signal
import subprocess
import time

import pytest

from melfeed.shared.service.children import python_argv, spawn
from melfeed.shared.service.stop_ladder import (
    Ladder,
    Rung,
    communicate_or_kill,
    escalate,
    next_rung,
    signal_child,
    stop_all,
    stop_process,
)

_READY_S = 60.0  # a child interpreter starting on a loaded 2-core machine stays far below
_GENEROUS_S = 60.0  # a ladder wait that only runs out when something is truly broken
_OBEYS = "import sys, time; print('ready', flush=True); time.sleep(600)"  # default SIGTERM action: dies
_IGNORES = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(600)"
)


def test_next_rung_climbs_term_then_kill_then_gives_up() -> None:
    assert next_rung(None, alive=True) is Rung.TERM
    assert next_rung(Rung.TERM, alive=True) is Rung.KILL
    assert next_rung(Rung.KILL, alive=True) is None  # after SIGKILL's wait: give up, never wait on
    for rung in (None, Rung.TERM, Rung.KILL):
        assert next_rung(rung, alive=False) is None  # every child gone: the ladder ends


def test_each_rung_waits_its_own_named_time() -> None:
    ladder = Ladder(term_wait_s=7.0, kill_wait_s=3.0)
    assert ladder.wait_s(Rung.TERM) == 7.0 and ladder.wait_s(Rung.KILL) == 3.0
    assert Rung.TERM.value == signal.SIGTERM and Rung.KILL.value == signal.SIGKILL


def test_escalate_logs_each_escalation_and_a_give_up(caplog: pytest.LogCaptureFixture) -> None:
    ladder = Ladder(5.0, 2.0)
    with caplog.at_level(logging.WARNING, logger="melfeed.shared.service.stop_ladder"):
        assert escalate("producers", Rung.TERM, ladder, alive=0) is None
        assert not caplog.records  # nothing to escalate, nothing logged
        assert escalate("producers", Rung.TERM, ladder, alive=2) is Rung.KILL
        assert escalate("producers", Rung.KILL, ladder, alive=1) is None
    warning, error = caplog.records
    assert warning.levelno == logging.WARNING and "2 still running 5 s after TERM; sending KILL" in warning.getMessage()
    assert error.levelno == logging.ERROR and "giving up" in error.getMessage()


def _started(code: str, new_group: bool = False) -> subprocess.Popen[str]:
    """A child interpreter that printed 'ready' (its signal disposition is in place), within ``_READY_S``."""
    proc = spawn(python_argv("-c", code), new_group=new_group, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(_READY_S), f"the child printed nothing within {_READY_S} s"
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_a_child_that_exits_on_sigterm_is_not_escalated(caplog: pytest.LogCaptureFixture) -> None:
    proc = _started(_OBEYS)
    with caplog.at_level(logging.WARNING, logger="melfeed.shared.service.stop_ladder"):
        code = stop_process(proc, "obedient child", Ladder(_GENEROUS_S, _GENEROUS_S))
    assert code == -signal.SIGTERM
    assert not caplog.records  # no SIGKILL, no warning
    assert stop_process(proc, "obedient child", Ladder(_GENEROUS_S)) == -signal.SIGTERM  # idempotent


def test_a_child_that_ignores_sigterm_is_killed_after_the_term_wait(caplog: pytest.LogCaptureFixture) -> None:
    proc = _started(_IGNORES)
    term_wait_s = 1.0
    started_s = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="melfeed.shared.service.stop_ladder"):
        code = stop_process(proc, "stubborn child", Ladder(term_wait_s, _GENEROUS_S))
    assert code == -signal.SIGKILL
    assert time.monotonic() - started_s >= term_wait_s  # SIGTERM got its full wait first
    assert any(
        "stubborn child: 1 still running" in r.getMessage() and "sending KILL" in r.getMessage() for r in caplog.records
    )


def test_stop_all_signals_every_child_at_once_and_skips_the_dead() -> None:
    procs = [_started(_OBEYS) for _ in range(2)]
    gone = _started(_OBEYS)
    gone.kill()
    gone.wait(_GENEROUS_S)
    assert stop_all([*procs, gone], "children", Ladder(_GENEROUS_S)) == [
        -signal.SIGTERM,
        -signal.SIGTERM,
        -signal.SIGKILL,
    ]


def test_communicate_or_kill_kills_the_whole_group_past_its_timeout() -> None:
    # The leader starts a grandchild in its group that would keep the pipe open; SIGKILL to the group ends both.
    code = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print('ready', flush=True); time.sleep(600)"
    )
    proc = _started(code, new_group=True)
    out, _, timed_out = communicate_or_kill(proc, "hung probe", 0.5)
    assert timed_out and proc.returncode == -signal.SIGKILL and out == ""


def test_the_asyncio_supervisor_runs_the_same_rungs() -> None:
    """``signal_child`` and ``escalate`` drive an asyncio child the way ``melfeed.producer.supervisor`` does."""

    async def ladder_on_loop() -> tuple[int | None, list[Rung]]:
        proc = await asyncio.create_subprocess_exec(*python_argv("-c", _IGNORES), stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), _READY_S) == b"ready\n"
        ladder, climbed = Ladder(0.5, _GENEROUS_S), []
        rung = next_rung(None, alive=True)
        while rung is not None:
            climbed.append(rung)
            signal_child(proc, rung)
            await asyncio.wait([asyncio.ensure_future(proc.wait())], timeout=ladder.wait_s(rung))
            rung = escalate("stubborn child", rung, ladder, int(proc.returncode is None))
        return proc.returncode, climbed

    code, climbed = asyncio.run(ladder_on_loop())
    assert code == -signal.SIGKILL and climbed == [Rung.TERM, Rung.KILL]
