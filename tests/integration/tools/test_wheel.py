"""The wheel holds the one import package ``melfeed`` and works installed outside the checkout.

Built without build isolation (setuptools from the environment, ~5 s) from a copy of this checkout's files, so
that setuptools' build/ directory (which keeps files deleted from the source) neither feeds the wheel nor is
left in the checkout; installed with ``pip install --target`` into a private directory, and imported from
another directory with only that directory on ``PYTHONPATH``, so nothing of the checkout can be imported by accident.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import melfeed
from tests.conftest import REPO


@pytest.mark.timeout(300)
def test_the_wheel_installs_melfeed_alone_and_its_api_and_command_work_from_elsewhere(tmp_path: Path) -> None:
    version = melfeed.__version__  # pyproject.toml's dynamic version
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache"),
    )
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("melfeed-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {name.split("/", 1)[0] for name in names} == {"melfeed", f"melfeed-{version}.dist-info"}
    assert "melfeed/deploy/example.yaml" in names and "melfeed/consumer/producer_group.py" in names
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    api = subprocess.run(
        [sys.executable, "-c", "import melfeed; melfeed.Consumer; print(melfeed.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert api.returncode == 0, api.stderr[-3000:]
    assert Path(api.stdout.strip()).is_relative_to(target)
    command = subprocess.run(
        [sys.executable, "-m", "melfeed", "--help"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )
    assert command.returncode == 0, command.stderr[-3000:]
    assert "usage: melfeed" in command.stdout
