"""``model.jit_compile`` and ``model.params``: accepted values, one-line errors naming the key, round trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from melfeed.shared.config import ModelConfig
from melfeed.shared.config.loader import config_from_mapping, config_to_mapping, load_config, with_overrides
from melfeed.shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("text", "want"), [("auto", "auto"), ("true", True), ("false", False), ("'auto'", "auto")])
def test_jit_compile_accepts_auto_true_false_as_written_in_yaml(text: str, want: object) -> None:
    cfg = config_from_mapping(yaml.safe_load(f"model:\n  jit_compile: {text}\n"))
    assert cfg.model.jit_compile == want and type(cfg.model.jit_compile) is type(want)


def test_defaults_are_auto_and_no_params() -> None:
    assert ModelConfig().jit_compile == "auto" and ModelConfig().params == {}
    assert config_from_mapping({"model": {"params": None}}).model.params == {}


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"jit_compile": "xla"}, "model.jit_compile: must be auto, true or false, got 'xla'"),
        ({"jit_compile": 1}, "model.jit_compile: must be auto, true or false, got 1"),
        ({"jit_compile": "True"}, "model.jit_compile: must be auto, true or false, got 'True'"),
        ({"jit_compile": None}, "model.jit_compile: must not be null"),
        ({"params": [1, 2]}, "model.params: must be a mapping (name: value), got [1, 2]"),
        ({"params": "hidden=3"}, "model.params: must be a mapping (name: value), got 'hidden=3'"),
        ({"params": {"layers": {1: "a"}}}, "model.params.layers: keys must be non-empty strings, got 1"),
        (
            {"params": {"fn": print}},
            "model.params.fn: must be made of strings, numbers, booleans, null, lists and "
            "mappings, got 'builtin_function_or_method'",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_key(model: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"model": model})
    assert str(info.value) == message


def test_params_are_copied_plain_and_round_trip_through_yaml() -> None:
    given = {"hidden": 32, "dropout": 0.1, "heads": (4, 4), "decoder": {"prenet": [256, 128], "zoneout": None}}
    cfg = config_from_mapping({"model": {"params": given, "jit_compile": False}})
    given["hidden"] = 64  # the config keeps its own copy
    assert cfg.model.params == {
        "hidden": 32,
        "dropout": 0.1,
        "heads": [4, 4],
        "decoder": {"prenet": [256, 128], "zoneout": None},
    }
    text = yaml.safe_dump(config_to_mapping(cfg))  # what the producers' config file holds
    assert config_from_mapping(yaml.safe_load(text)) == cfg
    assert with_overrides(cfg, {"model.jit_compile": True}).model.params == cfg.model.params
    hash(cfg.model)  # frozen configs stay hashable


def test_bad_jit_compile_in_a_file_exits_78_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  jit_compile: sometimes\n")
    with pytest.raises(ConfigError):
        load_config(path)
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed", "status", "--config", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 78
    assert proc.stderr.strip().splitlines() == [
        "melfeed status: model.jit_compile: must be auto, true or false, got 'sometimes'"
    ]
