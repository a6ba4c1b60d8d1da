"""An XLA compile that kills the process (SIGABRT, as a check failure inside TensorFlow's XLA compiler does)
costs one start: the attempt was recorded in the state directory before it began, so the next ``melfeed run``
trains the step in graph mode, says why once, and applies every batch exactly once.

The step (``tests.steps:xla_abort_step``) calls ``os.abort()`` when it is traced for XLA, which is inside the
recorded attempt; graph mode trains it. ``melfeed run`` trains in its own process (no child to restart), so the crash
ends that invocation (exit by SIGABRT) and the restart is the next start (systemd's ``Restart=on-failure``).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from melfeed.consumer.resume.audit import audit_state_dir
from melfeed.consumer.train.xla_attempts import ATTEMPTS_NAME
from tests import procs

_STEP = "tests.steps:xla_abort_step"
_STEPS = 20
_RUN_TIMEOUT_S = 300  # a TensorFlow start and a graph-mode compile of the tiny step on a loaded 2-core machine


def _run(config: Path, summary: Path) -> subprocess.CompletedProcess[str]:
    command = procs.command("run", config, "--producers", "1", "--steps", str(_STEPS), "--summary-json", str(summary))
    return subprocess.run(
        ["sh", "-c", 'ulimit -c 0; exec "$@"', "sh", *command],
        cwd=procs.REPO,
        text=True,
        env=procs.env(config.parent),
        capture_output=True,
        timeout=_RUN_TIMEOUT_S,
    )


def test_a_crashing_xla_compile_costs_one_start_then_the_run_trains_in_graph_mode(
    demo_cache: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    config = procs.write_config(
        tmp_path / "run.yaml",
        demo_cache,
        f"ipc://{tmp_path}/s.sock",
        state,
        _STEPS,
        consumer={"feed_efficiency_steps": 0},
        buckets={"num_buckets": 1, "batch_size": 16},  # one program: the crash comes at the first XLA trace
        model={"step": _STEP, "jit_compile": "auto"},
    )
    summary = tmp_path / "summary.json"
    crashed = _run(config, summary)
    assert crashed.returncode == -signal.SIGABRT, crashed.stderr[-3000:]
    opened = json.loads((state / ATTEMPTS_NAME).read_text())["open"]
    assert opened["step"].startswith(f"{_STEP} params ") and opened["program"].startswith("bucket {'mel': (")

    proc = _run(config, summary)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if " WARNING melfeed.consumer.train" in line]
    assert len(warnings) == 1, warnings
    assert (
        f"XLA is not tried for the step of {_STEP}, using graph mode: an earlier start died compiling it "
        f"with XLA (bucket {{'mel': ("
        in warnings[0]
        and f"{state / ATTEMPTS_NAME}: delete it" in warnings[0]
    )
    s = json.loads(summary.read_text())
    assert s["jit_compile"] == "graph" and s["error"] is None
    assert s["jit_reason"].startswith("XLA not tried: an earlier start died compiling it with XLA (bucket ")
    audit = audit_state_dir(state)
    assert audit.ok and s["steps"] == s["batches_applied"] == audit.applied == _STEPS
