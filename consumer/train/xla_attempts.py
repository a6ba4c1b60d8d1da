"""XLA compiles in flight, on disk: a crash of the XLA compiler costs one start, never every start.

Role: a TensorFlow check failure inside an XLA compile aborts the process (SIGABRT): nothing in Python runs
after it. So before each XLA compile of the warm-up (one bucket's program, then the packed programs), the
attempt is written to ``STATE_DIR/xla_attempts.json`` (atomically: temp file, fsync, rename, fsync of the
directory), and cleared when the compile returns, whether it compiled or failed in Python. An attempt found
there at start was never finished: the process died compiling it. With ``model.jit_compile: auto`` that step
then trains in graph mode, without trying XLA again (one WARNING naming the file; ``jit_reason`` says so);
``true`` stops with one line instead (XLA or nothing). Deleting the file tries XLA again.

An attempt names the program: the step (``model.step`` and a hash of ``model.params``), the XLA cache
namespace (the directory TensorFlow caches into: its version, the GPU model and driver, the XLA flags;
consumer/xla_cache.py) and the bucket's shapes. A recorded crash keeps XLA off for the step (the mode is the
step's, not one bucket's) while the step and the namespace are the same; another step or another
TensorFlow, GPU or flag set tries again.
Without a state directory nothing is recorded: a compile that aborts the process aborts every start.
Invariant: the file holds at most one open attempt (the warm-up compiles one program at a time) and the list
of programs that crashed.
Shutdown: nothing to release; a closed attempt leaves no open entry behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from melfeed.consumer.resume.filemode import write_private
from melfeed.consumer.train.jit import JitChoice
from melfeed.consumer.xla_cache import active_xla_cache_dir
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import StepError

__all__ = ["ATTEMPTS_NAME", "XlaAttempts", "step_key"]

log = logging.getLogger(__name__)

ATTEMPTS_NAME = "xla_attempts.json"  # in consumer.state_dir
_HASH_CHARS = 12  # 48 bits: two parameter sets of one state directory never meet


def step_key(cfg: PipelineConfig, environ: Mapping[str, str] | None = None) -> str:
    """The step's identity in the attempts file: ``model.step``, a hash of ``model.params`` and the XLA cache
    namespace (the name of the directory TensorFlow caches into; without a cache, a hash of the XLA flags)."""
    environ = os.environ if environ is None else environ
    cache = active_xla_cache_dir(environ)
    flags = [environ.get("TF_XLA_FLAGS", ""), environ.get("XLA_FLAGS", "")]
    params = json.dumps(cfg.model.params, sort_keys=True, default=str)
    return (
        f"{cfg.model.step} params {_short_hash(params)} xla "
        f"{cache.name if cache is not None else 'flags' + _short_hash(json.dumps(flags))}"
    )


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]


class XlaAttempts:
    """The XLA attempts of one step in a state directory (``None``: no directory, nothing recorded).

    Args:
        state_dir: ``consumer.state_dir`` (open: ``RunState.root``), or None.
        step: the step's identity: ``model.step``, a hash of ``model.params``, the XLA cache namespace.
    """

    def __init__(self, state_dir: Path | None, step: str) -> None:
        self._path = state_dir / ATTEMPTS_NAME if state_dir is not None else None
        self._step = step
        self._doc: dict[str, Any] = {"open": None, "crashed": []}
        if self._path is not None:
            self._doc = _read(self._path)
            if self._doc["open"] is not None:  # the last start died compiling it
                self._doc["crashed"].append(self._doc["open"])
                self._doc["open"] = None
                self._write()

    @property
    def path(self) -> Path | None:
        return self._path

    def crash_reason(self) -> str | None:
        """Why XLA is not tried for this step (a program of it killed an earlier start's compile), or None."""
        found = [a for a in self._doc["crashed"] if isinstance(a, dict) and a.get("step") == self._step]
        if not found:
            return None
        return (
            f"an earlier start died compiling it with XLA ({found[-1].get('program')}; {self._path}: delete "
            "it to try XLA again)"
        )

    def crash_choice(self, setting: str | bool, factory: str) -> JitChoice | None:
        """Graph mode (with one WARNING) when ``crash_reason`` says XLA is not tried, else None; ``StepError``
        under ``jit_compile: true`` (``setting``: XLA or nothing)."""
        reason = self.crash_reason()
        if reason is None:
            return None
        if setting is True:
            raise StepError(factory, f"XLA cannot compile the step (jit_compile: true): {reason}")
        log.warning("XLA is not tried for the step of %s, using graph mode: %s", factory, reason)
        return JitChoice("graph", f"XLA not tried: {reason}")

    @contextmanager
    def compiling(self, program: str) -> Iterator[None]:
        """Record ``program``'s XLA compile as open for the time of the ``with`` block, durably before it starts."""
        if self._path is None:
            yield
            return
        self._doc["open"] = {"step": self._step, "program": program, "pid": os.getpid()}
        self._write()
        try:
            yield
        finally:
            self._doc["open"] = None
            self._write()

    def _write(self) -> None:
        if self._path is None:
            return
        tmp = self._path.with_suffix(".tmp")
        try:
            write_private(tmp, (json.dumps(self._doc) + "\n").encode())
            _fsync(tmp, os.O_RDONLY)
            os.replace(tmp, self._path)
            _fsync(self._path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as err:  # not fatal: only a crash of XLA in this start would then go unnoticed
            log.warning(
                "cannot write %s: %s; an XLA compile that kills the process would not be remembered",
                self._path,
                err.strerror,
            )


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path) -> dict[str, Any]:
    """The file's document; a missing or damaged one is empty (damaged: one WARNING; XLA is tried again)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"open": None, "crashed": []}
    except (OSError, ValueError) as err:
        log.warning("ignoring %s: %s", path, err)
        return {"open": None, "crashed": []}
    if not isinstance(doc, dict):
        log.warning("ignoring %s: not a JSON object", path)
        return {"open": None, "crashed": []}
    crashed = doc.get("crashed")
    return {
        "open": doc.get("open") if isinstance(doc.get("open"), dict) else None,
        "crashed": crashed if isinstance(crashed, list) else [],
    }
