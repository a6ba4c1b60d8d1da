"""Error types shared by producer and consumer.

Programmer errors raise built-ins; conditions an operator must act on raise these.
Every error here renders as one line (``str(err)``) suitable for a CLI message, and carries the exit code
(``exit_code``) a command exits with when it ends on that error (``melfeed.cli.main``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from melfeed.shared.printable import escape_line

if TYPE_CHECKING:
    from melfeed.shared.wire.messages import RejectCode

__all__ = [
    "PipelineError",
    "ConfigError",
    "CacheError",
    "DataError",
    "ProtocolError",
    "ClosedError",
    "EXIT_CONFIG",
    "EXIT_DATA",
    "EXIT_JOB_LOST",
    "JobLostError",
    "MAX_REASON_CHARS",
    "StateError",
    "StepError",
]

EXIT_CONFIG = 78  # sysexits EX_CONFIG; systemd units list it in RestartPreventExitStatus
EXIT_DATA = 65  # sysexits EX_DATAERR: the training data cannot be used (consumer.service: RestartPreventExitStatus)
EXIT_JOB_LOST = 75  # sysexits EX_TEMPFAIL: a multi-worker job lost a rank; restarting every rank resumes it
_MAX_LINE_CHARS = 2000  # a ConfigError's whole text: a long path plus a value, never a screenful
MAX_REASON_CHARS = 200  # ProtocolError.why, ERR.why and BYE.why: one log line, never a traceback


class PipelineError(Exception):
    """Root of melfeed's own errors; caught at process boundaries. Exit 1: the command failed; read its line."""

    exit_code: int = 1


class ConfigError(PipelineError):
    """A configuration value is wrong (exit 78): fix the key, file or flag the line names; a restart cannot help.

    Carries the key path and the offending value.
    """

    exit_code = EXIT_CONFIG

    def __init__(self, message: str, *, path: tuple[str, ...] = (), got: Any = None) -> None:
        self.path = path
        self.got = got
        self.reason = message
        where = ".".join(path)
        text = f"{where}: {message}" if where else message
        if got is not None:
            text = f"{text}, got {_shown(got)}"
        super().__init__(_one_line(text))


def _shown(got: Any) -> str:
    """``repr(got)`` on one line, cut to ``MAX_SHOWN_CHARS``; a value whose repr fails (a 5000-digit int)
    is named by its type."""
    try:
        return escape_line(repr(got))
    except ValueError:  # int too large to convert to str
        return f"a value of type {type(got).__name__} that cannot be shown"


def _one_line(text: str) -> str:
    """Escape newlines and other control characters (from a key or value in a hostile file)."""
    return text if text.isprintable() else escape_line(text, _MAX_LINE_CHARS)


class CacheError(PipelineError):
    """A cache file is missing or malformed (exit 78): rebuild or restore the file the line names."""

    exit_code = EXIT_CONFIG

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class DataError(PipelineError):
    """The training data went bad mid-run (exit 65): repair the data, or raise the tolerance the line names.

    Today: more rows quarantined than ``producer.max_quarantined_fraction`` allows
    (``consumer/train/quarantine.py``). One line naming the key and what was seen; the run stops in
    order (final checkpoint, summary) and the process exits ``EXIT_DATA`` (65): neither a configuration
    error (78) nor something a restart fixes, so the consumer unit does not restart on it.
    """

    exit_code = EXIT_DATA

    def __init__(self, message: str) -> None:
        self.reason = message
        super().__init__(_one_line(message))


class StateError(PipelineError):
    """The state directory (checkpoints, audit log) cannot be used as it is (exit 78): fix or move the path named.

    ``fatal`` (a mismatch a restart cannot fix, e.g. another dataset's checkpoint) exits 78; otherwise
    (a write failed: disk full, read-only) the error's ``exit_code`` is 1 and the process may be restarted.
    """

    exit_code = EXIT_CONFIG

    def __init__(self, path: object, reason: str, *, fatal: bool = True) -> None:
        self.path = str(path)
        self.reason = reason
        self.fatal = fatal
        if not fatal:
            self.exit_code = PipelineError.exit_code
        super().__init__(f"{self.path}: {reason}")


class ProtocolError(PipelineError):
    """A wire message is malformed (exit 1): the peer speaks another protocol or is broken; see its own log.

    ``code`` is the reject code sent back in ERR.

    ``why`` is logged; ``reply`` (default: ``why``) is what the peer is told, for reasons that name
    what an unauthenticated peer must not learn (the consumer's contract).
    """

    def __init__(self, code: RejectCode, why: str, *, reply: str | None = None) -> None:
        self.code = code
        self.why = why[:MAX_REASON_CHARS]
        self.reply = self.why if reply is None else reply[:MAX_REASON_CHARS]
        super().__init__(f"{code}: {self.why}")


class ClosedError(PipelineError):
    """We closed the ring or socket; waiters are woken with this (exit 1 if it reaches a command: a stop mid-wait)."""


class StepError(PipelineError):
    """The training step cannot run (exit 1): fix the step, or set ``model.jit_compile: false`` if XLA fails it.

    One line naming the step factory and the error as TensorFlow reports it (a factory that cannot be
    loaded at all is a ``ConfigError``, exit 78).
    """

    def __init__(self, factory: str, reason: str) -> None:
        self.factory = factory
        self.reason = reason
        super().__init__(f"model.step {factory}: {reason}")


class JobLostError(PipelineError):
    """A rank of a multi-worker job lost contact with the others (exit 75): restart every rank of the job.

    One line naming this rank and what TensorFlow's collectives reported; the process exits
    ``EXIT_JOB_LOST`` so that systemd (``Restart=on-failure``) or the operator restarts it, and the job
    resumes every rank from the newest checkpoint all ranks committed (a peer died, froze or stopped alone).
    """

    exit_code = EXIT_JOB_LOST

    def __init__(self, rank: int, why: str) -> None:
        self.rank = rank
        self.why = why
        super().__init__(
            _one_line(
                f"rank {rank}: lost contact with the job ({why}); restart every rank to "
                "resume from the newest common checkpoint"
            )
        )
