"""``--demo`` on ``producer`` and ``run``: the demo cache's directory becomes ``cache_dir``, written if missing;
a bad flag is a configuration error like any other (one line, exit 78)."""

from __future__ import annotations

import subprocess
import sys
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


@pytest.mark.parametrize(("argv", "needle"), [
    (["run", "--steps", "x"], "run_pipeline.py run: argument --steps: invalid int value: 'x'"),
    (["deploy", "--producers", "two"], "run_pipeline.py deploy: argument --producers: invalid int value: 'two'"),
    (["bench", "--no-such-flag"], "run_pipeline.py: unrecognized arguments: --no-such-flag"),
    (["launch"], "run_pipeline.py: argument command: invalid choice: 'launch'"),
    ([], "run_pipeline.py: the following arguments are required: command"),
])
def test_a_bad_flag_is_one_line_naming_it_and_exit_78(argv: list[str], needle: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 78 and err.startswith(needle) and err.count("\n") == 1, err


def test_the_jax_client_refuses_a_bad_flag_the_same_way() -> None:
    proc = subprocess.run([sys.executable, "-m", "consumer.clients.jax_bench", "--depths"], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parents[4])
    assert proc.returncode == 78
    assert proc.stderr == "python -m consumer.clients.jax_bench: argument --depths: expected one argument (see --help)\n"
