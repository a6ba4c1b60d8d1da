"""Tests for ``run_pipeline.py index`` progress: plain lines on stderr when not a terminal, results on stdout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.cache.demo_data import write_demo_cache

REPO = Path(__file__).resolve().parents[4]
N = 12


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "cache"
    write_demo_cache(path, n_utterances=N)
    (path / "manifest.json").unlink()
    return path


def _index(cache: Path, progress_s: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "index", str(cache)],
                          capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MELFEED_PROGRESS_S": progress_s})


def _progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("index: ")]  # log lines share stderr


def test_index_prints_progress_lines_to_stderr_when_not_a_terminal(cache: Path) -> None:
    proc = _index(cache, "0")  # every header read is due: one line each, then the final line
    assert proc.returncode == 0, proc.stderr
    lines = _progress_lines(proc.stderr)
    assert [line.split(" ")[1] for line in lines] == [f"{d}/{N}" for d in range(1, N + 1)] + [f"{N}/{N}"]
    assert all(" utterances/s, eta " in line for line in lines), lines
    assert lines[-1].startswith(f"index: {N}/{N} (100%) ")
    assert "\r" not in proc.stderr and "\x1b" not in proc.stderr
    assert proc.stdout.startswith(f"indexed {N} utterances")


def test_index_with_the_default_interval_prints_only_the_final_line(cache: Path) -> None:
    proc = _index(cache, "")
    assert proc.returncode == 0, proc.stderr
    lines = _progress_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"index: {N}/{N} (100%) "), proc.stderr


def test_a_bad_progress_interval_is_one_line_naming_the_variable(cache: Path) -> None:
    proc = _index(cache, "soon")
    assert proc.returncode == 78
    assert proc.stderr.splitlines() == [
        "run_pipeline.py index: MELFEED_PROGRESS_S: must be a number of seconds >= 0, got 'soon'"]
