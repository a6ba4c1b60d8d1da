"""``UsageWindow`` counts a helper's CPU inside the window only: not its start-up, not its shutdown work."""

from __future__ import annotations

import subprocess
import sys

from consumer.bench.usage import UsageWindow

# A helper that burns the CPU seconds it is told on stdin, then says "done" (no wall-clock sleeps).
_SPINNER = """
import sys, time
for line in sys.stdin:
    t0 = time.process_time()
    while time.process_time() - t0 < float(line):
        pass
    print("done", flush=True)
"""


def _spin(proc: subprocess.Popen[str], cpu_s: float) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{cpu_s}\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"


def test_helper_cpu_before_open_and_after_close_is_not_counted() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        window = UsageWindow()
        _spin(proc, 0.3)                 # start-up work: before the window
        window.open()
        _spin(proc, 0.4)                 # the measured work
        window.close()
        _spin(proc, 0.6)                 # shutdown work after the window, before the helper is reaped
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    # clock ticks are 10 ms: allow a few of them either side of the 0.4 s spun inside the window
    assert 0.35 <= window.children_cpu_s() <= 0.5
    assert window.wall_s > 0
