"""Process plumbing shared by both sides: signals, runtime directory, parent-death, logging.

Signal handlers only set an Event; they are installed in ``main()`` and restored on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import stat
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from melfeed.shared.config import PipelineConfig, resolve_runtime_dir
from melfeed.shared.errors import ConfigError
from melfeed.shared.filetrust import make_dirs

__all__ = [
    "stop_on_signals",
    "exit_on_sigterm",
    "Terminated",
    "raise_fd_limit",
    "prepare_runtime_dir",
    "check_runtime_dir",
    "resolve_endpoint",
    "resolve_control_endpoint",
    "die_with_parent",
    "die_with_named_parent",
    "PARENT_PID_ENV",
    "setup_logging",
    "log_level",
    "LOG_LEVELS",
    "LOG_LEVEL_ENV",
]

_PR_SET_PDEATHSIG = 1
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL_ENV = "MELFEED_LOG_LEVEL"  # the default of --log-level; children are started with it
PARENT_PID_ENV = "MELFEED_PARENT_PID"  # a supervisor's pid, for its children's ``die_with_parent``
_FD_RESERVE = 256  # descriptors beyond the connection bound: TensorFlow, slot files, checkpoint writes

log = logging.getLogger(__name__)


@contextlib.contextmanager
def stop_on_signals(*signums: int) -> Iterator[threading.Event]:
    """Yield an Event set by SIGTERM/SIGINT (or ``signums``); restore the old handlers after."""
    stop = threading.Event()
    sigs = signums or (signal.SIGTERM, signal.SIGINT)
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in sigs}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class Terminated(SystemExit):
    """SIGTERM reached a one-shot child under ``exit_on_sigterm``: exit ``128 + SIGTERM`` once unwound."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in the main thread (once; a second one during the unwinding is ignored).

    For one-shot children (a bench trial, a doctor probe) whose work runs deep in library code with no stop
    event to look at: the default action would end them with their temporary directories, slot files and
    producer groups left behind; the exception runs every ``with``/``finally`` on the way out instead. Their
    parent's stop ladder still follows with SIGKILL if the unwinding outlasts its wait.
    """
    raised = False

    def _raise(signum: int, frame: object) -> None:
        # Deviates from "handlers only set an Event": these processes have no loop of their own to check one.
        nonlocal raised
        if not raised:
            raised = True
            raise Terminated()

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def prepare_runtime_dir(path: Path) -> Path:
    """Create the socket directory, and its missing parents, with mode 0700 (0770 is kept if systemd made it so).

    Raises:
        ConfigError: it cannot be made, belongs to another user, or others can write to it: anyone
            who can write there can replace the socket or the lock file (docs/security.md "Who can connect").
    """
    try:
        make_dirs(path, 0o700)  # missing parents too: mkdir(parents=True) left them to the umask
    except OSError as err:
        raise ConfigError(
            f"cannot create runtime directory: {err.strerror}", path=("runtime_dir",), got=str(path)
        ) from err
    return check_runtime_dir(path)


def check_runtime_dir(path: Path) -> Path:
    """``path`` if it is fit to hold sockets: this user's, a link only if this user's or root's, writable by
    no other user (group writes only for one of this user's groups).

    Raises:
        ConfigError: it is not (one line naming the directory and why).
    """
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.getuid(), 0):
        # Its owner could point it elsewhere at any time (a symlink in sticky /tmp is still the owner's).
        raise ConfigError(
            f"runtime directory is a symbolic link owned by uid {link.st_uid}, not by this user",
            path=("runtime_dir",),
            got=str(path),
        )
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigError("runtime directory belongs to another user", path=("runtime_dir",), got=str(path))
    mode = stat.S_IMODE(st.st_mode)
    foreign_group = st.st_gid != os.getgid() and st.st_gid not in os.getgroups()
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and foreign_group):
        who = "every user" if mode & stat.S_IWOTH else f"group {st.st_gid}, which is not ours,"
        raise ConfigError(
            f"runtime directory {path} is mode {mode:04o}: {who} can write to it (and replace its "
            "socket); make it 0700 or 0770 for the service group",
            path=("runtime_dir",),
        )
    return path


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (what ``LimitNOFILE=`` sets); returns the soft limit.

    The headroom absorbs a burst of connections accepted faster than the connection guard cuts them
    (``consumer/transport/conn_guard.py``); a limit below ``max_connections`` plus a reserve is one WARNING.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("descriptor limit raised from %d to the hard limit %d", soft, hard)
            soft = hard
        except (OSError, ValueError) as err:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, err)
    if soft != resource.RLIM_INFINITY and soft < max_connections + _FD_RESERVE:
        log.warning(
            "descriptor limit %d leaves little room beyond transport.max_connections=%d (wanted >= %d: "
            "raise LimitNOFILE= or ulimit -Hn, or lower transport.max_connections)",
            soft,
            max_connections,
            max_connections + _FD_RESERVE,
        )
    return soft


def resolve_endpoint(cfg: PipelineConfig, environ: Mapping[str, str], *, create_dir: bool = True) -> str:
    """The configured endpoint, or ``ipc://<private runtime dir>/melfeed.sock`` (the directory is made,
    and refused if others control it, only with ``create_dir``)."""
    if cfg.transport.endpoint is not None:
        return cfg.transport.endpoint
    runtime = resolve_runtime_dir(environ)
    return f"ipc://{prepare_runtime_dir(runtime) if create_dir else runtime}/melfeed.sock"


def resolve_control_endpoint(cfg: PipelineConfig, environ: Mapping[str, str], *, create_dir: bool) -> str:
    """Where the consumer serves ``status``: ``consumer.control_endpoint``; else, for a transport
    endpoint ``ipc://DIR/NAME.sock``, ``ipc://DIR/NAME.control.sock``; else
    ``ipc://<private runtime dir>/melfeed-control.sock`` (the directory is made only with ``create_dir``).
    """
    if cfg.consumer.control_endpoint is not None:
        return cfg.consumer.control_endpoint
    data = cfg.transport.endpoint
    if data is not None and data.startswith("ipc://"):
        return f"{data.removesuffix('.sock')}.control.sock"
    runtime = resolve_runtime_dir(environ)
    if create_dir:
        prepare_runtime_dir(runtime)
    return f"ipc://{runtime / 'melfeed-control.sock'}"


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no orphaned producers).

    Call it from the main thread: the setting belongs to the calling thread (it ends with that thread),
    and it is cleared in every child this process forks, so each generation arms its own.
    ``parent_pid``: the pid of the parent that started us. A parent killed before this call sends no
    signal, so when our parent is no longer that process, ``sig`` is raised here at once.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.warning(
                "cannot ask for %s when the parent dies: %s", signal.Signals(sig).name, os.strerror(ctypes.get_errno())
            )
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def die_with_named_parent(sig: int = signal.SIGTERM, environ: Mapping[str, str] | None = None) -> bool:
    """``die_with_parent`` with the parent pid that ``MELFEED_PARENT_PID`` (``PARENT_PID_ENV``) names.

    A supervisor that wants its children to die with it names itself there (``child_env`` never passes
    the variable on by itself: a grandchild must not follow its grandparent). Returns False, and arms
    nothing, when no parent is named: a process started by hand or by systemd follows nobody.
    """
    parent = (os.environ if environ is None else environ).get(PARENT_PID_ENV, "")
    if not parent.isdigit():
        return False
    die_with_parent(sig, parent_pid=int(parent))
    return True


def log_level(text: str, source: str = "--log-level") -> int:
    """``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or ``CRITICAL`` (any case) as logging's number.

    Raises:
        ConfigError: anything else, naming ``source`` (``--log-level`` or ``MELFEED_LOG_LEVEL``): never
            a silent fall-back to INFO, never ``logging``'s other attributes (``basic_format``).
    """
    name = text.strip().upper() if isinstance(text, str) else ""
    if name not in LOG_LEVELS:
        raise ConfigError(f"must be one of {', '.join(LOG_LEVELS)} (any case)", path=(source,), got=text)
    return int(getattr(logging, name))


def setup_logging(level: str = "INFO", source: str = "--log-level") -> None:
    """Log to stderr (journald under systemd) with the process name on every line.

    Raises:
        ConfigError: ``level`` is not a level name (``log_level``); nothing is configured then.
    """
    logging.basicConfig(
        level=log_level(level, source),
        stream=sys.stderr,
        format="%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("absl").setLevel(logging.WARNING)  # TensorFlow's checkpoint writer chatters at INFO
