"""The library snippet of README.md runs as written on the demo cache, in one process, importing only melfeed.

The snippet is README.md's "Your own model" section's python block, kept in that one place (the guide links to
it). It writes the demo cache (``melfeed.demo_cache``) and starts its own producers
(``Consumer(cfg, producers=2)``), so it runs alone in a fresh interpreter with a private ``XDG_CACHE_HOME`` and
``XDG_RUNTIME_DIR`` (the default ipc endpoint's directory); no process of it may outlive it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import procs
from tests.conftest import REPO

_SECTION = "## Your own model"


def _blocks(markdown: str, section: str) -> dict[str, str]:
    """The first fenced block of each language in ``section``."""
    body = markdown.split(section, 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S):
        out.setdefault(lang, code)
    return out


def test_the_readme_library_snippet_uses_melfeed_alone() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = _blocks(readme, _SECTION)
    snippet = blocks["python"]
    assert "feed.as_dataset(" in snippet and "feed.batches()" in snippet
    assert readme.count(snippet) == 1
    imported = re.findall(r"^(?:import|from) ([\w.]+)", snippet, flags=re.M)
    assert imported == ["keras", "melfeed"]  # the library's public API only (Keras is the user's model)
    assert "producers=" in snippet and "bash" not in blocks  # no second shell


@pytest.mark.timeout(600)  # demo cache generation + a Keras import on a shared 2-core box
def test_the_readme_library_snippet_runs_as_written_on_the_demo_cache(tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(_blocks((REPO / "README.md").read_text(encoding="utf-8"), _SECTION)["python"], encoding="utf-8")
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "XDG_RUNTIME_DIR": str(tmp_path),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    family: list[procs.Tracked] = []
    try:
        while proc.poll() is None and len(family) < 3:  # its producer group: the supervisor and 2 workers
            family = procs.descendants(proc.pid)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=540)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "applied 30 batches: 0 .. 29" in out, out[-2000:]
    assert family and procs.wait_gone(family) == [], [procs.describe(p) for p in family]
