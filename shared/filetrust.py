"""Files whose modes must not depend on the umask, and inputs only this user (or root) may control.

Role: on a workstation shared with other users, a shell or test runner may start melfeed with umask
000. Output files melfeed creates itself (``consumer.metrics_file``, ``--summary-json``) therefore
take their mode from here, not from the umask; and inputs that decide who is admitted (the CURVE
allow-list) or what code runs (the XLA compilation cache) are refused when another user could
change them (docs/ARCHITECTURE.md "Trust").
Invariants:
- A file created here is ``OUTPUT_FILE_MODE`` (0640) or stricter: the mode goes to ``open(2)``, and
  the umask can only remove bits. A file that already exists keeps its mode and owner.
- ``untrusted_reason`` accepts only an object owned by this user (effective uid) or root that
  neither its group nor others can write to.
Shutdown: nothing to shut down; every descriptor opened here is closed or handed to the caller.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["OUTPUT_FILE_MODE", "make_dirs", "open_output", "untrusted_reason", "write_output"]

OUTPUT_FILE_MODE = 0o640   # the owner writes, the group (an operator in the service group) reads


def open_output(path: str | os.PathLike[str], *, append: bool) -> int:
    """A write descriptor on ``path``: appended to, or truncated; created ``OUTPUT_FILE_MODE`` if absent.

    Raises:
        OSError: it cannot be opened or created.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    return os.open(path, flags, OUTPUT_FILE_MODE)


def write_output(path: str | os.PathLike[str], text: str) -> None:
    """Replace the contents of ``path`` with ``text`` (UTF-8); a new file is ``OUTPUT_FILE_MODE``.

    Raises:
        OSError: the file cannot be opened or written.
    """
    with os.fdopen(open_output(path, append=False), "w", encoding="utf-8") as out:
        out.write(text)


def make_dirs(path: Path, mode: int) -> None:
    """Create ``path`` and its missing parents with ``mode`` (or stricter, per the umask); existing ones are kept.

    ``Path.mkdir(parents=True)`` gives the parents the default mode: 0777 under umask 000.

    Raises:
        OSError: a component cannot be created, or exists and is not a directory.
    """
    missing: list[Path] = []
    here = path
    while not here.is_dir() and here != here.parent:
        missing.append(here)
        here = here.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=mode)
        except FileExistsError:
            if not directory.is_dir():       # a file in the way: say so, not "File exists"
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory)) from None


def untrusted_reason(path: str | os.PathLike[str], *, directory: bool, follow: bool = True) -> str | None:
    """Why someone other than this user or root could change ``path``; ``None`` if nobody can.

    Args:
        path: the file or directory to judge (only itself: its parents are not walked).
        directory: whether it must be a directory (else a regular file).
        follow: judge a symlink's target; ``False`` refuses a symlink itself.

    Raises:
        OSError: it cannot be examined (e.g. it does not exist).
    """
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return f"belongs to uid {st.st_uid}, neither this user ({os.geteuid()}) nor root"
    mode = stat.S_IMODE(st.st_mode)
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("every user", stat.S_IWOTH)) if mode & bit]
    if writers:
        return f"is mode {mode:04o}: {' and '.join(writers)} can write to it"
    return None
