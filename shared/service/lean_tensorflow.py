"""TensorFlow's import in melfeed's own processes: without the optional packages it pulls in only because they
are installed, and quiet.

``import tensorflow`` imports JAX (``tensorflow.lite.python.util`` looks for ``jax.jit``) and matplotlib
(Keras's ``keras.src.visualization``) whenever they are installed, which melfeed's ``jax`` and ``report``
extras do. Neither is used by a process that trains, measures or prepares with TensorFlow, and the two cost
1.1-1.5 s of CPU at every start on the 2-core development machine (docs/performance.md, "TensorFlow's
import without JAX and matplotlib"). Both modules guard the import and fall back: TFLite's JAX conversion
and Keras's image-gallery plot become unavailable, and neither is reachable from melfeed.

``skip_optional_imports_of_tensorflow()`` installs an import finder that refuses ``jax`` and ``matplotlib``
(and their submodules) to code inside the ``tensorflow`` and ``keras`` packages, and only while
``import tensorflow`` itself runs. Any other importer, a user's model step included, imports them as
usual, and so does Keras afterwards (a ``keras.layers.JaxLayer`` in a user's model still finds JAX).
melfeed's own process entry points call it (the ``melfeed`` command, bench trials, doctor probes, prepare
workers); the library never does, so a user's process keeps TensorFlow's ordinary import.

Quiet: at melfeed's default log level its processes print melfeed's own lines only. ``quiet_tensorflow_logs``
(the ``melfeed`` command, once the log level is known) exports ``TF_CPP_MIN_LOG_LEVEL=3`` unless the user set it
or the level is DEBUG; children inherit it. "3", not "2": on a host without a GPU driver TensorFlow logs
``failed call to cuInit ... (303)`` at ERROR. TensorFlow applies that variable only after its libraries are loaded,
so the lines they log while loading (``cudart_stub.cc ... Could not find cuda drivers``, and absl's "All log
messages before absl::InitializeLog()" preamble) ignore it: ``quiet_tensorflow_import`` (called by the same entry
points as ``skip_optional_imports_of_tensorflow``) installs a finder that runs ``import tensorflow`` with file
descriptor 2 read through a pipe, dropping the lines of TensorFlow's C++ log format below the variable's level
(``is_hidden_line``) and passing every other byte on as it comes; the ``tensorflow`` and ``absl`` Python loggers get
the same threshold. A child spawned while the import runs would inherit the pipe: the forwarding thread then
serves it, while this process runs, until its last writer exits.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from types import FrameType, ModuleType
from typing import Any

__all__ = [
    "SKIPPED_PACKAGES",
    "TF_LOG_LEVEL_ENV",
    "is_hidden_line",
    "quiet_tensorflow_import",
    "quiet_tensorflow_logs",
    "skip_optional_imports_of_tensorflow",
]

SKIPPED_PACKAGES = ("jax", "matplotlib")
_IMPORTERS = ("tensorflow", "keras")  # the packages whose imports of them are refused
_FROZEN_MACHINERY = "<frozen importlib"  # frames between the importing code and the finder
_IMPORT_MODULE = "importlib/__init__.py"  # importlib.import_module, as Keras's lazy modules call it


class _RefuseToTensorFlow(importlib.abc.MetaPathFinder):
    """Raises ModuleNotFoundError for a skipped package when the importing code is TensorFlow's or Keras's."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if (
            fullname.partition(".")[0] not in SKIPPED_PACKAGES
            or not _tensorflow_importing()
            or not _imported_from_tensorflow(sys._getframe(1))
        ):
            return None  # the usual finders decide
        raise ModuleNotFoundError(
            f"{fullname} is not imported by TensorFlow in a melfeed process (shared/service/lean_tensorflow.py)",
            name=fullname,
        )


def _tensorflow_importing() -> bool:
    """``import tensorflow`` is running: its module exists and its spec is still marked initialising (CPython
    sets ``_initializing`` while a module's code runs; without the mark nothing is refused)."""
    module = sys.modules.get("tensorflow")
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _imported_from_tensorflow(frame: FrameType | None) -> bool:
    """The first frame outside the import machinery runs code of a ``tensorflow`` or ``keras`` module."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(_FROZEN_MACHINERY) or frame.f_code.co_filename.endswith(_IMPORT_MODULE)
    ):
        frame = frame.f_back
    if frame is None:
        return False
    module = str(frame.f_globals.get("__name__", ""))
    return module.partition(".")[0] in _IMPORTERS


def skip_optional_imports_of_tensorflow() -> None:
    """Install the finder once per process (before TensorFlow's first import; later it changes nothing)."""
    if not any(isinstance(f, _RefuseToTensorFlow) for f in sys.meta_path):
        sys.meta_path.insert(0, _RefuseToTensorFlow())


TF_LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
_QUIET_LEVEL = "3"  # only FATAL: "2" still shows cuInit's ERROR line on a host without a GPU driver
_NATIVE_LINE = re.compile(rb"^([IWEF])\d{4} ")  # absl's prefix: severity letter, MMDD, then the time
_SEVERITIES = b"IWEF"  # index = the TF_CPP_MIN_LOG_LEVEL that hides lines of lower severity
_ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_PYTHON_LEVELS = (logging.NOTSET, logging.WARNING, logging.ERROR, logging.ERROR)  # by TF_CPP_MIN_LOG_LEVEL
_DRAIN_S = 2.0  # the forwarder's last bytes after the import: a pipe read, nothing slow


def quiet_tensorflow_logs(log_level: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """``TF_CPP_MIN_LOG_LEVEL=3`` in ``environ`` (children inherit it) unless it is set or ``log_level`` is DEBUG."""
    if log_level.strip().upper() != "DEBUG":
        environ.setdefault(TF_LOG_LEVEL_ENV, _QUIET_LEVEL)


def is_hidden_line(line: bytes, min_level: int) -> bool:
    """A line of TensorFlow's C++ log (``I0000 00:00:...``) below ``min_level``, or absl's preamble (level >= 1)."""
    if line.startswith(_ABSL_PREAMBLE):
        return min_level >= 1
    match = _NATIVE_LINE.match(line)
    return match is not None and _SEVERITIES.index(match.group(1)) < min_level


def _min_level(environ: MutableMapping[str, str]) -> int:
    value = environ.get(TF_LOG_LEVEL_ENV, "").strip()
    return int(value) if value in ("0", "1", "2", "3") else 0


class _QuietLoader(importlib.abc.Loader):
    """Runs TensorFlow's package ``__init__`` with the native log filtered; everything else goes to its loader."""

    def __init__(self, loader: Any, min_level: int) -> None:
        self._loader = loader
        self._min_level = min_level

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        for name in ("tensorflow", "absl"):
            logging.getLogger(name).setLevel(_PYTHON_LEVELS[self._min_level])
        try:
            with _filtered_stderr(self._min_level):
                self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader  # TensorFlow's own loader from here on
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader


class _QuietTensorFlow(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``tensorflow`` itself (not its submodules) when ``TF_CPP_MIN_LOG_LEVEL`` is >= 1."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        level = _min_level(os.environ)
        if fullname != "tensorflow" or level == 0:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader, level)
        return spec


def quiet_tensorflow_import() -> None:
    """Install the quiet finder once per process (before TensorFlow's first import; later it changes nothing)."""
    if not any(isinstance(f, _QuietTensorFlow) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietTensorFlow())


@contextmanager
def _filtered_stderr(min_level: int) -> Iterator[None]:
    """File descriptor 2 through a pipe for the block: hidden lines dropped, the rest passed on as it comes."""
    sys.stderr.flush()
    target = os.dup(2)
    read_end, write_end = os.pipe()
    forwarder = threading.Thread(target=_forward, args=(read_end, target, min_level), name="tf-log-filter", daemon=True)
    forwarder.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(target, 2)  # the pipe's last writer here: the forwarder reads its end of file
        forwarder.join(_DRAIN_S)


def _forward(read_end: int, target: int, min_level: int) -> None:
    pending = b""
    try:
        while chunk := os.read(read_end, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not is_hidden_line(line, min_level))
            _write_all(target, kept)
        if not is_hidden_line(pending, min_level):
            _write_all(target, pending)
    finally:
        os.close(read_end)
        os.close(target)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
