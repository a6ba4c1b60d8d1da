"""Ctrl-C while a rank waits for the others to join: the join holds the GIL, so only the signal's default
action can end it before ``consumer.collective_timeout_s``; after the join the handlers are the previous ones."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from melfeed.consumer.job.cluster import ended_by_signals

# A wait in C that holds the GIL, as TensorFlow's join does: the sum never returns to the eval loop.
_WAIT_HOLDING_THE_GIL = """
import sys
from melfeed.consumer.job.cluster import ended_by_signals
with ended_by_signals():
    print("waiting", flush=True)
    sum(range(10 ** 13))
"""


def test_sigint_ends_a_wait_that_holds_the_gil_at_once() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _WAIT_HOLDING_THE_GIL], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
        started_s = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert code == -signal.SIGINT  # a shell shows 130
    assert time.monotonic() - started_s < 10


def test_the_previous_handlers_come_back_after_the_block() -> None:
    def handler(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ended_by_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is handler and signal.getsignal(signal.SIGTERM) is handler
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)
