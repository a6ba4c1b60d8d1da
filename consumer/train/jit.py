"""How each model's step is compiled: the ``model.jit_compile`` decision, free of clocks and TensorFlow.

Role: ``choose_mode`` turns the setting, an XLA failure (if any) and warm-up timings into the
mode the run uses; ``remembered_mode``/``remember_mode`` keep an "auto" decision in the state
directory (``STATE_DIR/jit_compile.json``), so a resumed run continues with the arithmetic it
started with instead of re-timing (timings on a busy machine can tip the other way). ``describe_tf_error`` and
``describe_exception`` (the one line of a failure: the op, the user's line, the reason) live in describe.py.
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
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from melfeed.consumer.resume.filemode import write_private

__all__ = ["JitChoice", "choose_mode", "setting_name", "remembered_mode", "remember_mode", "stably_named", "MEMO_NAME"]

log = logging.getLogger(__name__)

MEMO_NAME = "jit_compile.json"  # in consumer.state_dir: the mode "auto" chose for this run

_NAME_HASH_CHARS = 16  # 64 bits of the definition: two different programs of one process never meet


@dataclass(frozen=True, slots=True)
class JitChoice:
    """The compile mode of a run and why (reported in the READY line and the summary)."""

    mode: str  # "xla" or "graph"
    reason: str  # one line: what decided it
    xla_step_ms: float | None = None  # median warm-up step with XLA (auto, when XLA compiled)
    graph_step_ms: float | None = None  # median warm-up step in graph mode (auto, when XLA compiled)


def setting_name(setting: str | bool) -> str:
    """``model.jit_compile`` as written in YAML: auto, true or false."""
    return setting if isinstance(setting, str) else str(setting).lower()


def choose_mode(
    setting: str | bool,
    *,
    xla_error: str | None = None,
    remembered: str | None = None,
    xla_times_s: Sequence[float] = (),
    graph_times_s: Sequence[float] = (),
) -> JitChoice:
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
    return JitChoice(
        faster,
        f"warm-up step xla {xla_ms:.1f} ms, graph {graph_ms:.1f} ms (median of "
        f"{len(xla_times_s)} and {len(graph_times_s)})",
        xla_ms,
        graph_ms,
    )


def remembered_mode(state_dir: Path) -> str | None:
    """The mode "auto" chose earlier for the run in ``state_dir``; None if none (or unreadable)."""
    try:
        mode = json.loads((state_dir / MEMO_NAME).read_text(encoding="utf-8")).get("mode")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as err:  # a damaged memo only costs a new decision
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
    except OSError as err:  # not fatal: the next start decides again (the checkpoint write will tell)
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
    definition.attr.pop("_construction_context", None)  # the runtime's, not the function's
    digest = hashlib.sha256(definition.SerializeToString(deterministic=True)).hexdigest()[:_NAME_HASH_CHARS]
    atomic = atomic_function.from_func_graph(
        f"__inference_{label}_{digest}", program.graph, program._attrs, program.function_type
    )
    renamed = concrete_function.ConcreteFunction(atomic)
    renamed._arg_keywords, renamed._num_positional_args = program._arg_keywords, program._num_positional_args
    renamed._melfeed_traced = program  # the graph's owner: it deletes the graph when collected
    return renamed
