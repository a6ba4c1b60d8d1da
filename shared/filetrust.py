"""Paths only this user (or root) may control: the one "who could swap it" rule, and trusted inputs.

Role: on a workstation shared with other users, another local user may swap a directory melfeed trusts,
or plant a symbolic link or a file where melfeed reads or writes (the /tmp symlink attack).
- ``place_reason`` is the one "who could swap it" rule (OpenSSH's StrictModes, plus links): every
  directory a lookup of the path passes through is this user's or root's and, where others can write to
  it, sticky (so only an entry's owner may rename or remove it), and every symbolic link on the way is
  this user's or root's (its owner could point it elsewhere at any time, even in sticky /tmp). Every
  trusted path uses it: ``check_private_dir`` (state directory, XLA cache, ``keys DIR``), the CURVE
  allow-list and server key (``untrusted_reason`` judges the object), secret keys
  (``private_file_reason``), and every file written at a user's path (``shared/output_files.py``).
- ``make_dirs`` creates directories with the mode asked for, not the umask's default.
docs/security.md "Files".
Invariants:
- ``untrusted_reason`` accepts only an object owned by this user (effective uid) or root that neither
  its group nor others can write to; ``private_file_reason`` only a regular file of this user or root
  on which its group and others have no permission bit at all.
- Pure of state: every check reads the file system at the moment it is called; none caches a verdict.
Shutdown: nothing to shut down; nothing is opened here.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = [
    "check_private_dir",
    "creation_reason",
    "make_dirs",
    "others_can_write",
    "place_reason",
    "private_file_reason",
    "untrusted_reason",
]

_MAX_LINKS = 40  # symbolic links followed in one lookup, as Linux's ELOOP limit


def others_can_write(st: os.stat_result) -> bool:
    """Users other than this one (and its groups) may create, rename or remove entries in / write to it."""
    mode = stat.S_IMODE(st.st_mode)
    foreign_group = st.st_gid != os.getegid() and st.st_gid not in os.getgroups()
    return bool(mode & stat.S_IWOTH or (mode & stat.S_IWGRP and foreign_group))


def place_reason(path: str | os.PathLike[str], *, follow: bool = True) -> str | None:
    """Why another user could change which object ``path`` names; ``None`` if only this user or root can.

    The lookup is walked as the kernel does it, component by component: each directory it searches must
    be this user's or root's and, if other users can write to it, sticky; each symbolic link it follows
    (the last component's too, unless ``follow`` is false: an output, opened ``O_NOFOLLOW``) must be this
    user's or root's. The object itself is not judged (``untrusted_reason``, ``private_file_reason``,
    ``output_reason`` do that); a missing last component is fine (a file about to be created).

    Raises:
        OSError: a directory on the way is missing or cannot be examined, or too many links.
    """
    uid = os.geteuid()
    text = os.fspath(path)
    todo = list(reversed((text if text.startswith("/") else os.path.join(os.getcwd(), text)).split("/")))
    here, links, checked = "/", 0, set()
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            here = os.path.dirname(here)
            continue
        if here not in checked:
            why = _directory_reason(here, uid)
            if why is not None:
                return why
            checked.add(here)
        entry = os.path.join(here, name)
        last = not any(part not in ("", ".") for part in todo)
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            if last:
                return None  # not there yet
            raise
        if not stat.S_ISLNK(st.st_mode) or (last and not follow):
            here = entry
            continue
        if st.st_uid not in (uid, 0):
            return f"it is reached through {entry}, a symbolic link of uid {st.st_uid}, who could point it elsewhere"
        links += 1
        if links > _MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), text)
        target = os.readlink(entry)
        if target.startswith("/"):
            here = "/"
        todo.extend(reversed(target.split("/")))
    return None


def creation_reason(path: str | os.PathLike[str]) -> str | None:
    """``place_reason`` for a directory about to be made with its missing parents (``keys DIR``, ``demo-data
    --cache-dir DIR``, ``prepare --cache-dir``): judged at the first missing component, so that nothing is created
    (not even
    an empty directory) in a place another user controls. An existing ``path`` is judged as it is.

    Raises:
        OSError: an existing directory on the way cannot be examined.
    """
    first_missing = Path(os.path.abspath(path))
    while first_missing.parent != first_missing and not os.path.lexists(first_missing.parent):
        first_missing = first_missing.parent
    return place_reason(first_missing)


def _directory_reason(directory: str, uid: int) -> str | None:
    st = os.stat(directory)
    if st.st_uid not in (uid, 0):
        return f"its parent {directory} belongs to uid {st.st_uid}, who could move it"
    if others_can_write(st) and not st.st_mode & stat.S_ISVTX:
        return (
            f"its parent {directory} is mode {stat.S_IMODE(st.st_mode):04o} without the sticky bit: other users "
            "could move it"
        )
    return None


def check_private_dir(path: str | os.PathLike[str]) -> None:
    """Refuse a directory another user could change, or whose place another user could change.

    The directory (resolved) must be this user's and writable by no one else; its place is judged by
    ``place_reason``, the one rule every trusted path follows (the allow-list, secret keys, outputs).

    Raises:
        PermissionError: ``path`` (resolved) is not this user's, others can write to it, or its place is
            not only this user's and root's (its ``strerror`` says who and how).
        OSError: it cannot be examined (e.g. it does not exist).
    """
    real, uid = os.path.realpath(path), os.geteuid()
    st = os.stat(real)
    if st.st_uid != uid:
        raise PermissionError(
            errno.EPERM,
            f"{real} belongs to uid {st.st_uid}, not to this user (uid {uid}), who could replace what it holds",
        )
    if others_can_write(st):
        raise PermissionError(
            errno.EPERM,
            f"{real} is mode {stat.S_IMODE(st.st_mode):04o}: other users can write to it; make it 0750 or stricter",
        )
    reason = place_reason(path)
    if reason is not None:
        raise PermissionError(errno.EPERM, f"{reason}; use a directory under one of this user's or root's")


def untrusted_reason(path: str | os.PathLike[str], *, directory: bool, follow: bool = True) -> str | None:
    """Why someone other than this user or root could change ``path``; ``None`` if nobody can.

    Args:
        path: the file or directory to judge (only itself: ``place_reason`` judges its parents).
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


def private_file_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is no fit place for a secret (a private key); ``None`` if only this user or root can
    read or change it: a regular file of this user or root, no permission bit for its group or others,
    in a place only they control (``place_reason``), as OpenSSH requires of a private key file.

    Raises:
        OSError: it cannot be examined (e.g. it does not exist).
    """
    reason = place_reason(path)
    if reason is not None:
        return reason
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return f"belongs to uid {st.st_uid}, neither this user ({os.geteuid()}) nor root"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        who = " and ".join(w for w, bits in (("its group", 0o070), ("other users", 0o007)) if mode & bits)
        can = "/".join(v for v, bits in (("read", 0o044), ("write", 0o022), ("execute", 0o011)) if mode & bits)
        return f"is mode {mode:04o}: {who} can {can} it; chmod 600 it"
    return None


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
            if not directory.is_dir():  # a file in the way: say so, not "File exists"
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory)) from None
