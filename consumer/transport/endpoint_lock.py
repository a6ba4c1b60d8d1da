"""One consumer per ipc endpoint: an exclusive ``flock`` on ``<socket>.lock`` held for the whole run.

Why: libzmq's ipc bind unlinks whatever file sits at the socket path, so a second consumer started on
the same runtime directory would silently steal the endpoint from a live one (docs/security.md
"Identity"). The lock is taken before the bind; the second consumer stops with one line naming the pid
that holds it and never touches the socket. The data endpoint and the control (``status``) socket
each have one.
Leftovers: libzmq leaves the socket file behind when it closes. ``release(remove_files=True)``
(after the socket is closed) unlinks the socket and the lock; ``remove_stale_endpoints`` removes
those of dead consumers at the next start: a lock nobody holds (the kernel drops a ``flock`` when its
holder dies) means its socket is dead. Only our own files (uid), only ``*.sock`` endpoints whose lock
holds a pid line (never another program's lock in a shared directory), only sockets, never through a link.
Invariants: the lock file is opened without following links and never truncated before the lock is
ours; a lock file is unlinked only by a process that holds its ``flock``, and a taker checks after
locking that the path still names the inode it locked (else it locks again), so two processes can
never both believe they hold one endpoint. A lock found held with no pid line yet is waited for (at
most ``_NO_PID_WAIT_S``): two consumers starting in one directory (two ranks on one host) would
otherwise see each other's sweep as a live consumer and stop.
Shutdown: ``release()`` closes the descriptor (idempotent).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from melfeed.shared.errors import ConfigError

__all__ = ["EndpointLock", "lock_endpoint", "remove_stale_endpoints"]

log = logging.getLogger(__name__)

_LOCK_MODE = 0o660  # the service group may read who holds it; nobody else (the directory is 0770)
_MAX_PID_BYTES = 32
_LOCK_SUFFIX = ".lock"
_STALE_SUFFIX = ".sock.lock"  # what the start-up sweep looks at (our endpoint names end in .sock)
_MAX_LOCK_TRIES = 8  # each retry means another process removed the file between our open and flock
# A lock held with no pid line yet is a start-up sweep of another consumer in the same directory
# (``remove_stale_endpoints`` takes an empty lock for a moment), or a consumer between its flock and its
# pid line: wait for it this long before calling the endpoint taken.
_NO_PID_WAIT_S = 2.0
_NO_PID_POLL_S = 0.02


class EndpointLock:
    """An acquired endpoint lock; ``release()`` gives it back."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @property
    def socket_path(self) -> Path:
        return self.path.with_name(self.path.name.removesuffix(_LOCK_SUFFIX))

    def release(self, *, remove_files: bool = False) -> list[Path]:
        """Drop the lock; with ``remove_files`` (the socket is closed) unlink the socket and the lock first.

        Returns:
            The files unlinked.
        """
        if self._fd < 0:
            return []
        removed = []
        if remove_files:
            removed = [
                p
                for p, is_socket in ((self.socket_path, True), (self.path, False))
                if _unlink_if_ours(p, want_socket=is_socket)
            ]
        os.close(self._fd)  # closing the only descriptor drops the flock
        self._fd = -1
        return removed


def lock_endpoint(endpoint: str, key: tuple[str, ...] = ("transport", "endpoint")) -> EndpointLock | None:
    """Lock ``ipc://PATH`` through ``PATH.lock``; ``None`` for tcp and abstract ipc (a taken bind fails by itself).

    Raises:
        ConfigError: another live process holds the lock (names it and its pid), or the lock file
            cannot be opened (names the file and the config ``key``).
    """
    address = endpoint.removeprefix("ipc://")
    if address == endpoint or address.startswith("@"):  # tcp, or an abstract socket (never unlinked)
        return None
    _refuse_non_socket(Path(address), endpoint, key)
    path = Path(address + _LOCK_SUFFIX)
    no_pid_until_s = time.monotonic() + _NO_PID_WAIT_S
    replaced = 0
    while replaced < _MAX_LOCK_TRIES:
        fd = _open_lock(path, endpoint, key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            if holder == "?" and time.monotonic() < no_pid_until_s:
                time.sleep(_NO_PID_POLL_S)  # a sweeper, or a consumer between its flock and its pid line
                continue
            raise ConfigError(
                f"another consumer (pid {holder}) is running on {endpoint} (lock {path}); "
                "stop it or use another runtime directory",
                path=key,
            ) from None
        except OSError as err:
            os.close(fd)
            raise ConfigError(f"cannot lock {path}: {err.strerror}", path=key) from err
        if _names_inode(path, fd):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return EndpointLock(path, fd)
        os.close(fd)  # removed by its last holder while we waited: lock the new file
        replaced += 1
    raise ConfigError(f"cannot lock {path}: it keeps being replaced", path=key)


def _refuse_non_socket(path: Path, endpoint: str, key: tuple[str, ...]) -> None:
    """libzmq's bind unlinks whatever is at the path: anything there but a socket (a user's file, a link) is
    left alone and the endpoint refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise ConfigError(f"cannot use {endpoint}: {err.strerror}", path=key) from err
    if not stat.S_ISSOCK(st.st_mode):
        kind = (
            "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
        )
        raise ConfigError(
            f"{path} is {kind}, not a socket: binding there would delete it; name a new socket path",
            path=key,
            got=endpoint,
        )


def remove_stale_endpoints(directory: Path) -> list[Path]:
    """Unlink the sockets (and their lock files) in ``directory`` whose consumer is dead; returns them."""
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed
    for name in names:
        if not name.endswith(_STALE_SUFFIX) or name == _STALE_SUFFIX:
            continue  # only melfeed's ``*.sock`` endpoints: never another program's lock
        path = directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # a link, gone, or not ours to open
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or not _holds_a_pid(fd):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: a live consumer's socket
            if not _names_inode(path, fd):
                continue
            removed += EndpointLock(path, os.dup(fd)).release(remove_files=True)
        finally:
            os.close(fd)
    if removed:
        log.info("removed leftovers of dead consumers: %s", ", ".join(str(p) for p in removed))
    return removed


def _open_lock(path: Path, endpoint: str, key: tuple[str, ...]) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, _LOCK_MODE)
    except OSError as err:
        raise ConfigError(f"cannot open the endpoint lock {path}: {err.strerror}", path=key, got=endpoint) from err


def _names_inode(path: Path, fd: int) -> bool:
    """``path`` still names the file open on ``fd`` (nobody unlinked or replaced it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _unlink_if_ours(path: Path, *, want_socket: bool) -> bool:
    """Unlink ``path`` if it is our own socket (``want_socket``) or regular file; never through a link."""
    try:
        st = os.lstat(path)
        kind_ok = stat.S_ISSOCK(st.st_mode) if want_socket else stat.S_ISREG(st.st_mode)
        if kind_ok and st.st_uid == os.getuid():
            os.unlink(path)
            return True
    except OSError:
        pass
    return False


def _holds_a_pid(fd: int) -> bool:
    """The file holds what ``lock_endpoint`` writes: a pid line (or nothing yet), and no more."""
    text = os.pread(fd, _MAX_PID_BYTES + 1, 0)
    return len(text) <= _MAX_PID_BYTES and (text.strip() == b"" or text.strip().isdigit())


def _read_pid(fd: int) -> str:
    """The pid the holder wrote, or ``?`` (it may not have written it yet)."""
    text = os.pread(fd, _MAX_PID_BYTES, 0).decode("ascii", errors="replace").strip()
    return text if text.isdigit() else "?"
