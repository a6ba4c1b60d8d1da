"""Child processes: where the code lives, how a child interpreter starts, and what it is handed.

Role: the one place that knows how a child interpreter starts (``spawn``: a fresh interpreter running
``python -m MODULE ...`` or ``python -m melfeed COMMAND ...``, never a fork, since TensorFlow
and ZeroMQ are not fork-safe), how it gets the effective config (``handed_over_config``: one YAML
file, mode 0600, in the private runtime directory) and how it is stopped (``Child.stop``: the
ladder of ``melfeed.shared.service.stop_ladder``). ``CommandChildren`` is what a command that runs children
for a result (``bench``'s trials, ``doctor``'s probes) needs so that none outlives it, however it ends:

- each child leads its own process group (``spawn(new_group=True)``: a terminal's Ctrl-C reaches the
  command alone, a timeout kills a child with its helpers) and gets ``MELFEED_PARENT_PID``
  (``PARENT_PID_ENV``) naming the command: a child that calls ``die_with_named_parent`` gets SIGTERM when
  the command dies, even by SIGKILL (no handler runs then), and passes its own pid to its helpers;
- SIGTERM and SIGINT only record the signal and send SIGTERM to every live child's process group
  (nothing that blocks runs in the handler); the child then ends, the wait on it returns, and
  ``check`` (or the next ``spawn``) raises ``Interrupted``, which the command turns into exit ``128 + signum``;
  the first signal also arms a timer: a group still running ``GROUP_LADDER.term_wait_s`` later (a child that
  ignores SIGTERM, or sits in a long C call, while the command waits on it with the child's own long
  timeout) gets SIGKILL;
- a group is tracked until no member of it runs, not only while its lead does: a helper whose parent (the
  lead) died keeps the group, and the signals and the ladder still reach it (``os.killpg``);
- ``finish`` (after the child's result is read) and the end of the block run a child's ``cleanup`` once its
  whole group is gone: the command owns what it handed the child (a work directory) and removes what a
  child killed by SIGKILL could not (its shared-memory slot files);
- on leaving the block, the stop ladder (``GROUP_LADDER``: SIGTERM, bounded wait, SIGKILL, bounded wait,
  whole groups) runs on every group with a member still running, then every cleanup not run yet, and the old
  handlers come back.

Invariants: nothing here starts a process at import; paths are resolved once, at import; a
handed-over config file is written once (atomically) and removed when its owner is done with it; once
``CommandChildren.__exit__`` returns, every process of every group it spawned has exited (or the ladder gave
up on it after SIGKILL, logged as an error) and every cleanup has run.
Shutdown: ``Child.stop``/``close`` are idempotent; ``Child`` and ``CommandChildren`` are context managers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import yaml

from melfeed.shared.config import resolve_runtime_dir
from melfeed.shared.service.leftovers import remove_dead_configs
from melfeed.shared.service.lifecycle import PARENT_PID_ENV, prepare_runtime_dir
from melfeed.shared.service.stop_ladder import (
    GROUP_LADDER,
    Ladder,
    Rung,
    is_group_alive,
    signal_child,
    stop_all,
    stop_process,
)

__all__ = [
    "child_env",
    "module_argv",
    "entry_argv",
    "python_argv",
    "spawn",
    "write_private_config",
    "handed_over_config",
    "Child",
    "CommandChildren",
    "Interrupted",
]

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what stops a command's children (CommandChildren)
_CONFIG_MODE = 0o600  # the config may name key files and paths: the owner's eyes only


class _PlainDumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML is untyped
    """Never writes anchors/aliases (a value shared by two keys is written twice): config files are
    read by a loader that refuses every alias (alias bombs)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def child_env(extra: Mapping[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment plus ``extra``, less ``drop``.

    ``MELFEED_PARENT_PID`` is never inherited (it names this process's parent, which the child must not
    follow): a parent that wants its child to die with it sets it in ``extra``.

    A child imports ``melfeed`` from where its parent did: the same interpreter, site-packages and
    ``PYTHONPATH``; it starts in its parent's working directory (a step factory's module resolves alike).
    """
    inherited = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}  # names *our* parent, not the child's
    return {k: v for k, v in {**inherited, **(extra or {})}.items() if k not in drop}


def python_argv(*args: str) -> list[str]:
    """A fresh interpreter (this one's executable) with ``args``."""
    return [sys.executable, *args]


def module_argv(module: str, *args: str) -> list[str]:
    """``python -m MODULE ARGS...``."""
    return python_argv("-m", module, *args)


def entry_argv(command: str, *args: str) -> list[str]:
    """``python -m melfeed COMMAND ARGS...``: a child run exactly as a user (or systemd) runs it."""
    return module_argv("melfeed", command, *args)


def spawn(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, new_group: bool = False, **popen_kwargs: Any
) -> subprocess.Popen[Any]:
    """Start ``argv`` with stdin closed and ``env`` (default ``child_env()``).

    ``new_group``: the child leads its own process group (and session), so a timeout can kill it
    together with its helpers and a terminal's Ctrl-C reaches only the parent.
    """
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(
        list(argv), env=dict(env) if env is not None else child_env(), start_new_session=new_group, **popen_kwargs
    )


def write_private_config(mapping: Mapping[str, Any], name: str, directory: Path | None = None) -> Path:
    """Write ``mapping`` as YAML to ``directory/name`` (default: the private runtime dir), mode 0600.

    Written to a temporary name and renamed, so a reader never sees half a file. Files of this kind
    whose writer is dead are removed first.
    """
    folder = directory if directory is not None else prepare_runtime_dir(resolve_runtime_dir(os.environ))
    remove_dead_configs(folder)  # left by a writer that was killed (shared/service/leftovers.py)
    path = folder / name
    tmp = folder / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, _CONFIG_MODE)
    try:
        os.fchmod(fd, _CONFIG_MODE)  # a leftover temporary file keeps its old mode otherwise
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            yaml.dump(dict(mapping), out, Dumper=_PlainDumper, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def handed_over_config(mapping: Mapping[str, Any], name: str, directory: Path | None = None) -> Iterator[Path]:
    """``write_private_config`` for the length of the block; the file is removed however the block ends."""
    path = write_private_config(mapping, name, directory)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


class Child:
    """One spawned interpreter, the config file it was handed (if any) and the ladder that stops it.

    ``stopping`` is the ladder's first step: set before any signal, so a watcher can tell an exit
    it asked for from a crash.
    """

    def __init__(
        self,
        proc: subprocess.Popen[Any],
        what: str,
        ladder: Ladder,
        *,
        group: bool = False,
        config_path: Path | None = None,
    ) -> None:
        self.proc = proc
        self.what = what
        self.ladder = ladder
        self.group = group
        self.config_path = config_path
        self.stopping = False

    def stop(self) -> int | None:
        """Set stop -> SIGTERM -> wait -> SIGKILL -> wait; reap; remove the config. Idempotent."""
        self.stopping = True
        try:
            return stop_process(self.proc, self.what, self.ladder, group=self.group)
        finally:
            if self.config_path is not None:
                self.config_path.unlink(missing_ok=True)

    close = stop

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class Interrupted(Exception):
    """The command got SIGTERM or SIGINT; ``signum`` says which (exit ``128 + signum``)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class CommandChildren:
    """The children of one command run and the signal handlers that stop them (see the module docstring).

    ``what`` names them in the ladder's log lines (``"bench children"``).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.signum: int | None = None
        self._live: list[subprocess.Popen[Any]] = []  # groups that may still have a running member
        self._cleanups: dict[int, Callable[[int], None]] = {}  # by pid, until run
        self._old: dict[int, Any] = {}
        self._kill_timer: threading.Timer | None = None  # after a signal: SIGKILL what ignored the SIGTERM

    def __enter__(self) -> CommandChildren:
        self._old = {s: signal.signal(s, self._on_signal) for s in _STOP_SIGNALS}
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            stop_all(self._live, self.what, GROUP_LADDER, group=True)
            for pid in list(self._cleanups):
                self._clean(pid)
        finally:
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            for s, handler in self._old.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            # The command may be waiting on a child's output with that child's own (long) timeout: a child
            # that ignores the SIGTERM, or sits in a long C call, is killed after the ladder's TERM wait.
            self._kill_timer = threading.Timer(GROUP_LADDER.term_wait_s, self._kill_live)
            self._kill_timer.daemon = True
            self._kill_timer.start()
        for proc in self._live:  # lead reaped or not: its group may still run
            signal_child(proc, Rung.TERM, group=True)

    def _kill_live(self) -> None:
        for proc in list(self._live):
            if is_group_alive(proc.pid):
                log.warning(
                    "%s: pid %d's group still runs %.0f s after SIGTERM; killing it",
                    self.what,
                    proc.pid,
                    GROUP_LADDER.term_wait_s,
                )
                signal_child(proc, Rung.KILL, group=True)

    def check(self) -> None:
        """Raise ``Interrupted`` once a signal came."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        cleanup: Callable[[int], None] | None = None,
        **popen: Any,
    ) -> subprocess.Popen[Any]:
        """``spawn`` in a new process group, naming this process as its parent, registered; none after a signal.

        ``cleanup(pid)`` runs once the child's whole group is gone (``finish``, else on leaving the block).
        """
        self.check()
        proc = spawn(
            argv,
            env={**(env if env is not None else child_env()), PARENT_PID_ENV: str(os.getpid())},
            new_group=True,
            **popen,
        )
        self._live = [p for p in self._live if p.poll() is None or is_group_alive(p.pid)] + [proc]
        if cleanup is not None:
            self._cleanups[proc.pid] = cleanup
        if self.signum is not None:  # the signal came between the check and the start
            signal_child(proc, Rung.TERM, group=True)
        return proc

    def finish(self, proc: subprocess.Popen[Any]) -> None:
        """Once ``proc``'s result is read: the ladder on what is left of its group (nothing, usually), then its
        cleanup. Idempotent."""
        stop_process(proc, f"{self.what} (what is left of pid {proc.pid}'s group)", GROUP_LADDER, group=True)
        self._clean(proc.pid)

    def _clean(self, pid: int) -> None:
        cleanup = self._cleanups.pop(pid, None)
        if cleanup is None:
            return
        try:
            cleanup(pid)
        except OSError as err:  # a leftover is worth a line, never the command's result
            log.warning("%s: cannot clean up after pid %d: %s", self.what, pid, err)
