"""``UsageWindow`` counts a helper's CPU inside the window only (not its start-up, not its shutdown work), and
its own peak memory, not the page cache of a packed cache it maps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from melfeed.consumer.bench.usage import UsageWindow

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
    proc = subprocess.Popen([sys.executable, "-c", _SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        window = UsageWindow()
        _spin(proc, 0.3)  # start-up work: before the window
        window.open()
        _spin(proc, 0.4)  # the measured work
        window.close()
        _spin(proc, 0.6)  # shutdown work after the window, before the helper is reaped
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    # clock ticks are 10 ms: allow a few of them either side of the 0.4 s spun inside the window
    assert 0.35 <= window.children_cpu_s() <= 0.5
    assert window.wall_s > 0


# A helper that maps ``argv[1]`` whole, reads every page of it, then allocates and touches ``argv[2]`` MB.
_MAPPER = """
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
total = sum(m[i] for i in range(0, len(m), 4096))
own = bytearray(int(sys.argv[2]) << 20)
for i in range(0, len(own), 4096):
    own[i] = 1
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_helpers_peak_memory_leaves_out_the_pages_of_a_mapped_pack_but_not_its_own(tmp_path: Path) -> None:
    mapped_mb, own_mb = 64, 48
    results = {}
    for name in ("cache.pack", "cache.npy"):  # the same file mapped: left out only as a pack
        path = tmp_path / name
        path.write_bytes(b"\1" * (mapped_mb << 20))
        proc = subprocess.Popen(
            [sys.executable, "-c", _MAPPER, str(path), str(own_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            window = UsageWindow()
            window.open()
            window.close()
            results[name] = window.helpers_rss_mb
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=60)
    assert results["cache.npy"] - results["cache.pack"] >= 0.9 * mapped_mb, results
    assert results["cache.pack"] >= own_mb, results  # the helper's own memory still counts
