"""Command-line values that are not config keys: numbers, output files, and input files read whole.

Role: the refusals several commands share, so that none can forget one (docs/reference/exit-codes.md, 78):

- ``check_number``: a float flag is finite and above (or at) its floor; ``nan`` passes every ``<``
  comparison, so a check written as ``if value <= 0`` lets it through;
- ``check_output_file``: a file a command writes at its END (``bench --json``, ``audit --json``,
  ``run --summary-json``) is checked BEFORE any work: not a directory, its directory exists and is
  writable, an existing file is writable, and no other user could make the write land elsewhere (a
  symbolic link in its place, a file planted in /tmp: ``melfeed.shared.output_files.output_reason``); a mistake
  found after an hour of trials loses the results. The write itself (``melfeed.shared.output_files.write_output``)
  checks again on its descriptor;
- ``check_not_an_input``: an output file is none of the command's input files (same path after
  resolving links, or the same inode), so ``report m.jsonl -o m.jsonl`` cannot overwrite its data;
- ``read_regular_file``: a whole input file read under the config file's rules (regular file, opened
  without blocking, at most a documented number of bytes), so ``/dev/zero`` or a FIFO never hangs;
- ``resolve_path``: ``Path.resolve()`` of a path a user gave, where a loop of symbolic links is one line
  naming the flag or key (Python before 3.13 raises ``RuntimeError`` there, a traceback at the top level).

Invariant: every refusal is one ``ConfigError`` naming the flag or the file. Pure of globals.
Shutdown: nothing to shut down; a descriptor is closed before returning.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from melfeed.shared.cache.filekind import OPEN_FLAGS, mode_kind, not_regular_reason
from melfeed.shared.errors import ConfigError
from melfeed.shared.output_files import check_output

__all__ = ["check_number", "check_output_file", "check_not_an_input", "read_regular_file", "resolve_path"]

_CHUNK = 1 << 24  # bytes per read of a large file


def check_number(
    value: float, flag: str, *, floor: float = 0.0, above: bool = False, ceiling: float | None = None
) -> float:
    """``value`` if it is finite, ``>= floor`` (``> floor`` with ``above``) and ``<= ceiling`` (if given);
    else one line naming ``flag``."""
    ok = math.isfinite(value) and (value > floor if above else value >= floor)
    if not ok:
        raise ConfigError(f"must be a finite number {'>' if above else '>='} {floor:.15g}", path=(flag,), got=value)
    if ceiling is not None and value > ceiling:
        raise ConfigError(f"must be <= {ceiling:.15g}", path=(flag,), got=value)
    return value


def check_output_file(path: str | None, flag: str) -> None:
    """Before any work: ``path`` (``None``: not written) can be written as a file.

    Raises:
        ConfigError: naming ``flag``: the path is a directory, its directory is missing or not writable,
            the file exists and is not writable, or another user could redirect the write
            (``melfeed.shared.output_files.check_output``).
    """
    if path is None:
        return
    if path == "" or path.endswith(os.sep) or os.path.isdir(path):
        raise ConfigError("is a directory; name a file to write", path=(flag,), got=path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"directory {directory} does not exist", path=(flag,), got=path)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"directory {directory} is not writable", path=(flag,), got=path)
    try:
        check_output(path, flag)
    except OSError as err:
        raise ConfigError(f"cannot examine its directory: {err.strerror or err}", path=(flag,), got=path) from None
    if os.path.lexists(path) and not os.access(path, os.W_OK):
        raise ConfigError("exists and is not writable", path=(flag,), got=path)


def check_not_an_input(output: str, inputs: Sequence[str], flag: str) -> None:
    """Refuse an ``output`` that is one of ``inputs``: the same resolved path or the same file (inode)."""
    try:
        out_st: os.stat_result | None = os.stat(output)
    except OSError:
        out_st = None  # not there yet: only a path comparison can match
    resolved = os.path.realpath(output)
    for source in inputs:
        same_path = os.path.realpath(source) == resolved
        try:
            st = os.stat(source)
            same_file = out_st is not None and (st.st_dev, st.st_ino) == (out_st.st_dev, out_st.st_ino)
        except OSError:
            same_file = False
        if same_path or same_file:
            raise ConfigError(
                f"is the input file {source}; writing it would destroy the input", path=(flag,), got=output
            )


def read_regular_file(path: str | os.PathLike[str], max_bytes: int | None, what: str) -> bytes:
    """The bytes of ``path``: a regular file (opened without blocking) of at most ``max_bytes`` (None: any).

    Raises:
        ConfigError: one line starting with the path: cannot be opened or read, not a regular file
            (directory, FIFO, device), or larger than ``max_bytes`` (also if it grows while read).
    """

    def fail(reason: str) -> ConfigError:
        return ConfigError(f"cannot read {what}: {reason}", path=(str(path),))

    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as err:
        raise fail(err.strerror or str(err)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fail(not_regular_reason(mode_kind(st.st_mode)))
        if max_bytes is not None and st.st_size > max_bytes:
            raise fail(f"{st.st_size} bytes, more than the {max_bytes} allowed")
        chunks, have = [], 0
        while True:  # with max_bytes, bounded even if the file grows while it is read
            want = _CHUNK if max_bytes is None else min(_CHUNK, max_bytes + 1 - have)
            chunk = os.read(fd, want) if want > 0 else b""
            if not chunk:
                break
            chunks.append(chunk)
            have += len(chunk)
    except OSError as err:
        raise fail(err.strerror or str(err)) from None
    finally:
        os.close(fd)
    if max_bytes is not None and have > max_bytes:
        raise fail(f"grew past the {max_bytes} bytes allowed while being read")
    return b"".join(chunks)


def resolve_path(path: str | os.PathLike[str], key: tuple[str, ...]) -> Path:
    """``Path(path).resolve()``: absolute, with every symbolic link followed (a missing tail is kept as is).

    Raises:
        ConfigError: naming ``key`` (a flag or a config key path) and the path: a loop of symbolic links
            (``RuntimeError`` before Python 3.13) or any other OS error while following the links.
    """
    try:
        return Path(path).resolve()
    except RuntimeError:  # "Symlink loop from ...": Python < 3.13 raises this, not OSError
        raise ConfigError(f"cannot resolve {os.fspath(path)}: a loop of symbolic links", path=key) from None
    except OSError as err:
        raise ConfigError(f"cannot resolve {os.fspath(path)}: {err.strerror or err}", path=key) from None
