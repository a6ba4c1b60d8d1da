"""One consumer per ipc endpoint: an exclusive ``flock`` on ``<socket>.lock`` held for the whole run.

Why: libzmq's ipc bind unlinks whatever file sits at the socket path, so a second consumer started on
the same runtime directory would silently steal the endpoint from a live one (docs/ARCHITECTURE.md
"Trust"). The lock is taken before the bind; the second consumer stops with one line naming the pid
that holds it and never touches the socket.
Invariants: the lock file is opened without following links, never truncated before the lock is ours,
and never unlinked (unlinking a locked file would let a third consumer lock a new inode); the kernel
drops the lock when its holder dies, so a stale file is harmless.
Shutdown: ``release()`` closes the descriptor (idempotent).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["EndpointLock", "lock_endpoint"]

_LOCK_MODE = 0o660       # the service group may read who holds it; nobody else (the directory is 0770)
_MAX_PID_BYTES = 32


class EndpointLock:
    """An acquired endpoint lock; ``release()`` gives it back."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)      # closing the only descriptor drops the flock
            self._fd = -1


def lock_endpoint(endpoint: str) -> EndpointLock | None:
    """Lock ``ipc://PATH`` through ``PATH.lock``; ``None`` for tcp and abstract ipc (a taken bind fails by itself).

    Raises:
        ConfigError: another live process holds the lock (names it and its pid), or the lock file
            cannot be opened (names the file).
    """
    address = endpoint.removeprefix("ipc://")
    if address == endpoint or address.startswith("@"):   # tcp, or an abstract socket (never unlinked)
        return None
    path = Path(address + ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, _LOCK_MODE)
    except OSError as err:
        raise ConfigError(f"cannot open the endpoint lock {path}: {err.strerror}", path=("transport", "endpoint"),
                          got=endpoint) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        raise ConfigError(f"another consumer (pid {holder}) is running on {endpoint} (lock {path}); "
                          "stop it or use another runtime directory", path=("transport", "endpoint")) from None
    except OSError as err:
        os.close(fd)
        raise ConfigError(f"cannot lock {path}: {err.strerror}", path=("transport", "endpoint")) from err
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return EndpointLock(path, fd)


def _read_pid(fd: int) -> str:
    """The pid the holder wrote, or ``?`` (it may not have written it yet)."""
    text = os.pread(fd, _MAX_PID_BYTES, 0).decode("ascii", errors="replace").strip()
    return text if text.isdigit() else "?"
