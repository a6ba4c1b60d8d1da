"""Running ``melfeed`` as a user would, to check that a mistake gets one line and exit 78.

``unprivileged=True`` runs it without root's file-permission bypass (``setpriv`` dropping
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), so a read-only or mode-000 directory refuses it as it
would refuse any other user; a test is skipped when neither a non-root user nor ``setpriv`` is there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_DROP_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
_TIMEOUT_S = 120.0  # a refusal takes about a second; only a hang gets near it


def run_cli(
    *args: str, unprivileged: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    prefix: list[str] = []
    if unprivileged and os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv cannot give up its file-permission bypass")
        prefix = _DROP_DAC
    return subprocess.run(
        [*prefix, sys.executable, "-m", "melfeed", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=_TIMEOUT_S,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )


def refusal(proc: subprocess.CompletedProcess[str], command: str) -> str:
    """The one line a refused command printed (exit 78, no traceback), without the ``melfeed CMD: `` head."""
    assert proc.returncode == 78, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    head = f"melfeed {command}: "
    lines = [line for line in proc.stderr.splitlines() if line.startswith(head)]
    assert len(lines) == 1, proc.stderr
    return lines[0][len(head) :]
