"""The public API: ``melfeed.__all__`` names exactly what a library user imports, and each name resolves.

Importing ``melfeed`` and using every public name loads no TensorFlow (a fresh interpreter: this test session
may have imported it already).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import melfeed
from melfeed.consumer.feed import Batch, Consumer
from melfeed.consumer.feed_board import FeedBoard
from melfeed.consumer.fit_resume import FitResume
from melfeed.consumer.staging import Stager
from melfeed.shared import errors
from melfeed.shared.config.loader import config_from_mapping, load_config

_ROOT = Path(__file__).resolve().parents[2]


def test_all_names_the_public_api_and_each_name_is_the_object_itself() -> None:
    assert melfeed.__all__ == [
        "Consumer",
        "Batch",
        "Stager",
        "FitResume",
        "FeedBoard",
        "load_config",
        "config_from_mapping",
        "demo_cache",
        "PipelineError",
        "ConfigError",
        "CacheError",
        "ClosedError",
        "DataError",
        "StepError",
        "__version__",
    ]
    assert (melfeed.Consumer, melfeed.Batch, melfeed.Stager, melfeed.FitResume, melfeed.FeedBoard) == (
        Consumer,
        Batch,
        Stager,
        FitResume,
        FeedBoard,
    )
    assert (melfeed.load_config, melfeed.config_from_mapping) == (load_config, config_from_mapping)
    for name in ("PipelineError", "ConfigError", "CacheError", "ClosedError", "DataError", "StepError"):
        assert getattr(melfeed, name) is getattr(errors, name)
        assert issubclass(getattr(melfeed, name), melfeed.PipelineError)
    assert set(melfeed.__all__) <= set(dir(melfeed))
    with pytest.raises(AttributeError, match="no attribute 'Receiver'"):
        melfeed.Receiver  # noqa: B018


def test_the_version_is_written_once_and_pyproject_reads_it_from_melfeed() -> None:
    pyproject = tomllib.loads((_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "melfeed.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", melfeed.__version__)


def test_import_melfeed_and_its_public_names_load_no_tensorflow() -> None:
    code = (
        "import sys, melfeed\n"
        "for name in melfeed.__all__: getattr(melfeed, name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_demo_cache_writes_the_demo_cache_once_and_returns_its_directory(tmp_path: Path) -> None:
    path = melfeed.demo_cache(20, cache_dir=tmp_path / "demo")
    assert path == tmp_path / "demo" and (path / "demo.json").is_file()
    cfg = melfeed.config_from_mapping({"cache_dir": str(path)})
    feed = melfeed.Consumer(cfg)
    feed.close()  # never started: nothing bound; its slot files removed
    assert sorted(e.name for e in feed.extras) == ["energy", "speaker"]  # extras=True, as --demo
    marker = (path / "demo.json").stat().st_mtime_ns
    assert melfeed.demo_cache(20, cache_dir=path) == path and (path / "demo.json").stat().st_mtime_ns == marker


def test_demo_cache_default_directory_follows_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert melfeed.demo_cache(10) == tmp_path / "melfeed" / "demo" / "10"
    with pytest.raises(melfeed.ConfigError, match=r"demo_cache\(utterances\): must be in 1\.\.1000000, got 0"):
        melfeed.demo_cache(0)
