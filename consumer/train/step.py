"""Compile the training step once per bucket shape and hand batches to it without copies.

Role: build one program per bucket shape around the user's step (``build_step``, consumer/train/factory.py)
before training (``CompiledStep.warm_up``, on each bucket's real warm-up batch, consumer/train/warm_batches.py;
XLA or graph mode as ``ModelConfig.jit_compile`` and jit.py decide), and run batches through them (the hand-off,
handoff.py, turns aligned numpy slots into tensors with DLPack).

Invariants:
    * Shapes are fixed in either mode: each program has an input signature of one bucket's shapes (a step with
      ``token_axis = "longest"`` sees the token axis cut inside it in graph mode, consumer/train/axes.py).
    * The step gets the base arrays positionally (mel, mel_len, tokens, tok_len) and each extra of
      the batch schema (``shared/wire/schema.py``) as a keyword argument, but only the extras its
      ``__call__`` names (or all of them with ``**extras``; ``consumer/train/inputs.py``): a step
      written for the four base arrays runs unchanged on a cache with extras. A ``__call__`` that cannot
      take what it will be given (a wrong signature, an array the batch lacks) is refused before any compile.
    * After ``warm_up()`` every bucket shape has a compiled program, and every variable of ``step.variables()``
      (model and optimizer, iteration and loss-scale counters included) holds exactly its pre-warm-up value:
      warm-up never changes training. A variable the programs use that ``variables()`` leaves out is named.
    * A trace after ``warm_up()`` (a batch whose shapes match no compiled program) still runs, but
      is counted in ``compiles_after_ready`` and logged as a WARNING each time; so is an XLA compile
      (``consumer/xla_cache.py``, ``CompileFiles``). Program names carry no counter (``jit.stably_named``).
    * ``to_tensors`` (handoff.py) copies a buffer that is not 64-byte aligned and C-contiguous (DLPack aborts).

Each program is the concrete function of a ``tf.function`` with the bucket's input signature (calling it skips
the per-call signature matching, docs/performance.md "Step dispatch"). The built-in loop calls each inside a packed
one (``program_for``; consumer/train/device/packed.py), which warm-up then compiles and times in its place
(``run_bucket``); ``run`` takes the arrays as tensors (the library path, probes, tests).
Shutdown: nothing to release; programs and tensors are freed with this object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from melfeed.consumer.train.axes import cut_to_longest, program_inputs, token_axis_of
from melfeed.consumer.train.describe import describe_tf_error
from melfeed.consumer.train.factory import build_step, load_step_factory  # re-exported: callers import them here
from melfeed.consumer.train.inputs import Shapes as _Shapes  # one program's key
from melfeed.consumer.train.inputs import accepted_extras, bucket_key, check_call, input_dtypes, unlisted_variables
from melfeed.consumer.train.jit import JitChoice, choose_mode, stably_named
from melfeed.consumer.train.model import TrainStep
from melfeed.consumer.train.outputs import StepOutputError, normalize_outputs, python_at_trace
from melfeed.consumer.train.preflight import BucketOutOfMemory, is_out_of_memory
from melfeed.consumer.train.replicas import Replicas
from melfeed.consumer.train.rows import ROW_INPUTS, row_inputs, row_inputs_taken
from melfeed.consumer.train.warm_inputs import WarmInputs
from melfeed.consumer.train.xla_attempts import XlaAttempts
from melfeed.consumer.xla_cache import CompileFiles, active_xla_cache_dir
from melfeed.shared.errors import ConfigError, StepError
from melfeed.shared.wire.layout import ARRAY_KEYS
from melfeed.shared.wire.schema import ExtraSpec

if TYPE_CHECKING:
    from melfeed.consumer.train.warm_batches import WarmBatch
__all__ = ["build_step", "load_step_factory", "CompiledStep"]

log = logging.getLogger(__name__)
_ARG_ORDER = ARRAY_KEYS  # TrainStep.__call__ positional order is the wire order
_TIMING_CALLS = 3  # per mode with jit_compile auto; the median of 3 ignores one outlier (a GC pause)


class CompiledStep:
    """One concrete ``tf.function`` program per bucket shape around a ``TrainStep``: XLA or graph mode.

    Args:
        step: the training step (its variables must all exist already).
        bucket_shapes: one dict per bucket with the batch keys ("mel", "mel_len", "tokens", "tok_len") and
            their fixed shapes; bucket ``i`` of ``run`` is entry ``i``.
        jit_compile: ``model.jit_compile``: True = XLA or fail, False = graph mode, "auto" = XLA
            where it compiles and its warm-up steps are not slower (``consumer/train/jit.py``).
        factory: the step factory's name (``model.step``), for error messages.
        remembered: with "auto", the mode chosen earlier in this run (``jit.remembered_mode``): kept without
            timing, unless XLA now fails.
        replicas: run each program on these replicas (``step`` built under ``replicas.scope()``),
            each on its share of the batch's rows (consumer/train/replicas.py); None = one device.
        extras: the batch schema's extra arrays (``Consumer.extras``); those the step's ``__call__``
            names are passed by keyword (shapes from ``bucket_shapes``), the others are not passed.
        mel_dtype: ``transport.mel_dtype``, the dtype of the ``mel`` the programs take (the slot's):
            a float16 mel is cast by the step inside its program (``StepSpec.mel_dtype``).
        attempts: where each XLA compile is recorded while it runs (consumer/train/xla_attempts.py); an earlier
            start that died compiling this step keeps it in graph mode ("auto") or stops it (True).
    """

    def __init__(
        self,
        step: TrainStep,
        bucket_shapes: Sequence[Mapping[str, tuple[int, ...]]],
        *,
        jit_compile: str | bool = True,
        factory: str = "step",
        remembered: str | None = None,
        replicas: Replicas | None = None,
        extras: Sequence[ExtraSpec] = (),
        mel_dtype: str = "float32",
        attempts: XlaAttempts | None = None,
    ) -> None:
        if not bucket_shapes:
            raise ValueError("need at least one bucket shape")
        choose_mode(jit_compile)  # ValueError now for an unknown setting, not after compiling
        self._step = step
        self._setting = jit_compile
        self._factory = factory
        self._remembered = remembered if jit_compile == "auto" else None
        self._attempts = attempts if attempts is not None else XlaAttempts(None, factory)  # None: nothing recorded
        self._passed = accepted_extras(step, extras)  # extra keys the step takes (consumer/train/inputs.py)
        self._dtypes = input_dtypes(extras, mel_dtype)  # mel float16 on a float16 wire: the step casts
        if extras:
            log.info(
                "step %s takes extras %s; not passed: %s",
                factory,
                list(self._passed) or "none",
                [e.name for e in extras if e.name not in self._passed] or "none",
            )
        self._extras, self._token_axis = tuple(extras), token_axis_of(step, factory)  # consumer/train/axes.py
        self._inputs = program_inputs(self._passed, extras, self._token_axis)  # the program's extra inputs
        self._bucket_keys = [bucket_key(s, self._inputs) for s in bucket_shapes]
        self._row_inputs = row_inputs_taken(step)  # "rows" / "row_mask" keywords (consumer/train/rows.py)
        check_call(
            step,
            factory,
            self._passed,
            self._row_inputs,
            [*(k for e in extras for k in (e.name, e.length_key) if k is not None), *ROW_INPUTS],
        )
        self._mode = "graph" if jit_compile is False else "xla"
        self._choice: JitChoice | None = None
        self._output_error: StepOutputError | None = None  # set while tracing; see _normalize
        self._programs: dict[tuple[str, _Shapes], Callable[..., dict[str, tf.Tensor]]] = {}
        self._traces, self._compiles_after_ready, self._is_ready = 0, 0, False
        self._warm: WarmInputs | None = None  # during warm_up: each program's warm-up batch (warm_inputs.py)
        self._compile_files = CompileFiles(active_xla_cache_dir())  # XLA's compiles: new files in its cache
        self.replicas = replicas  # the programs run on these (consumer/train/replicas.py); None = one device
        if replicas is not None and (self._row_inputs or self._passed):  # the replicas split the 4 base arrays
            takes, instead = (
                ("rows / row_mask", "use mel_len > 0 as the row mask")
                if self._row_inputs
                else (f"extra arrays ({', '.join(self._passed)})", "leave them out of __call__")
            )
            raise ConfigError(
                f"a step that takes {takes} cannot run on several replicas yet ({instead}), or set "
                "consumer.replicas: 1",
                path=("consumer", "replicas"),
            )

    @property
    def factory(self) -> str:
        """The step factory's name (``model.step``), for error messages."""
        return self._factory

    @property
    def devices(self) -> list[str]:
        """The replicas' devices; [] for one device (then the outputs' device says where it ran)."""
        return list(self.replicas.devices) if self.replicas is not None else []

    @property
    def traces(self) -> int:
        """Traces of any program so far (with XLA, each one is a compile on first execution)."""
        return self._traces

    @property
    def compiles_after_ready(self) -> int:
        """Traces or XLA compiles after ``warm_up()`` (each trace compiles once); anything but 0 means a stall."""
        xla = self._compile_files.since_mark() if self._mode == "xla" else 0
        return max(self._compiles_after_ready, xla)

    @property
    def is_ready(self) -> bool:
        """Whether ``warm_up()`` has completed."""
        return self._is_ready

    @property
    def mode(self) -> str:
        """ "xla" or "graph": how the programs are compiled (settled by ``warm_up()``)."""
        return self._mode

    @property
    def choice(self) -> JitChoice | None:
        """What ``warm_up()`` decided and why (None before it ran)."""
        return self._choice

    @property
    def takes_rows(self) -> bool:
        """Whether the step takes row inputs (``rows`` / ``row_mask``): an int32 ``rows`` follows the arrays."""
        return bool(self._row_inputs)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The batch keys every program takes, in order (``program_for``'s, without tracing one)."""
        return (*_ARG_ORDER, *self._inputs)

    def program_for(self, bucket: int) -> tuple[Callable[..., dict[str, tf.Tensor]], tuple[str, ...], bool]:
        """``bucket``'s program (traced), ``input_names`` and ``takes_rows``."""
        return self._program(self._bucket_keys[bucket]), self.input_names, self.takes_rows

    def _program(self, key: _Shapes) -> Callable[..., dict[str, tf.Tensor]]:
        program = self._programs.get((self._mode, key))
        if program is None:
            if self.replicas is not None:
                program = self.replicas.program(
                    lambda *args: self._normalize(self._step(*self._step_args(_ARG_ORDER, args)[0])),
                    key,
                    [self._dtypes[n] for n in _ARG_ORDER],
                    _ARG_ORDER,
                    jit_compile=self._mode == "xla",
                    on_trace=lambda: self._on_trace(key),
                )
                self._programs[(self._mode, key)] = program
                return program
            names = (*_ARG_ORDER, *self._inputs)
            signature = [tf.TensorSpec(shape, self._dtypes[name], name=name) for name, shape in zip(names, key)]
            signature += [tf.TensorSpec([], tf.int32, name="rows")] if self._row_inputs else []
            n_arrays = len(names)

            def traced(*args: tf.Tensor) -> dict[str, tf.Tensor]:
                self._on_trace(key)  # Python side effect: runs once per trace, never per step
                base, extras = self._step_args(names, args[:n_arrays])
                if self._row_inputs:
                    extras.update(row_inputs(self._row_inputs, args[n_arrays], key[0][0]))
                return self._normalize(self._step(*base, **extras))

            # The concrete function of the fixed signature (traced here, once): calling it skips
            # tf.function's per-call signature matching (docs/performance.md, "Step dispatch").
            label = f"step_{self._mode}_{'x'.join(map(str, key[0]))}"  # the bucket's mel shape
            program = stably_named(
                tf.function(traced, jit_compile=self._mode == "xla", input_signature=signature).get_concrete_function(),
                label,
            )
            self._programs[(self._mode, key)] = program
        return program

    @python_at_trace  # runs at trace time; its ops are traced as written
    def _step_args(
        self, names: Sequence[str], args: Sequence[tf.Tensor]
    ) -> tuple[list[tf.Tensor], dict[str, tf.Tensor]]:
        """The step's base arrays and extras from a program's inputs: with ``token_axis`` "longest" in graph mode,
        the token axis cut to the batch's longest row (consumer/train/axes.py)."""
        arrays = dict(zip(names, args))
        if self._token_axis == "longest" and self._mode == "graph":
            arrays = cut_to_longest(arrays, self._extras)
        return [arrays[k] for k in _ARG_ORDER], {k: arrays[k] for k in self._passed}

    @python_at_trace  # plain Python bookkeeping, runs at trace time
    def _on_trace(self, key: _Shapes) -> None:
        self._traces += 1
        shapes = dict(zip((*_ARG_ORDER, *self._inputs), key))
        if self._is_ready:
            self._compiles_after_ready += 1
            log.warning(
                "compiling a new step program after warm-up shapes=%s mode=%s compiles_after_ready=%d",
                shapes,
                self._mode,
                self._compiles_after_ready,
            )
        else:
            log.debug("tracing step program shapes=%s mode=%s", shapes, self._mode)

    @python_at_trace
    def _normalize(self, result: object) -> dict[str, tf.Tensor]:
        """``normalize_outputs``, remembering a contract error: AutoGraph re-raises it as its own type."""
        try:
            return normalize_outputs(result)
        except StepOutputError as err:
            self._output_error = err
            raise

    def warm_up(
        self, batches: Sequence[WarmBatch] | None = None, run_bucket: Callable[[int], None] | None = None
    ) -> float:
        """Settle the compile mode, compile every bucket's program, then restore every variable.

        Each program is executed on its bucket's warm-up batch to force the compile (and, with "auto", a few
        more times per mode to time them); those steps may move optimizer state (iteration counters, Adam
        moments decay), so all of ``step.variables()`` is snapshotted and assigned back after.

        Args:
            batches: one real batch per bucket, bucket order (``warm_batches``; the built-in loop passes them);
                None = all-padding batches (zeros, every length 0), for callers without a cache.
            run_bucket: runs bucket ``i``'s outer program (built over ``program_for(i)`` in the current ``mode``)
                once on its warm-up batch with a host read: ``PackedSteps.warm_up`` passes it, so the programs
                compiled and timed are the ones the loop runs, each compiled once (consumer/train/warm_inputs.py).

        Returns:
            Seconds spent compiling (and timing) the warm-up steps.

        Raises:
            StepError: XLA cannot compile the step with ``jit_compile: true``, or the step fails
                in graph mode (one line naming ``factory`` and the error).
            ConfigError: the step's return value breaks the contract (``model.step``).
        """
        variables = self._step.variables()
        saved = [v.numpy() for v in variables]  # host copies: a device snapshot could alias what warm-up updates
        self._warm = WarmInputs(
            self._bucket_keys, (*_ARG_ORDER, *self._inputs), self._dtypes, bool(self._row_inputs), batches, run_bucket
        )
        started = time.perf_counter()
        try:
            choice = self._settle_mode()
            self._warn_unlisted(variables)
        except StepError as err:
            if self._dtypes["mel"] != tf.float16:
                raise
            raise StepError(
                self._factory,
                f"{err.reason} (mel is float16 here, transport.mel_dtype: float16: "
                "cast it in the step, tf.cast(mel, tf.float32); docs/guide/your-model.md)",
            ) from err
        except Exception as err:
            if self._output_error is not None:  # whatever TensorFlow wrapped it in
                raise ConfigError(str(self._output_error), path=("model", "step"), got=self._factory) from err
            raise
        finally:
            for var, value in zip(variables, saved):
                var.assign(value)
            self._warm = None
        compile_s = time.perf_counter() - started
        self._choice, self._is_ready = choice, True
        self._compile_files.mark()
        log.info(
            "step compiled buckets=%d traces=%d compile_s=%.2f jit_compile=%s (%s)",
            len(set(self._bucket_keys)),
            self._traces,
            compile_s,
            self._mode,
            choice.reason,
        )
        return compile_s

    def _warn_unlisted(self, before: Sequence[object]) -> None:
        """One WARNING for variables the programs use that warm-up could not put back (``unlisted_variables``)."""
        used = [v for p in self._programs.values() for v in getattr(p, "variables", ())]  # concrete functions
        wrong = unlisted_variables(used, before, self._step.variables())
        if wrong:
            log.warning("model.step %s: warm-up changed variables it could not put back: %s", self._factory, wrong)

    def _settle_mode(self) -> JitChoice:
        if self._setting is False or self._remembered == "graph":
            self._compile_all("graph")
            return choose_mode(self._setting, remembered=self._remembered)
        crashed = self._attempts.crash_choice(self._setting, self._factory)  # an earlier start died compiling
        if crashed is not None:
            self._choice = crashed
            self._compile_all("graph")
            return crashed
        try:
            self._compile_all("xla")
        except Exception as err:  # user code under XLA: TensorFlow raises many types; all are reported
            if self._output_error is not None or isinstance(err, BucketOutOfMemory):
                raise  # the contract is broken, or memory: graph mode would fail the same way
            reason = describe_tf_error(err)
            if self._setting is True:
                raise StepError(self._factory, f"XLA cannot compile the step (jit_compile: true): {reason}") from err
            log.warning("XLA cannot compile the step of %s, using graph mode: %s", self._factory, reason)
            self._choice = choose_mode("auto", xla_error=reason)  # kept (jit_reason) if graph mode fails too
            self._compile_all("graph")
            return self._choice
        if self._setting is True or self._remembered == "xla":
            return choose_mode(self._setting, remembered=self._remembered)
        if self.replicas is not None and self.replicas.multi_worker:  # timings differ per rank: no timing
            return JitChoice("xla", "XLA compiled (not timed: every rank of a multi-worker job must pick the same)")
        key = max(dict.fromkeys(self._bucket_keys), key=lambda k: int(np.prod(k[0])))  # largest mel
        xla_times = self._time_calls(key)
        try:
            self._compile_all("graph", only=key)
        except StepError as err:  # XLA ran this batch: a check of the step's own (XLA drops tf.debugging asserts)
            log.warning(
                "jit_compile auto: %s; using XLA, which compiled and ran it (XLA does not run tf.debugging assertions)",
                err.reason,
            )
            self._mode, self._programs = "xla", {k: v for k, v in self._programs.items() if k[0] == "xla"}
            return JitChoice("xla", "graph mode fails on the warm-up batch, XLA compiled and ran it")
        choice = choose_mode("auto", xla_times_s=xla_times, graph_times_s=self._time_calls(key))
        log.info("jit_compile auto: %s; using %s", choice.reason, choice.mode)
        if choice.mode == "graph":
            self._compile_all("graph")
        else:
            self._mode = "xla"
        self._programs = {k: v for k, v in self._programs.items() if k[0] == choice.mode}
        return choice

    def _compile_all(self, mode: str, only: _Shapes | None = None) -> None:
        """Switch to ``mode`` and run each bucket's program once on its warm-up batch (host sync: compiled)."""
        self._mode = mode
        for key in [only] if only is not None else dict.fromkeys(self._bucket_keys):
            try:
                with (
                    self._attempts.compiling(f"bucket {dict(zip((*_ARG_ORDER, *self._passed), key))}")
                    if mode == "xla"
                    else nullcontext()
                ):
                    for run in self._warm_runs(key, every_bucket=only is None):
                        run()
            except Exception as err:  # see _settle_mode; graph mode has no fallback
                if is_out_of_memory(err):  # the pre-flight's one line (consumer/train/preflight.py)
                    raise BucketOutOfMemory(self._bucket_keys.index(key)) from err
                if mode == "xla" or self._output_error is not None:
                    raise
                on = (
                    f" on the warm-up batch ({self._warm_or_padding().inputs(key)[1]})"
                    if isinstance(err, tf.errors.OpError)
                    else ""
                )  # it ran: the data is what it failed on
                raise StepError(self._factory, f"the step fails in graph mode{on}: {describe_tf_error(err)}") from err

    def _time_calls(self, key: _Shapes) -> list[float]:
        """Seconds of ``_TIMING_CALLS`` compiled calls on the warm-up batch, each with a host sync."""
        run = self._warm_runs(key, every_bucket=False)[0]
        times = []
        for _ in range(_TIMING_CALLS):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return times

    def _warm_runs(self, key: _Shapes, every_bucket: bool) -> list[Callable[[], None]]:
        program = self._program(key)  # traced first: a contract error is raised before anything runs
        return self._warm_or_padding().runs(key, program, every_bucket)

    def _warm_or_padding(self) -> WarmInputs:
        """``warm_up``'s inputs; outside it (a direct ``_compile_all``), all padding."""
        if self._warm is None:
            self._warm = WarmInputs(
                self._bucket_keys, (*_ARG_ORDER, *self._inputs), self._dtypes, bool(self._row_inputs)
            )
        return self._warm

    def run(self, bucket: int, batch: Mapping[str, tf.Tensor], rows: int | None = None) -> dict[str, tf.Tensor]:
        """One training step on ``batch`` with ``bucket``'s program; its named float32 scalars, ``"loss"`` first.

        ``rows``: the batch's real rows (``Batch.rows``; None = all B), for a step taking ``rows`` / ``row_mask``.
        Other shapes than the bucket's still run (a new program: traced, counted, logged). DLPack-backed inputs
        must stay untouched until an output was read (the only host sync, and the step's completion point).
        Raises IndexError (unknown bucket), TypeError (a tensor of the wrong dtype).
        """
        expected = self._bucket_keys[bucket]
        names = (*_ARG_ORDER, *self._inputs)
        args = [batch[name] for name in names]
        for name, arg in zip(names, args):
            if arg.dtype != self._dtypes[name]:
                raise TypeError(f"batch[{name!r}] has dtype {arg.dtype.name}, want {self._dtypes[name].name}")
        key = tuple(tuple(arg.shape) for arg in args)
        if key != expected:
            log.debug("bucket %d got shapes %s, want %s", bucket, key, expected)
        if self._row_inputs:
            args.append(tf.constant(key[0][0] if rows is None else rows, tf.int32))
        return self._program(key)(*args)
