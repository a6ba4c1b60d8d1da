"""Files written at a path a user chose, safe from another local user's traps, with modes not the umask's.

Role: ``--metrics-file``, ``--summary-json``, ``--json`` (bench, doctor, audit, jax_bench), ``report -o``,
``deploy``'s units and ``keys`` write here; ``deploy --target-dir``, ``demo-data --cache-dir DIR`` and ``prepare
--cache-dir`` are checked here. The attack: alice writes /tmp/m.jsonl, mallory made it a link to
~alice/.bashrc first, or a file of hers (to read what alice appends). The rule, in one place:
- the place passes ``melfeed.shared.filetrust.place_reason`` (the file's own name is not followed);
- a symbolic link in the file's place is refused, whoever owns it (never followed: ``O_NOFOLLOW``, or a
  rename over it); a FIFO or device is refused (opened without blocking, then ``fstat``);
- in a directory other users can create files in (sticky, as /tmp) an existing file must be this
  user's with one link (Linux's ``protected_regular``; no hard link to another file);
- a directory that gets many files must be writable by no other user at all (``output_dir_reason``).
docs/security.md "Files".
Invariants:
- A file created by ``open_output`` is ``OUTPUT_FILE_MODE`` (0640) or stricter (the mode goes to
  ``open(2)``; the umask can only remove bits); an existing one keeps its mode and owner. ``create_new``
  and ``replace_output`` give exactly the mode asked for, set on the descriptor before the first byte.
- ``open_output`` checks the descriptor it opened (``fstat``) before truncating, so a trap set after
  the up-front ``check_output`` is still refused.
- ``write_output`` leaves the old contents or the whole new text, never an empty or half file: a
  SIGTERM/SIGINT/SIGHUP that arrives between the truncation and the last byte is held and delivered
  right after (``_signals_held``; a report written after its command's own handlers were removed would
  otherwise die empty).
- Every refusal is one ``ConfigError`` line naming the flag or key (``what``) and the path.
Shutdown: nothing to shut down; every descriptor opened here is closed or handed to the caller.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from melfeed.shared.errors import ConfigError
from melfeed.shared.filetrust import others_can_write, place_reason

__all__ = [
    "OUTPUT_FILE_MODE",
    "check_output",
    "check_output_dir",
    "create_new",
    "open_output",
    "output_dir_reason",
    "output_reason",
    "replace_output",
    "write_output",
]

OUTPUT_FILE_MODE = 0o640  # the owner writes, the group (an operator in the service group) reads


def output_reason(path: str | os.PathLike[str]) -> str | None:
    """Why writing ``path`` could land on a file another user chose; ``None`` if it cannot (today).

    The checks ``open_output`` makes, without opening: for a flag checked before the work. ``open_output``
    checks again on its descriptor.

    Raises:
        OSError: its directory is missing or cannot be examined.
    """
    reason = place_reason(path, follow=False)
    if reason is not None:
        return reason
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return _existing_reason(st, _directory_of(path))


def _directory_of(path: str | os.PathLike[str]) -> str:
    """The directory ``path`` is looked up in (``..`` after a link is left to the kernel, not folded)."""
    return os.path.dirname(os.path.join(os.getcwd(), os.fspath(path))) or "/"


def _existing_reason(st: os.stat_result, directory: str) -> str | None:
    """Why a file found in an output's place (``lstat``, or ``fstat`` of what was opened) must not be written."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link, which is never followed (another user may have planted it); remove it"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if others_can_write(os.stat(directory)):  # sticky (place_reason): e.g. /tmp, where anyone may create it
        uid = os.geteuid()
        if st.st_uid != uid:
            return (
                f"belongs to uid {st.st_uid}, not to this user (uid {uid}), in {directory}, where other "
                "users can create files"
            )
        if st.st_nlink > 1:
            return f"has {st.st_nlink} hard links, in {directory}, where other users can create files"
    return None


def output_dir_reason(path: str | os.PathLike[str]) -> str | None:
    """Why another user could add, swap or remove files in directory ``path`` that melfeed writes many
    files into (a cache, ``deploy``'s units); ``None`` if only this user, its groups or root can: the
    directory is this user's or root's, no other user can write to it (sticky is not enough: another user
    could create a subdirectory or a link that melfeed then writes through), and ``place_reason``.

    Raises:
        OSError: it cannot be examined (e.g. it does not exist).
    """
    reason = place_reason(path)
    if reason is not None:
        return reason
    st, uid = os.stat(path), os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (uid, 0):
        return f"belongs to uid {st.st_uid}, neither this user ({uid}) nor root"
    if others_can_write(st):
        return f"is mode {stat.S_IMODE(st.st_mode):04o}: other users can write to it"
    return None


def check_output_dir(path: str | os.PathLike[str], what: str | None = None) -> None:
    """``output_dir_reason`` as one ``ConfigError`` naming ``what``.

    Raises:
        ConfigError: another user could change what is in the directory, or where it is.
        OSError: it cannot be examined.
    """
    reason = output_dir_reason(path)
    if reason is not None:
        raise ConfigError(f"refusing to write in {os.fspath(path)}: {reason}", path=(what,) if what else ())


def _refused(path: str | os.PathLike[str], reason: str, what: str | None) -> ConfigError:
    return ConfigError(f"refusing to write {os.fspath(path)}: {reason}", path=(what,) if what else ())


def check_output(path: str | os.PathLike[str], what: str | None = None) -> None:
    """``output_reason`` as one ``ConfigError`` naming ``what``; before the work that ends in the write.

    Raises:
        ConfigError: writing it could land on a file another user chose.
        OSError: its directory is missing or cannot be examined.
    """
    reason = output_reason(path)
    if reason is not None:
        raise _refused(path, reason, what)


def open_output(path: str | os.PathLike[str], *, append: bool, what: str | None = None) -> int:
    """A write descriptor on ``path``: appended to, or truncated; created ``OUTPUT_FILE_MODE`` if absent.

    Never through a symbolic link in the file's place (``O_NOFOLLOW``), never on a FIFO or device (opened
    without blocking, then ``fstat``), never on another user's file (or a hard link) in a directory others
    can write to, never in a place another user controls (``place_reason``). An existing file is
    truncated only after these checks passed on the descriptor.

    Raises:
        ConfigError: one of the refusals above, naming ``what`` and the file.
        OSError: it cannot be opened or created.
    """
    check_output(path, what)
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_APPEND if append else 0)
    try:
        fd = os.open(path, flags, OUTPUT_FILE_MODE)
    except OSError:
        # Something put there since check_output: a link (ELOOP; EACCES from O_CREAT on some kernels), a
        # FIFO nobody reads (ENXIO). Name it as check_output would; any other error is the OS's.
        try:
            reason = _existing_reason(os.lstat(path), _directory_of(path))
        except OSError:
            reason = None
        if reason is not None:
            raise _refused(path, reason, what) from None
        raise
    try:
        reason = _existing_reason(os.fstat(fd), _directory_of(path))
        if reason is not None:
            raise _refused(path, reason, what)
        os.set_blocking(fd, True)
        if not append:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_output(path: str | os.PathLike[str], text: str | bytes, *, what: str | None = None) -> None:
    """Replace the contents of ``path`` with ``text`` (str: UTF-8) in place (``open_output``); a new file
    is ``OUTPUT_FILE_MODE``, an existing one keeps its mode.

    Raises:
        ConfigError: ``open_output`` refused the path.
        OSError: the file cannot be opened or written.
    """
    data = text.encode("utf-8") if isinstance(text, str) else text
    with _signals_held(), os.fdopen(open_output(path, append=False, what=what), "wb") as out:
        out.write(data)


_HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGTERM/SIGINT/SIGHUP for the duration, then deliver each one that came, to the handler that
    was in place (the default action included: the process still ends, with its signal's status).

    The file is truncated before it is written; the default action in between would end the process with
    an empty file (a path the user kept the old report at). Only the main thread can set handlers; from
    another thread the write goes unguarded (nothing melfeed runs writes a report from one).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: came.append(signum)) for s in _HELD_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)


def create_new(path: str | os.PathLike[str], data: bytes, mode: int, *, what: str | None = None) -> None:
    """Create ``path`` (it must not exist, not even as a link) with exactly ``mode``, then write ``data``.

    For a secret: the mode is set on the descriptor before the first byte, so no umask (000 included)
    leaves a moment in which others could open it.

    Raises:
        ConfigError: ``place_reason`` refused the path (naming ``what``).
        FileExistsError: something is already there.
        OSError: it cannot be created or written.
    """
    reason = place_reason(path, follow=False)
    if reason is not None:
        raise _refused(path, reason, what)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o600)
    try:
        os.fchmod(fd, mode)
        _write_all(fd, data)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def replace_output(path: str | os.PathLike[str], data: bytes, mode: int, *, what: str | None = None) -> None:
    """Replace ``path`` atomically with a new file of exactly ``mode`` holding ``data``: a temporary file
    (random name, created exclusively) in the same directory, fsynced, renamed over it. The rename
    replaces whatever is there, a symbolic link included, and never writes through it.

    Raises:
        ConfigError: ``place_reason`` refused the path (naming ``what``).
        OSError: it cannot be written (nothing is left behind).
    """
    reason = place_reason(path, follow=False)
    if reason is not None:
        raise _refused(path, reason, what)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        _write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
