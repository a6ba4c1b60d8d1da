"""Child processes: where the code lives, how a child interpreter starts, and what it is handed.

Role: the one place that knows the repository root (``REPO_ROOT``: the folder holding ``shared/``,
``producer/``, ``consumer/`` and ``run_pipeline.py``, in a checkout and in an installed tree alike),
how a child finds these packages (``child_env``), how it is started (``spawn``: a fresh interpreter
running ``python -m MODULE ...`` or ``run_pipeline.py COMMAND ...``, never a fork, since TensorFlow
and ZeroMQ are not fork-safe), how it gets the effective config (``handed_over_config``: one YAML
file, mode 0600, in the private runtime directory) and how it is stopped (``Child.stop``: the
ladder of ``shared.service.stop_ladder``).
Invariants: nothing here starts a process at import; paths are resolved once, at import; a
handed-over config file is written once (atomically) and removed when its owner is done with it.
Shutdown: ``Child.stop``/``close`` are idempotent; ``Child`` is a context manager.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from shared.config import resolve_runtime_dir
from shared.service.leftovers import remove_dead_configs
from shared.service.lifecycle import prepare_runtime_dir
from shared.service.stop_ladder import Ladder, stop_process

__all__ = ["REPO_ROOT", "ENTRY_SCRIPT", "child_env", "module_argv", "entry_argv", "python_argv", "spawn",
           "write_private_config", "handed_over_config", "Child"]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]  # shared/service/children.py -> the root
ENTRY_SCRIPT = REPO_ROOT / "run_pipeline.py"
_CONFIG_MODE = 0o600    # the config may name key files and paths: the owner's eyes only


class _PlainDumper(yaml.SafeDumper):
    """Never writes anchors/aliases (a value shared by two keys is written twice): config files are
    read by a loader that refuses every alias (alias bombs)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def child_env(extra: Mapping[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment plus ``extra``, less ``drop``, with ``REPO_ROOT`` first on ``PYTHONPATH``.

    A child started as ``python -m producer.process`` from any working directory then imports
    the same code as its parent, installed or not.
    """
    env = {k: v for k, v in {**os.environ, **(extra or {})}.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def python_argv(*args: str) -> list[str]:
    """A fresh interpreter (this one's executable) with ``args``."""
    return [sys.executable, *args]


def module_argv(module: str, *args: str) -> list[str]:
    """``python -m MODULE ARGS...``."""
    return python_argv("-m", module, *args)


def entry_argv(command: str, *args: str) -> list[str]:
    """``python run_pipeline.py COMMAND ARGS...``: a child run exactly as a user (or systemd) runs it."""
    return python_argv(str(ENTRY_SCRIPT), command, *args)


def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None, new_group: bool = False,
          **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` with stdin closed and ``env`` (default ``child_env()``).

    ``new_group``: the child leads its own process group (and session), so a timeout can kill it
    together with its helpers and a terminal's Ctrl-C reaches only the parent.
    """
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(list(argv), env=dict(env) if env is not None else child_env(),
                            start_new_session=new_group, **popen_kwargs)


def write_private_config(mapping: Mapping[str, Any], name: str, directory: Path | None = None) -> Path:
    """Write ``mapping`` as YAML to ``directory/name`` (default: the private runtime dir), mode 0600.

    Written to a temporary name and renamed, so a reader never sees half a file. Files of this kind
    whose writer is dead are removed first.
    """
    folder = directory if directory is not None else prepare_runtime_dir(resolve_runtime_dir(os.environ))
    remove_dead_configs(folder)          # left by a writer that was killed (shared/service/leftovers.py)
    path = folder / name
    tmp = folder / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, _CONFIG_MODE)
    try:
        os.fchmod(fd, _CONFIG_MODE)          # a leftover temporary file keeps its old mode otherwise
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

    def __init__(self, proc: subprocess.Popen[Any], what: str, ladder: Ladder, *, group: bool = False,
                 config_path: Path | None = None) -> None:
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
