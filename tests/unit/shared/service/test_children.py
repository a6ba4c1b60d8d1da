"""Child interpreters: their environment, argv, the config file they are handed, and dying with their parent."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shared.service.children import (ENTRY_SCRIPT, REPO_ROOT, Child, child_env, entry_argv, handed_over_config,
                                     module_argv, spawn, write_private_config)
from shared.service.lifecycle import PARENT_PID_ENV
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


def test_child_env_never_passes_on_the_parent_it_was_told_to_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PARENT_PID_ENV, "12345")          # names *our* parent: a child must not follow it
    assert PARENT_PID_ENV not in child_env()
    assert child_env({PARENT_PID_ENV: str(os.getpid())})[PARENT_PID_ENV] == str(os.getpid())


# A command (CommandChildren) -> a child -> a grandchild, each following its parent as bench's trials and doctor's
# probes do; each prints its pid once armed, then waits.
_FOLLOWER = ("import os, subprocess, sys, time; from shared.service.lifecycle import PARENT_PID_ENV, "
             "die_with_named_parent; from shared.service.children import child_env; die_with_named_parent(); "
             "kids = [subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[1], ''], env=child_env({PARENT_PID_ENV: "
             "str(os.getpid())}), stdout=subprocess.PIPE, text=True)] if sys.argv[2] else []; "
             "print(' '.join([str(os.getpid())] + [k.stdout.readline().strip() for k in kids]), flush=True); "
             "time.sleep(300)")
_COMMAND = ("import subprocess, sys, time; from shared.service.children import CommandChildren; "
            "c = CommandChildren('test children').__enter__(); "
            "p = c.spawn([sys.executable, '-c', sys.argv[1], sys.argv[1], 'with a grandchild'], stdout=subprocess.PIPE, "
            "text=True); print(p.stdout.readline().strip(), flush=True); time.sleep(300)")


def test_the_children_of_a_sigkilled_command_and_their_own_children_die_with_it() -> None:
    command = spawn([sys.executable, "-c", _COMMAND, _FOLLOWER], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert command.stdout is not None
        pids = [int(pid) for pid in command.stdout.readline().split()]   # child and grandchild, both armed
        assert len(pids) == 2
        command.kill()                                                   # no handler runs: only PDEATHSIG
        command.wait(_GENEROUS_S)
        deadline = time.monotonic() + _GENEROUS_S
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.02)
        assert not [pid for pid in pids if _running(pid)]
    finally:
        if command.poll() is None:
            command.kill()
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
