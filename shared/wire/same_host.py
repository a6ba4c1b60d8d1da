"""The same-host rules both sides share: where slot files live, what they are called, which socket to trust.

Role: the consumer creates its shared-memory slot files with these rules (``consumer/transport/shm_slots.py``)
and a producer checks what a consumer tells it against them (``producer/slot_maps.py``,
``producer/worker.py``), never taking a peer's word for a path (docs/security.md "Which consumer a producer trusts").
  * ``resolve_shm_dir``: ``transport.shm_dir``, else the ipc socket's directory when it is on tmpfs,
    else /dev/shm. Each side derives it from its own config and endpoint.
  * ``SLOT_NAME_RE``: ``melfeed-<consumer pid>-<epoch>-s<slot>-g<generation>``, ASCII digits only; use
    ``fullmatch`` (``$`` would let a trailing newline through).
  * ``socket_file_problem``: an ipc endpoint's socket file is trusted only when it is a socket (not a
    link) owned by this process's effective uid or by root.
Invariants: pure checks on the file system; nothing here creates, changes or removes a file.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import re
import stat
from pathlib import Path

__all__ = ["SLOT_NAME_RE", "is_tmpfs", "resolve_shm_dir", "ipc_socket_path", "socket_file_problem", "user_name"]

SLOT_NAME_RE = re.compile(r"melfeed-([0-9]+)-([0-9]+)-s([0-9]+)-g([0-9]+)")  # groups: pid, epoch, slot, generation
_TMPFS_MAGIC = 0x01021994
_DEFAULT_SHM_DIR = Path("/dev/shm")
_IPC = "ipc://"


def is_tmpfs(path: Path) -> bool:
    """True when ``path`` lives on tmpfs (statfs ``f_type``; Python's os has no statfs)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(str(path)), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value == _TMPFS_MAGIC


def resolve_shm_dir(shm_dir: str | None, endpoint: str) -> Path:
    """``transport.shm_dir``, else the ipc socket's directory when it is on tmpfs, else /dev/shm."""
    if shm_dir is not None:
        return Path(shm_dir)
    if endpoint.startswith(_IPC):
        socket_dir = Path(endpoint[len(_IPC) :]).parent
        if is_tmpfs(socket_dir):
            return socket_dir
    return _DEFAULT_SHM_DIR


def ipc_socket_path(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://PATH`` endpoint; ``None`` for tcp and abstract (``ipc://@name``) ones."""
    if not endpoint.startswith(_IPC) or endpoint.startswith(_IPC + "@"):
        return None
    return Path(endpoint[len(_IPC) :])


def user_name(uid: int) -> str:
    """The user name of ``uid``, or ``"no such user"``."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


def socket_file_problem(path: Path) -> str | None:
    """Why the consumer behind the socket file ``path`` is not to be trusted (a short reason), or None.

    Trusted: a socket (``lstat``: a link is refused, never followed) owned by our effective uid or by root.
    """
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"no socket file there ({err.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not a socket"
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket"
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        return (
            f"socket owned by uid {st.st_uid} ({user_name(st.st_uid)}), not by this process's uid "
            f"{euid} ({user_name(euid)}) or root"
        )
    return None
