"""shared/service/priority.py: the niceness only goes up, to the value asked, and again is a no-op.

Run in a fresh interpreter: a niceness cannot be lowered back, so the test process must keep its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from melfeed.shared.service.priority import lower_cpu_priority

REPO = Path(__file__).resolve().parents[4]


def _in_child(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_lowering_sets_the_value_once_and_never_raises_the_priority_back() -> None:
    code = (
        "from melfeed.shared.service.priority import lower_cpu_priority as f, current_nice as c;"
        "print(c(), f(5), f(5), f(3), c())"
    )
    assert _in_child(code) == ["0", "5", "5", "5", "5"]


def test_a_niceness_set_from_outside_that_is_higher_is_kept() -> None:
    code = "import os; os.nice(12); from melfeed.shared.service.priority import lower_cpu_priority as f; print(f(4))"
    assert _in_child(code) == ["12"]


def test_the_default_is_a_no_op() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert lower_cpu_priority(0) == before and os.getpriority(os.PRIO_PROCESS, 0) == before


def test_threads_that_already_run_are_lowered_too() -> None:
    # a thread started before the call (as numpy's BLAS pool is, at import) must not keep nice 0
    code = (
        "import os, threading; ready = threading.Event(); done = threading.Event();"
        "t = threading.Thread(target=lambda: (ready.set(), done.wait(30))); t.start(); ready.wait(30);"
        "from melfeed.shared.service.priority import lower_cpu_priority as f; f(7);"
        "print(os.getpriority(os.PRIO_PROCESS, t.native_id)); done.set(); t.join()"
    )
    assert _in_child(code) == ["7"]
