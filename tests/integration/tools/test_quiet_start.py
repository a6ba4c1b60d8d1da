"""``melfeed run`` at the default log level prints melfeed's own lines only, and names the step's devices once.

TF_CPP_MIN_LOG_LEVEL is removed from the run's environment (tests/conftest.py sets it for every other test),
so what is checked is the ``melfeed`` command's own default. On a host without a GPU driver TensorFlow's
loading logs ``cudart_stub.cc ... Could not find cuda drivers`` (INFO) and ``failed call to cuInit ... (303)``
(ERROR); on any host ``cpu_feature_guard.cc`` (INFO) and XLA's service lines: none may show.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

_TF_NATIVE = re.compile(r"^[IWEF]\d{4} |cuda|cuInit|absl::InitializeLog")
_MELFEED_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


@pytest.mark.timeout(600)  # demo cache + TensorFlow import + compile on a shared 2-core box
def test_run_prints_no_tensorflow_log_line_and_names_the_step_devices(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_RUNTIME_DIR=str(tmp_path))
    # The default compile mode (auto: XLA tried, timed against graph mode) on one shape: every kind of TensorFlow
    # start-up and compile line can appear, at one compile's cost.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "run",
            "--demo",
            "--demo-utterances",
            "300",
            "--steps",
            "50",
            "--set",
            "buckets.max_shapes=1",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=570,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line for line in lines if _TF_NATIVE.search(line)] == []
    assert [line for line in lines if not _MELFEED_LINE.match(line)] == []  # nothing but melfeed's log lines
    devices = [line for line in lines if "melfeed.consumer.train.loop: step devices: " in line]
    assert len(devices) == 1 and re.search(r"step devices: /device:(CPU|GPU):0", devices[0]), devices
