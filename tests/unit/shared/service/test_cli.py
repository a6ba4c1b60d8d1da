"""``--demo`` on ``producer`` and ``run``: the demo cache's directory becomes ``cache_dir``, written if missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cache.demo_data import DEMO_MARKER
from shared.service.cli import build_parser, config_from_args, with_demo_cache


@pytest.mark.parametrize("command", ["producer", "run"])
def test_demo_uses_the_default_demo_dir_and_writes_it_once(command: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = build_parser().parse_args([command, "--demo", "--demo-utterances", "40"])
    cfg = with_demo_cache(args, config_from_args(args))
    expected = tmp_path / "melfeed" / "demo" / "40"
    assert cfg.cache_dir is not None and Path(cfg.cache_dir) == expected
    assert (expected / DEMO_MARKER).exists() and len(list((expected / "mels").glob("*.npy"))) == 40


def test_demo_with_a_cache_dir_writes_the_demo_cache_there(tmp_path: Path) -> None:
    args = build_parser().parse_args(["producer", "--demo", "--demo-utterances", "30", "--cache-dir",
                                      str(tmp_path / "here")])
    cfg = with_demo_cache(args, config_from_args(args))
    assert cfg.cache_dir is not None and Path(cfg.cache_dir) == tmp_path / "here"
    assert (tmp_path / "here" / DEMO_MARKER).exists()


def test_without_demo_the_config_is_left_as_it_is(tmp_path: Path) -> None:
    args = build_parser().parse_args(["producer", "--cache-dir", str(tmp_path)])
    cfg = config_from_args(args)
    assert with_demo_cache(args, cfg) is cfg
    assert not list(tmp_path.iterdir())
