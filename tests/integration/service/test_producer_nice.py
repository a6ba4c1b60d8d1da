"""``producer.nice``: a started producer process runs every thread at that niceness; its unit says ``Nice=``.

A real producer group (``melfeed producer``) with no consumer behind the endpoint: its child
says HELLO forever, which is enough to read the niceness of each of its threads from /proc. The unit
file is checked in tests/unit/shared/service/test_units.py, the setting's bounds in test_config.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from melfeed.shared.service.priority import current_nice
from tests.conftest import ProducerGroup
from tests.procs import child_pids

WAIT_S = 60.0  # bound on the child's start (imports) on a loaded machine; a pass takes ~2 s
NICE = 9


def _thread_nices(pid: int) -> list[int]:
    """The niceness of each thread of ``pid`` (field 19 of /proc/PID/task/TID/stat); [] once it is gone."""
    nices = []
    try:
        for tid in sorted(Path(f"/proc/{pid}/task").iterdir()):
            stat = (tid / "stat").read_text()
            nices.append(int(stat.rsplit(")", 1)[1].split()[16]))
    except (OSError, IndexError):
        return []
    return nices


def test_a_producer_process_runs_all_its_threads_at_producer_nice(
    demo_cache: Path, producers: ProducerGroup, tmp_path: Path
) -> None:
    group = producers.start(demo_cache, f"ipc://{tmp_path}/nobody.sock", 1, producer={"nice": NICE})
    deadline = time.monotonic() + WAIT_S
    seen: list[int] = []
    while True:
        kids = child_pids(group.pid)
        seen = _thread_nices(kids[0]) if kids else []
        if len(seen) >= 3:  # connected: ZeroMQ's I/O threads are up
            break
        assert group.poll() is None and time.monotonic() < deadline, f"no niced producer; threads {seen}"
        time.sleep(0.05)
    assert seen == [NICE] * len(seen), f"a thread kept another priority: {seen}"
    assert current_nice() == 0  # the test process (a consumer here) is untouched
