"""Opening cache files that may not be files: FIFOs, devices, directories, symlink loops.
Also the cache's small JSON files and directories: ``read_json``, ``write_atomic``, ``make_dirs``
turn what the OS or the parser refuses into a one-line ``CacheError`` naming the path; ``check_cache_dir``
refuses a cache directory to be written (``prepare --cache-dir``, ``demo-data``) that another user controls.

Role: every reader of ``.npy`` cache files (``index``, ``verify-cache``, the producers' reader)
opens them through ``open_regular``. A cache directory is written by people and scripts, and on a
shared box an entry can be anything: a FIFO (``open`` of one blocks until a writer appears), a
symlink to ``/dev/zero`` (reads never end), a directory named ``x.npy``, a dangling symlink or a
symlink loop. Each is refused with a one-line ``CacheError`` naming the path and its kind
(``not a regular file (fifo)``), so it is reported or quarantined like any other bad file
(docs/design.md, invariant 7).

Invariants:
- Never blocks: the open uses ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a
  writer) and ``O_NOCTTY``; the type is then checked with ``fstat`` on the open descriptor, so an
  entry swapped between a check and the open cannot slip through.
- The refusal depends only on the entry, so every producer refuses the same samples.
- ``O_NONBLOCK`` changes nothing for a regular file (Linux ignores it for reads of one).
Shutdown: nothing to shut down; a refused descriptor is closed before raising.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from melfeed.shared.errors import CacheError

__all__ = [
    "CACHE_FILE_MODE",
    "OPEN_FLAGS",
    "open_regular",
    "read_regular",
    "read_json",
    "write_atomic",
    "make_dirs",
    "entry_kind",
    "mode_kind",
    "not_regular_reason",
]

OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY

_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def mode_kind(mode: int) -> str:
    for is_kind, name in _KINDS:
        if is_kind(mode):
            return name
    return "unknown file type"


def not_regular_reason(kind: str) -> str:
    """The one reason every reader gives for a non-regular entry: ``not a regular file (fifo)``."""
    return f"not a regular file ({kind})"


def entry_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it is not a regular file (after following symlinks), else ``None``.

    Never opens anything: ``stat`` and ``lstat`` only. A missing entry that is no symlink gives
    ``None`` too (the caller's open reports it as missing).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "symlink loop"
        if err.errno == errno.ENOENT and os.path.islink(path):
            return f"dangling symlink to {os.readlink(path)}"
        return None
    return None if stat.S_ISREG(mode) else mode_kind(mode)


def open_regular(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading without blocking, and only if it is a regular file.

    Returns:
        ``(fd, st)``: the open descriptor (the caller closes it) and its ``fstat``.

    Raises:
        CacheError: ``missing``, or ``not a regular file (KIND)`` for a FIFO, device,
            directory, socket, dangling symlink or symlink loop.
        OSError: any other failure (permission, out of fds or memory), left to the caller, which
            knows whether it says something about the file.
    """
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as err:
        kind = entry_kind(path) if err.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO) else None
        if kind is not None:
            raise CacheError(path, not_regular_reason(kind)) from err
        if isinstance(err, FileNotFoundError):
            raise CacheError(path, "missing") from err
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CacheError(path, not_regular_reason(mode_kind(st.st_mode)))
    return fd, st


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The whole content of a small regular file (``manifest.json``, ``features.json``).

    Raises:
        CacheError: missing, or not a regular file (as ``open_regular``).
        OSError: the read failed.
    """
    fd, _ = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike[str]) -> Any:
    """``read_regular`` parsed as JSON (``manifest.json``, ``features.json``).

    Raises:
        CacheError: as ``read_regular``.
        OSError: the read failed.
        ValueError: not JSON, not UTF-8, or nested deeper than the parser's recursion limit
            (``nested too deeply``: a RecursionError would otherwise escape as a traceback).
    """
    raw = read_regular(path)
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


CACHE_FILE_MODE = 0o644  # manifest.json, features.json: read by producers and consumers that may run as another
# user (deploy's melfeed) than the one who indexed; mkstemp alone gives 0600


def write_atomic(directory: Path, name: str, data: bytes) -> Path:
    """Temp file in ``directory``, fsync, rename over ``name``, fsync the directory; returns the path.

    The file is ``CACHE_FILE_MODE`` whatever the umask (a cache's data is for every user who trains on it).

    Raises:
        CacheError: naming ``directory/name`` and the OS reason: a read-only or missing directory, a
            directory in the way, disk full. No temp file is left behind.
    """
    target = directory / name
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), CACHE_FILE_MODE)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
        dir_fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except OSError as err:
        raise CacheError(target, f"cannot write ({err.strerror})") from err
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return target


def make_dirs(path: Path) -> None:
    """``mkdir -p path``, refusing with one line instead of a traceback.

    Raises:
        CacheError: naming ``path``: it is not a directory, or it (or the part named) cannot be created,
            with the OS reason (read-only parent, a file in the way, ``/proc``).
    """
    try:
        if path.exists() and not path.is_dir():
            raise CacheError(path, "not a directory")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        part = f" at {err.filename}" if err.filename and os.fspath(err.filename) != os.fspath(path) else ""
        raise CacheError(path, f"cannot create the directory{part} ({err.strerror})") from err


def check_cache_dir(root: Path, what: str = "cache") -> None:
    """Refuse a cache directory (``what``: "cache", "demo cache") another user could write to or swap: thousands
    of files are written there, and ``np.save`` follows a link planted at a file's name, and a file planted
    there would be served as data (``output_dir_reason``). One not made yet: refuse a place another user
    controls before anything (a directory, a lock) is made there (``creation_reason``).

    Raises:
        CacheError: one of the refusals, or an existing directory that cannot be examined.
    """
    from melfeed.shared.filetrust import creation_reason
    from melfeed.shared.output_files import output_dir_reason

    exists = os.path.lexists(root)
    if exists and not os.path.isdir(root):
        raise CacheError(root, "not a directory")
    try:
        reason = output_dir_reason(root) if exists else creation_reason(root)
    except OSError as err:
        if not exists:  # a file in the way, a parent we cannot search: making it names the OS reason
            return
        raise CacheError(root, f"cannot examine the {what} directory ({err.strerror})") from err
    if reason is not None:
        raise CacheError(root, f"refusing to write the {what}: {reason}")
