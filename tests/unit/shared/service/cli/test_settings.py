"""``--set KEY=VALUE`` (after ``--config``, before the dedicated flags, checked by the schema) and
``melfeed config show`` (the effective configuration as YAML)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_to_mapping
from melfeed.shared.errors import ConfigError
from melfeed.shared.service.cli import build_parser, config_from_args

REPO = Path(__file__).resolve().parents[5]


def _cfg(*argv: str) -> PipelineConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_set_values_are_yaml_typed_by_the_schema() -> None:
    cfg = _cfg(
        "run",
        "--set",
        "consumer.steps=null",
        "--set",
        "buckets.batch_size=16",
        "--set",
        'consumer.model_gpu="0"',
        "--set",
        "buckets.boundaries=[100, 200]",
        "--set",
        "model.params={lr: 0.1}",
    )
    assert cfg.consumer.steps is None and cfg.buckets.batch_size == 16 and cfg.consumer.model_gpu == "0"
    assert cfg.buckets.boundaries == (100, 200) and dict(cfg.model.params or {}) == {"lr": 0.1}


def test_set_applies_after_config_and_before_the_dedicated_flags(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("seed: 5\nconsumer:\n  steps: 40\n  ring_slots: 4\n")
    cfg = _cfg(
        "consumer",
        "--config",
        str(config),
        "--set",
        "consumer.steps=60",
        "--set",
        "seed=9",
        "--seed",
        "11",
        "--set",
        "consumer.steps=70",
    )
    assert (cfg.consumer.steps, cfg.seed, cfg.consumer.ring_slots) == (70, 11, 4)  # last --set wins; flag over --set


@pytest.mark.parametrize("command", ["run", "consumer", "producer", "doctor", "bench", "status", "prepare"])
def test_every_command_that_reads_a_config_takes_set(command: str) -> None:
    extra = ["--ljspeech", "/x", "--cache-dir", "/y"] if command == "prepare" else []
    args = build_parser().parse_args([command, *extra, "--set", "seed=3", "--set", "n_mels=64"])
    assert args.set == [("seed", 3), ("n_mels", 64)]


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("consumer.nope=1", "consumer.nope: unknown key (known: "),
        ("nope.steps=1", "nope: unknown key (no such section)"),
        ("seed.x=1", "seed: unknown key (no such section)"),
        ("consumer.steps=many", "consumer.steps: must be an integer, got 'many'"),
        ("consumer.ring_slots=2", "consumer.ring_slots: must be"),
        ("buckets.batch_size=null", "buckets.batch_size: set exactly one of batch_size and frame_budget"),
    ],
)
def test_an_unknown_key_or_a_bad_value_names_the_key(setting: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg("run", "--set", setting)
    assert str(info.value).startswith(needle), str(info.value)


def _main(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "melfeed", *argv], capture_output=True, text=True, timeout=60, cwd=REPO
    )


def test_config_show_prints_every_key_of_the_effective_config(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("consumer:\n  ring_slots: 5\n")
    proc = _main("config", "show", "--config", str(config), "--set", "consumer.steps=null")
    assert proc.returncode == 0, proc.stderr
    expected = config_to_mapping(PipelineConfig())
    expected["consumer"] |= {"ring_slots": 5, "steps": None}
    assert yaml.safe_load(proc.stdout) == expected


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--set", "consumer.steps=x"], "melfeed config: consumer.steps: must be an integer, got 'x'\n"),
        (
            ["--config", "/nonexistent.yaml"],
            "melfeed config: /nonexistent.yaml: cannot read config file: No such file or directory\n",
        ),
    ],
)
def test_config_show_of_a_bad_config_is_one_line_and_exit_78(argv: list[str], line: str) -> None:
    proc = _main("config", "show", *argv)
    assert (proc.returncode, proc.stdout, proc.stderr) == (78, "", line)
