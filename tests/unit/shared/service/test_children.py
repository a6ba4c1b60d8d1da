"""Child interpreters: their environment, argv, and the config file they are handed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.service.children import (ENTRY_SCRIPT, REPO_ROOT, Child, child_env, entry_argv, handed_over_config,
                                     module_argv, spawn, write_private_config)
from shared.service.stop_ladder import Ladder

_GENEROUS_S = 60.0


def test_child_env_puts_the_repo_first_and_drops_what_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/melfeed")
    env = child_env({"XDG_RUNTIME_DIR": "/tmp/x"}, drop=("RUNTIME_DIRECTORY",))
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]
    assert env["XDG_RUNTIME_DIR"] == "/tmp/x" and "RUNTIME_DIRECTORY" not in env


def test_argv_is_a_fresh_interpreter_never_a_fork() -> None:
    assert module_argv("producer.process", "--index", "1") == [sys.executable, "-m", "producer.process", "--index",
                                                                "1"]
    assert entry_argv("producer", "--config", "c.yaml") == [sys.executable, str(ENTRY_SCRIPT), "producer", "--config",
                                                            "c.yaml"]
    assert ENTRY_SCRIPT.is_file()


def test_handed_over_config_is_private_complete_and_removed_after(tmp_path: Path) -> None:
    mapping = {"cache_dir": "/data/cache", "producer": {"count": 3}}
    with handed_over_config(mapping, "run-1.yaml", tmp_path) as path:
        assert path == tmp_path / "run-1.yaml"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert yaml.safe_load(path.read_text()) == mapping
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run-1.yaml"]   # no temporary file left
    assert not path.exists()


def test_handed_over_config_is_removed_when_the_block_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), handed_over_config({"a": 1}, "c.yaml", tmp_path) as path:
        raise RuntimeError("child failed to start")
    assert not path.exists()


def test_a_value_shared_by_two_keys_is_written_twice_not_as_an_alias(tmp_path: Path) -> None:
    shared = [400, 800]
    path = write_private_config({"a": shared, "b": shared}, "c.yaml", tmp_path)
    text = path.read_text()
    assert "&" not in text and "*" not in text, text
    assert yaml.safe_load(text) == {"a": [400, 800], "b": [400, 800]}


def test_a_leftover_temporary_file_does_not_widen_the_mode(tmp_path: Path) -> None:
    (tmp_path / ".c.yaml.tmp").write_text("old")
    (tmp_path / ".c.yaml.tmp").chmod(0o644)
    path = write_private_config({"a": 1}, "c.yaml", tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and yaml.safe_load(path.read_text()) == {"a": 1}


def test_the_default_directory_is_the_private_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = write_private_config({"a": 1}, "c.yaml")
    assert path == tmp_path / "melfeed" / "c.yaml"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_child_stop_sets_stopping_reaps_and_removes_its_config(tmp_path: Path) -> None:
    config = write_private_config({"a": 1}, "c.yaml", tmp_path)
    proc = spawn(module_argv("shared.service.children"), stdout=subprocess.DEVNULL)   # imports, then exits 0
    with Child(proc, "child", Ladder(_GENEROUS_S), config_path=config) as child:
        assert proc.wait(_GENEROUS_S) == 0                  # found the repo's packages through child_env
    assert child.stopping and proc.returncode == 0 and not config.exists()
    assert child.stop() == 0                                # idempotent
