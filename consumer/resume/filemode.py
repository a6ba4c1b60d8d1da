"""Modes of what the consumer writes to its state directory: the service user and group only.

Role: the state directory, ``.lock``, ``run.json``, ``audit.log`` and every checkpoint are created
through these helpers, so other local users can neither read the trained variables nor the data
order, whatever umask the process was started with (docs/security.md, "Files"; a shell or a
test runner may run with umask 000, and systemd's ``UMask=0027`` only covers the units).

Invariants:
- Files are created ``STATE_FILE_MODE`` (0640) or stricter, directories ``STATE_DIR_MODE`` (0750)
  or stricter: ``mkdir``/``open`` take the mode at creation (the umask can only remove bits), and
  files written by others (TensorFlow's checkpoint writer) are narrowed with ``restrict``.
- A directory or file that already exists keeps its mode: the operator may have chosen it. It is used
  only if no other user can change it (``check_private_dir``): owned by this user, writable by no one
  else, and every parent owned by this user or root and, where others can write to it, sticky, every
  symbolic link on the way this user's or root's (the rule of OpenSSH's StrictModes,
  ``melfeed.shared.filetrust.place_reason``). Whoever could change it could swap a checkpoint the run restores or
  compiled code the XLA cache loads.
Shutdown: nothing to shut down; every descriptor is closed before returning.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from melfeed.shared.filetrust import check_private_dir, make_dirs

__all__ = ["STATE_DIR_MODE", "STATE_FILE_MODE", "check_private_dir", "make_private_dir", "write_private", "restrict"]

STATE_FILE_MODE = 0o640  # the group may read (an auditor in the service group); nobody else
STATE_DIR_MODE = 0o750


def make_private_dir(path: Path) -> None:
    """Create ``path`` and its missing parents, each ``STATE_DIR_MODE`` or stricter, then ``check_private_dir``.

    ``Path.mkdir(parents=True)`` would give the parents the default mode (0777 under umask 000).

    Raises:
        OSError: a component cannot be created, or exists and is not a directory; ``PermissionError``
            when another user could change the directory (its ``strerror`` says who and how).
    """
    make_dirs(path, STATE_DIR_MODE)
    check_private_dir(path)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` created ``STATE_FILE_MODE`` or stricter (one left over is replaced).

    Raises:
        OSError: the write failed.
    """
    path.unlink(missing_ok=True)  # O_CREAT keeps an existing file's mode; start from a new inode
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, STATE_FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def restrict(path: Path) -> None:
    """Narrow a file written by someone else to ``STATE_FILE_MODE`` (directories to ``STATE_DIR_MODE``)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return  # chmod would follow it; the writers here create none
    limit = STATE_DIR_MODE if stat.S_ISDIR(st.st_mode) else STATE_FILE_MODE
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~limit:
        os.chmod(path, mode & limit)
