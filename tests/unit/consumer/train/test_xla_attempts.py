"""XLA attempts in the state directory (pure file logic): open while compiling, crashed when found open at start."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from melfeed.consumer.train.xla_attempts import ATTEMPTS_NAME, XlaAttempts, step_key
from melfeed.shared.config.loader import config_from_mapping


def test_an_attempt_is_on_disk_while_it_runs_and_cleared_when_it_returns_or_raises(tmp_path: Path) -> None:
    attempts = XlaAttempts(tmp_path, "m:f params 1 xla ns")
    with attempts.compiling("bucket A"):
        assert json.loads((tmp_path / ATTEMPTS_NAME).read_text())["open"] == {
            "step": "m:f params 1 xla ns",
            "program": "bucket A",
            "pid": os.getpid(),
        }
    assert json.loads((tmp_path / ATTEMPTS_NAME).read_text())["open"] is None
    with pytest.raises(ValueError), attempts.compiling("bucket B"):
        raise ValueError("XLA cannot compile it")  # a Python-level failure: not a crash
    assert XlaAttempts(tmp_path, "m:f params 1 xla ns").crash_reason() is None


def test_an_attempt_left_open_is_a_crash_of_that_step_only_until_the_file_is_deleted(tmp_path: Path) -> None:
    (tmp_path / ATTEMPTS_NAME).write_text(
        json.dumps({"open": {"step": "m:f params 1 xla ns", "program": "bucket A"}, "crashed": []})
    )
    reason = XlaAttempts(tmp_path, "m:f params 1 xla ns").crash_reason()
    assert reason == (
        f"an earlier start died compiling it with XLA (bucket A; {tmp_path / ATTEMPTS_NAME}: delete it "
        "to try XLA again)"
    )
    assert XlaAttempts(tmp_path, "m:f params 1 xla ns").crash_reason() == reason  # kept for later starts
    assert XlaAttempts(tmp_path, "m:f params 2 xla ns").crash_reason() is None  # another step tries XLA
    (tmp_path / ATTEMPTS_NAME).unlink()
    assert XlaAttempts(tmp_path, "m:f params 1 xla ns").crash_reason() is None


def test_a_damaged_file_is_ignored_with_a_warning_and_no_state_dir_records_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / ATTEMPTS_NAME).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert XlaAttempts(tmp_path, "s").crash_reason() is None
    assert any("ignoring" in r.getMessage() for r in caplog.records)
    none = XlaAttempts(None, "s")
    with none.compiling("bucket A"):
        pass
    assert none.crash_reason() is None and none.path is None


def test_the_step_key_names_the_factory_its_params_and_the_xla_cache_namespace() -> None:
    cfg = config_from_mapping({"model": {"step": "m:f", "params": {"hidden": 8}}})
    other = config_from_mapping({"model": {"step": "m:f", "params": {"hidden": 9}}})
    cached = {"TF_XLA_FLAGS": "--tf_xla_persistent_cache_directory=/s/xla-cache/tf2.21.0-cpu-flagsab-stepcd"}
    key = step_key(cfg, cached)
    assert key.startswith("m:f params ") and key.endswith(" xla tf2.21.0-cpu-flagsab-stepcd")
    assert step_key(cfg, cached) != step_key(other, cached)
    assert step_key(cfg, {}) != step_key(cfg, {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
