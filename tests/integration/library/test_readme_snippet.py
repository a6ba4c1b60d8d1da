"""The library snippet of README.md runs as written on the demo cache, with producers started as it says.

The snippet is taken from README.md's "Your own training loop or model" section (its bash block starts the
producers, its python block is the library code) and must appear verbatim in consumer/README.md too. It
runs in a fresh interpreter with a private ``XDG_CACHE_HOME`` (the producers write the default demo
cache there) and ``XDG_RUNTIME_DIR`` (both sides find the default ipc endpoint there).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

_SECTION = "## Your own training loop or model"
_DEMO_READY_S = 240.0      # the producers write 2000 demo utterances first (~20 s idle, more on a busy CI box)


def _blocks(markdown: str, section: str) -> dict[str, str]:
    """The first fenced block of each language in ``section``."""
    body = markdown.split(section, 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S):
        out.setdefault(lang, code)
    return out


def test_both_readmes_carry_the_same_library_snippet() -> None:
    snippet = _blocks((REPO / "README.md").read_text(encoding="utf-8"), _SECTION)["python"]
    assert "feed.as_dataset(" in snippet and "feed.batches()" in snippet
    assert snippet in (REPO / "consumer" / "README.md").read_text(encoding="utf-8")


@pytest.mark.timeout(600)   # demo cache generation + a Keras import on a shared 2-core box
def test_the_readme_library_snippet_runs_as_written_on_the_demo_cache(tmp_path: Path) -> None:
    blocks = _blocks((REPO / "README.md").read_text(encoding="utf-8"), _SECTION)
    command = shlex.split(blocks["bash"].strip().splitlines()[0].split("#")[0])
    assert command[:2] == ["melfeed", "producer"]
    script = tmp_path / "snippet.py"
    script.write_text(blocks["python"], encoding="utf-8")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_RUNTIME_DIR": str(tmp_path),
           "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    log = (tmp_path / "producers.log").open("wb")
    producers = subprocess.Popen([sys.executable, "-m", *command], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        marker = tmp_path / "cache" / "melfeed" / "demo" / "2000" / "demo.json"   # written last: the cache is complete
        deadline = time.monotonic() + _DEMO_READY_S
        while not marker.exists() and producers.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), (tmp_path / "producers.log").read_text(errors="replace")[-2000:]
        run = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        producers.terminate()
        code = producers.wait(30)
        log.close()
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)   # 360 MB of demo data
    assert run.returncode == 0, run.stderr[-3000:]
    assert "applied 30 batches: 0 .. 29" in run.stdout, run.stdout[-2000:]
    assert code == 0
