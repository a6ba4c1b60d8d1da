"""Load the user's step factory (``model.step``) and build its step: every failure is one ``ConfigError`` line.

Role: ``load_step_factory`` imports ``"module:function"`` (the working directory first on ``sys.path``, as
``python -m`` would), ``build_step`` calls it with the ``StepSpec`` and checks that it returned a step
(``consumer/train/inputs.py`` ``check_step``) and that its axis declarations fit the buckets
(``consumer/train/axes.py``). ``consumer/train/step.py`` compiles what it returns; ``build_compiled_step``
is the built-in loop's: the step built under the replicas' strategy, as a ``CompiledStep``.
Invariant: user code's exceptions never escape as tracebacks: each is one line naming ``model.step``, the exception
and the user's line that raised it (``describe.describe_exception``); a ``PipelineError`` it raises goes on as it is.
Shutdown: nothing to release.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from melfeed.consumer.train.axes import check_frame_multiple, token_axis_of
from melfeed.consumer.train.describe import describe_exception, reason_text
from melfeed.consumer.train.inputs import check_step
from melfeed.consumer.train.jit import remembered_mode
from melfeed.consumer.train.model import StepSpec, TrainStep
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError, PipelineError

if TYPE_CHECKING:
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.job.cluster import Job
    from melfeed.consumer.resume.state import RunState
    from melfeed.consumer.train.step import CompiledStep

__all__ = ["build_compiled_step", "build_step", "load_step_factory"]


def load_step_factory(dotted: str) -> Callable[[StepSpec], TrainStep]:
    """Import the step factory named ``"module:function"``.

    Raises:
        ConfigError: malformed name, module not importable, attribute missing or not callable;
            path ``model.step``, one-line reason.
    """

    def fail(reason: str) -> ConfigError:
        return ConfigError(reason, path=("model", "step"), got=dotted)

    module_name, sep, attr = dotted.partition(":")
    if not sep or not module_name or not attr:
        raise fail("must look like 'module:function'")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as python -m: the working directory first (the
        sys.path.insert(0, os.getcwd())  # melfeed script puts its bin/ there instead)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of user code is a config problem here
        reason = reason_text(str(err).splitlines())
        raise fail(f"cannot import module {module_name!r}: {type(err).__name__}: {reason}".rstrip(": ")) from err
    try:
        factory = getattr(module, attr)
    except AttributeError as err:
        raise fail(f"module {module_name!r} has no attribute {attr!r}") from err
    if not callable(factory):
        raise fail(f"{attr!r} is a {type(factory).__name__}, not callable")
    return factory  # type: ignore[no-any-return]


def build_step(dotted: str, spec: StepSpec, *, frame_multiple: int | None = None) -> TrainStep:
    """The step of the factory ``dotted`` (``model.step``) for ``spec``, checked to be a step.

    Args:
        frame_multiple: ``buckets.frame_multiple``; given, the buckets' frame sizes are checked against the step's
            ``frame_multiple`` (``axes.check_frame_multiple``).

    Raises:
        ConfigError: ``model.step``: the factory cannot be loaded, raises (one line: the exception and the
            line of user code that raised it), or returns something that is not a ``TrainStep``, or a bad
            ``token_axis`` / ``frame_multiple``; ``buckets.frame_multiple``: the buckets do not fit the step.
    """
    factory = load_step_factory(dotted)
    try:
        step = factory(spec)
    except PipelineError:
        raise
    except Exception as err:  # user code: any exception is the factory's failure, told in one line
        raise ConfigError(f"the factory raised {describe_exception(err)}", path=("model", "step"), got=dotted) from err
    check_step(step, dotted)
    token_axis_of(step, dotted)
    if frame_multiple is not None:
        check_frame_multiple(step, dotted, [s["mel"][1] for s in spec.bucket_shapes], frame_multiple)
    return step


def build_compiled_step(
    cfg: PipelineConfig, consumer: Consumer, state: RunState | None, job: Job | None = None
) -> tuple[Any, CompiledStep]:
    """The user's step from its factory (``StepSpec`` with buckets, plan length and ``model.params``), built
    under the replicas' strategy when ``consumer.replicas`` > 1 (consumer/train/replicas.py), or under the
    job's ``MultiWorkerMirroredStrategy`` over this worker's devices.

    With a state directory, "auto" keeps the mode it chose when this run started (``jit.remember_mode``), and
    each XLA compile is recorded while it runs (``XlaAttempts``: a compile that killed a start is not tried again).
    """
    from melfeed.consumer.train.replicas import Replicas, check_rows, replica_scope
    from melfeed.consumer.train.step import CompiledStep
    from melfeed.consumer.train.xla_attempts import XlaAttempts, step_key

    shapes = [b.shapes() for b in consumer._bucket_set.buckets]
    check_rows([s["mel"][0] for s in shapes], cfg.consumer.replica_count, cfg)
    replicas = Replicas.for_job(job.strategy, cfg) if job is not None else Replicas.from_config(cfg)
    with replica_scope(replicas):
        step_fn = build_step(
            cfg.model.step,
            StepSpec.from_config(cfg, shapes, consumer.plan.batches_per_epoch, consumer.extras),
            frame_multiple=cfg.buckets.frame_multiple,
        )
    remembered = remembered_mode(state.root) if state is not None else None
    attempts = XlaAttempts(state.root if state is not None else None, step_key(cfg))
    return step_fn, CompiledStep(
        step_fn,
        shapes,
        jit_compile=cfg.model.jit_compile,
        factory=cfg.model.step,
        remembered=remembered,
        replicas=replicas,
        extras=consumer.extras,
        mel_dtype=cfg.transport.mel_dtype,
        attempts=attempts,
    )
