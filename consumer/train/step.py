"""Compile the training step once per bucket shape and hand batches to it without copies.

Role: load the user's step factory (``ModelConfig.step``), build one XLA program per bucket shape
before training (``CompiledStep.warm_up``), run batches through them, and turn aligned numpy slots
into TensorFlow tensors with DLPack (``to_tensors``).

Invariants:
    * After ``warm_up()`` every bucket shape has a compiled program, and every variable of
      ``step.variables()`` (model and optimizer, iteration and loss-scale counters included) holds
      exactly its pre-warm-up value: warm-up never changes training.
    * A trace after ``warm_up()`` (a batch whose shapes match no compiled program) still runs, but
      is counted in ``compiles_after_ready`` and logged as a WARNING each time.
    * ``to_tensors`` never hands DLPack a buffer that is not 64-byte aligned and C-contiguous
      (TensorFlow aborts the process on a misaligned DLPack buffer); such arrays are copied.

On a GPU: the compiled step runs on the model GPU; a DLPack tensor made here lives in host memory
and the call copies it host->device; eager dispatch there is asynchronous, so ``run`` returns as
soon as the step is enqueued and staging the next batch overlaps the running step. On CPU the call
returns when the step has finished.
Shutdown: nothing to release; programs and tensors are freed with this object.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from consumer.train.model import StepSpec, TrainStep
from shared.errors import ConfigError
from shared.wire.layout import ALIGN_BYTES, ARRAY_DTYPES, ARRAY_KEYS

__all__ = ["load_step_factory", "CompiledStep", "to_tensors", "aligned_empty"]

log = logging.getLogger(__name__)

_BATCH_DTYPES: dict[str, tf.DType] = {name: tf.as_dtype(dtype) for name, dtype in ARRAY_DTYPES.items()}
_ARG_ORDER = ARRAY_KEYS  # TrainStep.__call__ positional order is the wire order

_Shapes = tuple[tuple[int, ...], ...]  # shapes in _ARG_ORDER: the key of one compiled program


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
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of user code is a config problem here
        first_line = (str(err).splitlines() or [""])[0]
        raise fail(f"cannot import module {module_name!r}: {type(err).__name__}: {first_line}"
                   ) from err
    try:
        factory = getattr(module, attr)
    except AttributeError as err:
        raise fail(f"module {module_name!r} has no attribute {attr!r}") from err
    if not callable(factory):
        raise fail(f"{attr!r} is a {type(factory).__name__}, not callable")
    return factory  # type: ignore[no-any-return]


def _shapes_of(shapes: Mapping[str, Sequence[int]]) -> _Shapes:
    """Validate one bucket's shapes and return them in argument order."""
    if set(shapes) != set(_ARG_ORDER):
        raise ValueError(f"bucket shapes need keys {sorted(_ARG_ORDER)}, got {sorted(shapes)}")
    out = tuple(tuple(int(d) for d in shapes[k]) for k in _ARG_ORDER)
    mel, mel_len, tokens, tok_len = out
    batch = mel[0] if len(mel) == 3 else -1
    if not (len(mel) == 3 and mel_len == (batch,) and len(tokens) == 2 and tokens[0] == batch
            and tok_len == (batch,) and min(mel + tokens) >= 1):
        raise ValueError(f"inconsistent bucket shapes {dict(zip(_ARG_ORDER, out))}: "
                         "want mel [B,T,M], mel_len [B], tokens [B,L], tok_len [B], all >= 1")
    return out


class CompiledStep:
    """One ``tf.function(jit_compile=True)`` program per bucket shape around a ``TrainStep``."""

    def __init__(self, step: TrainStep,
                 bucket_shapes: Sequence[Mapping[str, tuple[int, ...]]]) -> None:
        """Args:
            step: the training step (its variables must all exist already).
            bucket_shapes: one dict per bucket with the batch keys ("mel", "mel_len", "tokens",
                "tok_len") and their fixed shapes; bucket ``i`` of ``run`` is entry ``i``.
        """
        if not bucket_shapes:
            raise ValueError("need at least one bucket shape")
        self._step = step
        self._bucket_keys = [_shapes_of(s) for s in bucket_shapes]
        self._programs: dict[_Shapes, Callable[..., tf.Tensor]] = {}
        self._traces = 0
        self._compiles_after_ready = 0
        self._is_ready = False

    @property
    def traces(self) -> int:
        """Traces of any program so far (each one is an XLA compile on first execution)."""
        return self._traces

    @property
    def compiles_after_ready(self) -> int:
        """Traces that happened after ``warm_up()``; anything but 0 means a stall in training."""
        return self._compiles_after_ready

    @property
    def is_ready(self) -> bool:
        """Whether ``warm_up()`` has completed."""
        return self._is_ready

    def _program(self, key: _Shapes) -> Callable[..., tf.Tensor]:
        program = self._programs.get(key)
        if program is None:
            signature = [tf.TensorSpec(shape, _BATCH_DTYPES[name], name=name)
                         for name, shape in zip(_ARG_ORDER, key)]

            def traced(mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor,
                       tok_len: tf.Tensor) -> tf.Tensor:
                self._on_trace(key)  # Python side effect: runs once per trace, never per step
                return self._step(mel, mel_len, tokens, tok_len)

            program = tf.function(traced, jit_compile=True, input_signature=signature)
            self._programs[key] = program
        return program

    @tf.autograph.experimental.do_not_convert  # plain Python bookkeeping, runs at trace time
    def _on_trace(self, key: _Shapes) -> None:
        self._traces += 1
        if self._is_ready:
            self._compiles_after_ready += 1
            log.warning("compiling a new step program after warm-up shapes=%s "
                        "compiles_after_ready=%d", dict(zip(_ARG_ORDER, key)),
                        self._compiles_after_ready)
        else:
            log.debug("tracing step program shapes=%s", dict(zip(_ARG_ORDER, key)))

    def warm_up(self) -> float:
        """Compile every bucket's program, then restore every variable to its prior value.

        Each program is executed once on an all-padding batch (zeros, all lengths 0) to force the
        XLA compile; that step may still move optimizer state (iteration counters, Adam moments
        decay), so all of ``step.variables()`` is snapshotted before and assigned back after.

        Returns:
            Seconds spent compiling and running the warm-up steps.
        """
        variables = self._step.variables()
        # Host copies: a device-side snapshot could alias state that the warm-up steps update.
        saved = [v.numpy() for v in variables]
        started = time.perf_counter()
        for key in dict.fromkeys(self._bucket_keys):  # unique, in bucket order
            zeros = [tf.zeros(shape, _BATCH_DTYPES[name]) for name, shape in zip(_ARG_ORDER, key)]
            float(self._program(key)(*zeros))  # host sync: the compile must finish here
        compile_s = time.perf_counter() - started
        for var, value in zip(variables, saved):
            var.assign(value)
        self._is_ready = True
        log.info("step compiled buckets=%d traces=%d compile_s=%.2f",
                 len(set(self._bucket_keys)), self._traces, compile_s)
        return compile_s

    def run(self, bucket: int, batch: Mapping[str, tf.Tensor]) -> tf.Tensor:
        """Run one training step on ``batch`` with the program compiled for ``bucket``.

        A batch whose shapes differ from the bucket's still runs (a new program is traced,
        counted and logged). The caller must leave DLPack-backed input buffers untouched until
        the returned loss has been read (that read is the step's completion point).

        Returns:
            The scalar float32 loss tensor; reading it (``float()``, ``.numpy()``) is the only
            host sync.

        Raises:
            IndexError: unknown bucket. TypeError: a batch tensor has the wrong dtype.
        """
        expected = self._bucket_keys[bucket]
        args = [batch[name] for name in _ARG_ORDER]
        for name, arg in zip(_ARG_ORDER, args):
            if arg.dtype != _BATCH_DTYPES[name]:
                raise TypeError(f"batch[{name!r}] has dtype {arg.dtype.name}, "
                                f"want {_BATCH_DTYPES[name].name}")
        key = tuple(tuple(arg.shape) for arg in args)
        if key != expected:
            log.debug("bucket %d got shapes %s, want %s", bucket, key, expected)
        return self._program(key)(*args)


def aligned_empty(shape: int | Sequence[int], dtype: npt.DTypeLike,
                  alignment: int = ALIGN_BYTES) -> npt.NDArray[np.generic]:
    """Uninitialised C-contiguous array whose data starts on an ``alignment``-byte boundary.

    Over-allocates a uint8 buffer by ``alignment`` bytes and views it from the first aligned
    offset; the returned array keeps the buffer alive through ``.base``.
    """
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    dt = np.dtype(dtype)
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes].view(dt).reshape(shape_t)


def _can_alias(arr: np.ndarray) -> bool:
    """Whether DLPack may wrap ``arr`` without a copy (and without aborting TensorFlow)."""
    return (arr.flags.c_contiguous and arr.flags.writeable and arr.size > 0
            and arr.dtype.isnative and arr.ctypes.data % ALIGN_BYTES == 0)


def to_tensors(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, tf.Tensor], int]:
    """Hand numpy arrays to TensorFlow, zero-copy where it is safe.

    An array that is C-contiguous, writeable, non-empty and 64-byte aligned is wrapped with
    ``tf.experimental.dlpack.from_dlpack(arr.__dlpack__())`` (2-4 us, no copy): the tensor
    aliases the array's memory, so **the caller must keep the buffer untouched (not refilled,
    not reused as a ring slot) until the step that reads it has finished** - on CPU, until the
    loss returned by ``CompiledStep.run`` has been read. Alignment is checked before DLPack is
    touched, because a misaligned DLPack buffer aborts the process. Every other array is copied
    with ``tf.constant``.

    On a GPU the result is still a host tensor: the compiled step's call copies it host->device
    (one copy per batch, asynchronous with respect to Python).

    Returns:
        The tensors by the same keys, and the number of arrays that were copied.
    """
    tensors: dict[str, tf.Tensor] = {}
    copies = 0
    for name, arr in arrays.items():
        if _can_alias(arr):
            try:
                tensors[name] = tf.experimental.dlpack.from_dlpack(arr.__dlpack__())
                continue
            except (BufferError, TypeError, ValueError, tf.errors.InvalidArgumentError) as err:
                log.debug("dlpack refused %s (%s); copying", name, err)
        tensors[name] = tf.constant(arr)
        copies += 1
    return tensors, copies
