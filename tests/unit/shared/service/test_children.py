"""Child interpreters: their environment, argv, the config file they are handed, and dying with their parent."""

from __future__ import annotations

import os
import selectors
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from melfeed.shared.service.children import (
    Child,
    CommandChildren,
    Interrupted,
    child_env,
    entry_argv,
    handed_over_config,
    module_argv,
    python_argv,
    spawn,
    write_private_config,
)
from melfeed.shared.service.lifecycle import PARENT_PID_ENV
from melfeed.shared.service.stop_ladder import Ladder

_GENEROUS_S = 60.0


def test_child_env_keeps_the_path_as_it_is_and_drops_what_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/melfeed")
    env = child_env({"XDG_RUNTIME_DIR": "/tmp/x"}, drop=("RUNTIME_DIRECTORY",))
    assert env["PYTHONPATH"] == "/elsewhere"  # a child imports melfeed from where its parent did
    assert env["XDG_RUNTIME_DIR"] == "/tmp/x" and "RUNTIME_DIRECTORY" not in env


def test_argv_is_a_fresh_interpreter_never_a_fork() -> None:
    assert module_argv("melfeed.producer.process", "--index", "1") == [
        sys.executable,
        "-m",
        "melfeed.producer.process",
        "--index",
        "1",
    ]
    assert entry_argv("producer", "--config", "c.yaml") == [
        sys.executable,
        "-m",
        "melfeed",
        "producer",
        "--config",
        "c.yaml",
    ]


def test_handed_over_config_is_private_complete_and_removed_after(tmp_path: Path) -> None:
    mapping = {"cache_dir": "/data/cache", "producer": {"count": 3}}
    with handed_over_config(mapping, "run-1.yaml", tmp_path) as path:
        assert path == tmp_path / "run-1.yaml"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert yaml.safe_load(path.read_text()) == mapping
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run-1.yaml"]  # no temporary file left
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
    proc = spawn(module_argv("melfeed.shared.service.children"), stdout=subprocess.DEVNULL)  # imports, then exits 0
    with Child(proc, "child", Ladder(_GENEROUS_S), config_path=config) as child:
        assert proc.wait(_GENEROUS_S) == 0  # found the repo's packages through child_env
    assert child.stopping and proc.returncode == 0 and not config.exists()
    assert child.stop() == 0  # idempotent


def test_child_env_never_passes_on_the_parent_it_was_told_to_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PARENT_PID_ENV, "12345")  # names *our* parent: a child must not follow it
    assert PARENT_PID_ENV not in child_env()
    assert child_env({PARENT_PID_ENV: str(os.getpid())})[PARENT_PID_ENV] == str(os.getpid())


# A command (CommandChildren) -> a child -> a grandchild, each following its parent as bench's trials and doctor's
# probes do; each prints its pid once armed, then waits.
_FOLLOWER = (
    "import os, subprocess, sys, time; from melfeed.shared.service.lifecycle import PARENT_PID_ENV, "
    "die_with_named_parent; from melfeed.shared.service.children import child_env; die_with_named_parent(); "
    "kids = [subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[1], ''], env=child_env({PARENT_PID_ENV: "
    "str(os.getpid())}), stdout=subprocess.PIPE, text=True)] if sys.argv[2] else []; "
    "print(' '.join([str(os.getpid())] + [k.stdout.readline().strip() for k in kids]), flush=True); "
    "time.sleep(300)"
)
_COMMAND = (
    "import subprocess, sys, time; from melfeed.shared.service.children import CommandChildren; "
    "c = CommandChildren('test children').__enter__(); "
    "p = c.spawn([sys.executable, '-c', sys.argv[1], sys.argv[1], 'with a grandchild'], stdout=subprocess.PIPE, "
    "text=True); print(p.stdout.readline().strip(), flush=True); time.sleep(300)"
)


def test_the_children_of_a_sigkilled_command_and_their_own_children_die_with_it() -> None:
    command = spawn([sys.executable, "-c", _COMMAND, _FOLLOWER], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert command.stdout is not None
        pids = [int(pid) for pid in command.stdout.readline().split()]  # child and grandchild, both armed
        assert len(pids) == 2
        command.kill()  # no handler runs: only PDEATHSIG
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


# A child that starts a helper in its own process group (as a transport probe starts its producer group), prints
# the helper's pid and exits at once: the helper is orphaned, the group lives on without its lead.
_ORPHANING = (
    "import subprocess, sys; h = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
    "print(h.pid, flush=True)"
)


def _orphaned_helper(children: CommandChildren, **spawn_kwargs: Any) -> tuple[subprocess.Popen[str], int]:
    """A child of ``children`` that exited, and the pid of the helper it left running in its group."""
    proc = children.spawn([sys.executable, "-c", _ORPHANING], stdout=subprocess.PIPE, text=True, **spawn_kwargs)
    assert proc.stdout is not None
    helper = int(proc.stdout.readline())
    assert proc.wait(_GENEROUS_S) == 0 and _running(helper)
    return proc, helper


def test_leaving_the_block_stops_a_group_whose_lead_already_exited_then_runs_its_cleanup(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    seen: list[tuple[int, bool]] = []

    def cleanup(pid: int) -> None:
        seen.append((pid, _running(helper)))
        work.rmdir()

    helper = 0
    try:
        with CommandChildren("test children") as children:
            proc, helper = _orphaned_helper(children, cleanup=cleanup)
        assert not _running(helper), "the helper its lead left behind outlived the command"
        assert seen == [(proc.pid, False)] and not work.exists()  # once, after the whole group was gone
    finally:
        if helper and _running(helper):
            os.kill(helper, signal.SIGKILL)


def test_sigterm_reaches_a_group_whose_lead_already_exited() -> None:
    helper = 0
    try:
        with pytest.raises(Interrupted), CommandChildren("test children") as children:
            _, helper = _orphaned_helper(children)
            os.kill(os.getpid(), signal.SIGTERM)  # only the handler runs: it signals every group
            deadline = time.monotonic() + _GENEROUS_S
            while time.monotonic() < deadline and _running(helper):
                time.sleep(0.01)
            assert not _running(helper)
            children.check()
    finally:
        if helper and _running(helper):
            os.kill(helper, signal.SIGKILL)


_IGNORES_SIGTERM = (
    "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\ntime.sleep(600)\n"
)


def test_a_child_that_ignores_sigterm_is_killed_after_the_ladders_term_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command waits on the child's output with the child's own long timeout: the signal must bound it."""
    import melfeed.shared.service.children as children_module

    monkeypatch.setattr(children_module, "GROUP_LADDER", Ladder(0.3, 5.0))
    with pytest.raises(Interrupted), CommandChildren("test children") as children:
        proc = children.spawn([sys.executable, "-c", _IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        os.kill(os.getpid(), signal.SIGTERM)
        proc.communicate(timeout=_GENEROUS_S)  # the child's own timeout would be far longer
        assert proc.returncode == -signal.SIGKILL
        children.check()


def test_finish_runs_the_cleanup_of_a_child_killed_with_sigkill_once(tmp_path: Path) -> None:
    calls: list[int] = []
    with CommandChildren("test children") as children:
        proc = children.spawn(
            [sys.executable, "-c", "print(flush=True); import time; time.sleep(300)"],
            stdout=subprocess.PIPE,
            text=True,
            cleanup=calls.append,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "\n"
        proc.kill()  # no handler runs in the child: only its parent cleans
        children.finish(proc)
        assert proc.returncode == -signal.SIGKILL and calls == [proc.pid]
        children.finish(proc)
    assert calls == [proc.pid]  # neither finish nor the block's end run it twice


# A one-shot child under exit_on_sigterm: a temporary dir removed in `finally`; the unwinding announces itself and
# waits for a line on stdin, so the test can send the second SIGTERM in the middle of it.
_UNWINDS = (
    "import sys, shutil, tempfile; from melfeed.shared.service.lifecycle import exit_on_sigterm\n"
    "with exit_on_sigterm():\n"
    "    d = tempfile.mkdtemp(prefix='melfeed-test-')\n"
    "    try:\n"
    "        print(d, flush=True); sys.stdin.readline(); print('not stopped', flush=True)\n"
    "    finally:\n"
    "        print('unwinding', flush=True); sys.stdin.readline(); shutil.rmtree(d)\n"
)


def test_sigterm_under_exit_on_sigterm_runs_finally_once_and_exits_143() -> None:
    proc = spawn(python_argv("-c", _UNWINDS), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        work = Path(proc.stdout.readline().strip())
        assert work.is_dir()
        proc.send_signal(signal.SIGTERM)
        with selectors.DefaultSelector() as sel:  # bounded: a SIGTERM that did nothing prints nothing
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(_GENEROUS_S), "SIGTERM did not unwind the child"
        assert proc.stdout.readline() == "unwinding\n"
        proc.send_signal(signal.SIGTERM)  # the ladder's second SIGTERM: ignored while unwinding
        proc.stdin.write("go on\n")
        proc.stdin.flush()
        assert proc.wait(_GENEROUS_S) == 128 + signal.SIGTERM
        assert proc.stdout.read() == "" and not work.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(_GENEROUS_S)
