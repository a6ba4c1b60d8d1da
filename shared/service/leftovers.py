"""Files of processes killed before they could remove them: found and removed at the next start.

Config files handed to child processes that outlived their writer, and the temporary directories of
``bench`` and ``doctor`` (``melfeed-bench-<pid>-XXXXXXXX`` / ``melfeed-doctor-<pid>-XXXXXXXX`` in the temp dir,
``temp_dir_prefix``): a command killed with SIGKILL leaves its own; ``remove_dead_temp_dirs`` at the next start of
either removes those whose pid is dead. (Slot files and sockets of dead consumers: the consumer's own sweeps,
``consumer/transport/shm_slots.py`` and ``consumer/transport/endpoint_lock.py``.)

``producers-<pid>.yaml`` (the producer supervisor's) and ``run-<pid>.yaml`` (``run``'s, for its producer
group) live in the private runtime directory while their writer runs and are removed when it exits;
a writer killed with SIGKILL leaves its file. ``remove_dead_configs`` removes those whose pid is dead,
and their half-written ``.NAME.tmp`` twins.
Invariants: only names of those exact forms, only regular files and directories (never through a link), only
those of our own uid, and never one whose pid is alive (a pid reused by another process keeps the file: the
safe side). A zombie counts as dead.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

__all__ = ["is_pid_alive", "remove_dead_configs", "temp_dir_prefix", "remove_dead_temp_dirs"]

log = logging.getLogger(__name__)

_CONFIG_NAME = re.compile(r"^\.?(?:producers|run)-(\d{1,10})\.yaml(?:\.tmp)?$")


def is_pid_alive(pid: int) -> bool:
    """``pid`` names a running process (any user's; a zombie is not running)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def remove_dead_configs(directory: Path) -> list[Path]:
    """Remove our ``producers-<pid>.yaml`` / ``run-<pid>.yaml`` files whose pid is dead; returns them."""
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed
    for name in names:
        match = _CONFIG_NAME.match(name)
        if match is None or is_pid_alive(int(match.group(1))):
            continue
        path = directory / name
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                path.unlink()
                removed.append(path)
        except OSError:
            continue
    if removed:
        log.info("removed config files of dead processes: %s", ", ".join(str(p) for p in removed))
    return removed


def temp_dir_prefix(command: str) -> str:
    """``tempfile``'s prefix for ``command``'s (``bench``, ``doctor``) directory: names this process."""
    return f"melfeed-{command}-{os.getpid()}-"


def remove_dead_temp_dirs(command: str, directory: Path | None = None) -> list[Path]:
    """Remove our ``melfeed-COMMAND-<pid>-XXXXXXXX`` directories (in the temp dir) whose pid is dead; returns them."""
    folder = Path(directory if directory is not None else tempfile.gettempdir())
    pattern = re.compile(rf"^melfeed-{re.escape(command)}-(\d{{1,10}})-[a-z0-9_]{{8}}$")  # tempfile's 8 characters
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return removed
    for name in names:
        match = pattern.match(name)
        if match is None or is_pid_alive(int(match.group(1))):
            continue
        path = folder / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed temporary directories of dead %s runs: %s", command, ", ".join(str(p) for p in removed))
    return removed
