"""Config files handed to child processes that outlived their writer: found and removed at the next start.

``producers-<pid>.yaml`` (the producer supervisor's) and ``run-<pid>.yaml`` (``run``'s, for its producer
group) live in the private runtime directory while their writer runs and are removed when it exits;
a writer killed with SIGKILL leaves its file. ``remove_dead_configs`` removes those whose pid is dead,
and their half-written ``.NAME.tmp`` twins.
Invariants: only names of that exact form, only regular files (never through a link), only files of
our own uid, and never one whose pid is alive (a pid reused by another process keeps the file: the
safe side). A zombie counts as dead.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

__all__ = ["is_pid_alive", "remove_dead_configs"]

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
        return True                          # someone else's process: alive
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
