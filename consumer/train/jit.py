"""How each model's step is compiled: the ``model.jit_compile`` decision, free of clocks and TensorFlow.

Role: ``choose_mode`` turns the setting, an XLA failure (if any) and warm-up timings into the
mode the run uses; ``remembered_mode``/``remember_mode`` keep an "auto" decision in the state
directory (``STATE_DIR/jit_compile.json``), so a resumed run continues with the arithmetic it
started with instead of re-timing (timings on a busy machine can tip the other way); ``describe_tf_error``
turns a TensorFlow error into the one line an operator reads (the failing op or layer as TensorFlow names it,
the user's line that made it, then the first line of its message), ``describe_exception`` a Python exception
of user code (a step factory) into one line with that line.
``CompiledStep.warm_up`` (consumer/train/step.py) is the shell that compiles, times and calls these.
Invariants: the result is always "xla" or "graph"; ``jit_compile: true`` never yields "graph"
(its failure is an error, not a fallback); "auto" picks XLA only when it compiled and its median
warm-up step was not slower than graph mode's on the same batch.
Shutdown: nothing to release.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import statistics
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from melfeed.consumer.resume.filemode import write_private

__all__ = ["JitChoice", "choose_mode", "describe_exception", "describe_tf_error", "setting_name", "remembered_mode",
           "remember_mode", "stably_named", "MEMO_NAME"]

log = logging.getLogger(__name__)

MEMO_NAME = "jit_compile.json"   # in consumer.state_dir: the mode "auto" chose for this run

_NODE = re.compile(r"\{\{node ([^}]+)\}\}")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')   # a frame of "Detected at node ... defined at"
_PACKAGE_DIRS = ("site-packages", "dist-packages")   # frames there are libraries (Keras, TF), not the user's
_MAX_LINE_CHARS = 300   # one readable log line, even for a long TensorFlow message
_NAME_HASH_CHARS = 16   # 64 bits of the definition: two different programs of one process never meet


@dataclass(frozen=True, slots=True)
class JitChoice:
    """The compile mode of a run and why (reported in the READY line and the summary)."""

    mode: str                           # "xla" or "graph"
    reason: str                         # one line: what decided it
    xla_step_ms: float | None = None    # median warm-up step with XLA (auto, when XLA compiled)
    graph_step_ms: float | None = None  # median warm-up step in graph mode (auto, when XLA compiled)


def setting_name(setting: str | bool) -> str:
    """``model.jit_compile`` as written in YAML: auto, true or false."""
    return setting if isinstance(setting, str) else str(setting).lower()


def choose_mode(setting: str | bool, *, xla_error: str | None = None, remembered: str | None = None,
                xla_times_s: Sequence[float] = (), graph_times_s: Sequence[float] = ()) -> JitChoice:
    """The mode to train with.

    Args:
        setting: ``model.jit_compile``: "auto", True or False.
        xla_error: ``describe_tf_error`` of the XLA compile's failure; None if it compiled (or
            was not tried).
        remembered: the mode "auto" chose earlier in this run (state directory), kept unless XLA
            now fails; the timings are then not needed.
        xla_times_s, graph_times_s: seconds per warm-up step in each mode on the same batch (auto
            only; both empty when not measured).

    Raises:
        ValueError: ``setting`` True with an ``xla_error`` (the caller reports it as a failure),
            or an unknown setting.
    """
    if setting is False:
        return JitChoice("graph", "jit_compile: false")
    if setting is True:
        if xla_error is not None:
            raise ValueError(f"jit_compile: true and XLA failed: {xla_error}")
        return JitChoice("xla", "jit_compile: true")
    if setting != "auto":
        raise ValueError(f"unknown jit_compile setting {setting!r}")
    if xla_error is not None:
        return JitChoice("graph", f"XLA cannot compile the step: {xla_error}")
    if remembered in ("xla", "graph"):
        return JitChoice(remembered, f"{remembered}, as chosen earlier in this run ({MEMO_NAME})")
    if not xla_times_s or not graph_times_s:
        return JitChoice("xla", "XLA compiled (not timed)")
    xla_ms = 1000.0 * statistics.median(xla_times_s)
    graph_ms = 1000.0 * statistics.median(graph_times_s)
    faster = "xla" if xla_ms <= graph_ms else "graph"
    return JitChoice(faster, f"warm-up step xla {xla_ms:.1f} ms, graph {graph_ms:.1f} ms (median of "
                             f"{len(xla_times_s)} and {len(graph_times_s)})", xla_ms, graph_ms)


def describe_tf_error(err: BaseException) -> str:
    """One line: the failing op (its name carries the layer's scope) and the error as TF reports it.

    A TensorFlow op error (``message``) names its node in ``{{node NAME}}``: ``op NAME: first line``.
    An error raised while running a program reads "Graph execution error:", "Detected at node NAME defined
    at", the Python frames that defined the op, then the reason: ``op NAME (FILE:LINE): reason``, with the
    innermost frame outside installed packages (the user's line, ``_code_location``).
    An error raised while tracing user code arrives wrapped by AutoGraph ("in user code: ... File
    ... TypeError: reason"): its last line is the original ``Type: reason``, then ``(FILE:LINE)``.
    """
    text = getattr(err, "message", None)
    if text is not None:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        match = _NODE.search(text)
        frames = _frames_in(lines)
        where = ""
        if lines and lines[0].startswith("Graph execution error") and frames:
            where = f" ({_code_location([(path, n) for _, path, n in frames])})"
            lines = [line for line in lines[frames[-1][0] + 1:] if not line.startswith("[[")]
        first = lines[0] if lines else type(err).__name__
        line = f"op {match.group(1)}{where}: {first}" if match else first
    else:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        line = last if len(lines) > 1 and ":" in last else f"{type(err).__name__}: {last}".rstrip(": ")
        frames = _frames_in(lines)     # AutoGraph's frames: the user's line
        line += f" ({_code_location([(path, n) for _, path, n in frames])})" if frames else ""
    return line if len(line) <= _MAX_LINE_CHARS else line[:_MAX_LINE_CHARS - 3] + "..."


def _frames_in(lines: Sequence[str]) -> list[tuple[int, str, int]]:
    """(index, file, line number) of each ``File "...", line N`` among ``lines``."""
    found = ((i, _FRAME.match(line)) for i, line in enumerate(lines))
    return [(i, m.group(1), int(m.group(2))) for i, m in found if m is not None]


def describe_exception(err: BaseException) -> str:
    """One line for an exception raised by user code (a step factory): ``Type: first line (FILE:LINE)``.

    The traceback starts at the frame that caught ``err`` (the caller of the user's code), so that frame is left
    out: an error of the call itself (a factory that takes no argument) names no line.
    """
    frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(err.__traceback__)[1:]]
    first = (str(err).strip().splitlines() or [""])[0]
    line = f"{type(err).__name__}: {first}".rstrip(": ") + (f" ({_code_location(frames)})" if frames else "")
    return line if len(line) <= _MAX_LINE_CHARS else line[:_MAX_LINE_CHARS - 3] + "..."


def _code_location(frames: Sequence[tuple[str, int]]) -> str:
    """``FILE:LINE`` of the innermost frame outside installed packages (the user's code), else the innermost."""
    own = [f for f in frames if not any(part in f[0] for part in _PACKAGE_DIRS)]
    path, line = (own or list(frames))[-1]
    return f"{path}:{line}"


def remembered_mode(state_dir: Path) -> str | None:
    """The mode "auto" chose earlier for the run in ``state_dir``; None if none (or unreadable)."""
    try:
        mode = json.loads((state_dir / MEMO_NAME).read_text(encoding="utf-8")).get("mode")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as err:   # a damaged memo only costs a new decision
        log.warning("ignoring %s: %s", state_dir / MEMO_NAME, err)
        return None
    return mode if mode in ("xla", "graph") else None


def remember_mode(state_dir: Path, choice: JitChoice) -> None:
    """Store an "auto" decision for the next start of this run (atomically: temp file, rename).

    The file is 0640 or stricter whatever the umask, like every other file in the state directory.
    """
    path = state_dir / MEMO_NAME
    tmp = path.with_suffix(".tmp")
    try:
        write_private(tmp, (json.dumps({"mode": choice.mode, "reason": choice.reason}) + "\n").encode())
        os.replace(tmp, path)
    except OSError as err:   # not fatal: the next start decides again (the checkpoint write will tell)
        log.warning("cannot write %s: %s; a restart decides jit_compile again", path, err.strerror)


def stably_named(program: Any, label: str) -> Any:
    """``program`` (a traced concrete function) registered again under a name with no process-wide counter.

    TensorFlow names a traced function ``__inference_<name>_<uid>``, the uid counting every trace in the
    process, and the persistent XLA cache's key hashes that name: a cache filled by a process that traced one
    function more or less would never be hit. The name here is ``__inference_<label>_<hash>``, the hash being
    that of the function's definition (its name left out), so two processes tracing the same step for the same
    shapes give it the same name, and two different functions never share one. The returned function runs the
    same graph (with the same captured variables) as ``program``, which it keeps alive.
    """
    from tensorflow.core.framework import function_pb2
    from tensorflow.python.eager.polymorphic_function import atomic_function, concrete_function

    definition = function_pb2.FunctionDef()
    definition.CopyFrom(program.function_def)
    definition.signature.name = ""
    definition.attr.pop("_construction_context", None)    # the runtime's, not the function's
    digest = hashlib.sha256(definition.SerializeToString(deterministic=True)).hexdigest()[:_NAME_HASH_CHARS]
    atomic = atomic_function.from_func_graph(f"__inference_{label}_{digest}", program.graph, program._attrs,
                                             program.function_type)
    renamed = concrete_function.ConcreteFunction(atomic)
    renamed._arg_keywords, renamed._num_positional_args = program._arg_keywords, program._num_positional_args
    renamed._melfeed_traced = program      # the graph's owner: it deletes the graph when collected
    return renamed
