"""How each model's step is compiled: the ``model.jit_compile`` decision, free of clocks and TensorFlow.

Role: ``choose_mode`` turns the setting, an XLA failure (if any) and warm-up timings into the
mode the run uses; ``remembered_mode``/``remember_mode`` keep an "auto" decision in the state
directory (``STATE_DIR/jit_compile.json``), so a resumed run continues with the arithmetic it
started with instead of re-timing (timings on a busy machine can tip the other way); ``describe_tf_error`` turns a TensorFlow error into the one line an operator
reads (the failing op or layer as TensorFlow names it, then the first line of its message).
``CompiledStep.warm_up`` (consumer/train/step.py) is the shell that compiles, times and calls these.
Invariants: the result is always "xla" or "graph"; ``jit_compile: true`` never yields "graph"
(its failure is an error, not a fallback); "auto" picks XLA only when it compiled and its median
warm-up step was not slower than graph mode's on the same batch.
Shutdown: nothing to release.
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from consumer.resume.filemode import write_private

__all__ = ["JitChoice", "choose_mode", "describe_tf_error", "setting_name", "remembered_mode", "remember_mode",
           "MEMO_NAME"]

log = logging.getLogger(__name__)

MEMO_NAME = "jit_compile.json"   # in consumer.state_dir: the mode "auto" chose for this run

_NODE = re.compile(r"\{\{node ([^}]+)\}\}")
_MAX_LINE_CHARS = 300   # one readable log line, even for a long TensorFlow message


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
    An error raised while tracing user code arrives wrapped by AutoGraph ("in user code: ... File
    ... TypeError: reason"): its last line is the original ``Type: reason``.
    """
    text = getattr(err, "message", None)
    if text is not None:
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
        match = _NODE.search(text)
        line = f"op {match.group(1)}: {first}" if match else first
    else:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        line = last if len(lines) > 1 and ":" in last else f"{type(err).__name__}: {last}".rstrip(": ")
    return line if len(line) <= _MAX_LINE_CHARS else line[:_MAX_LINE_CHARS - 3] + "..."


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
