"""One uint8 region per batch into the compiled step: the program cuts it into the arrays and accumulates outputs.

Role: a batch's arrays lie in one 64-byte aligned byte range of its slot (shared/wire/layout.py). The
hand-off (consumer/train/handoff.py) gives the step that range as ONE uint8 tensor; ``PackedSteps``
wraps each bucket's compiled program (``CompiledStep.program_for``) in an outer ``tf.function`` whose
only input is that ``uint8[nbytes]`` tensor (plus an int32 ``rows`` scalar for a step that takes row
inputs, consumer/train/rows.py): inside the program each array is ``tf.slice`` + ``tf.reshape`` +
``tf.bitcast`` of the region at the offsets and shapes the bucket's layout fixes at trace time, the step
runs on them, and its named outputs go into ``Accumulators`` (consumer/train/device/accumulators.py)
instead of back to the host. On a GPU that is one host->device copy of uint8 (device memory; int32
would stay in host memory) instead of four, and no array of the step aliases the slot after it.
Invariants: the outer program of a bucket is traced and compiled in ``warm_up`` (before READY, on the bucket's
real batch, consumer/train/warm_batches.py), which
leaves every variable of the step and the accumulators as it found them; XLA (``CompiledStep.mode``)
compiles the outer program whole (one replica), so the cut is fused into the step. The cut reads each
array exactly where ``batch_layout`` put it, so the step sees the same bytes as the per-array path.
Shutdown: nothing to release; programs go with this object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from melfeed.consumer.train.device.accumulators import Accumulators

__all__ = ["PackedSteps", "RegionLayout"]

log = logging.getLogger(__name__)

_Layout = Sequence[tuple[str, int, tuple[int, ...], np.dtype]]   # shared.wire.layout.batch_layout's rows


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """Where each array of one bucket's batch lies in its region: name -> (byte offset, shape, dtype)."""

    nbytes: int
    arrays: dict[str, tuple[int, tuple[int, ...], np.dtype]]

    @classmethod
    def of(cls, layout: _Layout) -> RegionLayout:
        """From ``batch_layout(bucket)``; ``nbytes`` ends at the last array's last byte (``layout_nbytes``)."""
        arrays = {key: (offset, tuple(shape), np.dtype(dtype)) for key, offset, shape, dtype in layout}
        _, offset, shape, dtype = layout[-1]
        return cls(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize, arrays)

    def cut(self, region: tf.Tensor, name: str) -> tf.Tensor:
        """Array ``name`` of the batch in ``region`` (traced: slice, bitcast, reshape)."""
        offset, shape, dtype = self.arrays[name]
        tf_dtype = tf.as_dtype(dtype)
        piece = tf.slice(region, [offset], [int(np.prod(shape)) * dtype.itemsize])
        if dtype.itemsize > 1:
            piece = tf.bitcast(tf.reshape(piece, [-1, dtype.itemsize]), tf_dtype)
        elif tf_dtype != tf.uint8:
            piece = tf.bitcast(piece, tf_dtype)
        return tf.reshape(piece, shape)


class PackedSteps:
    """The per-bucket programs that take one uint8 region; outputs accumulate on ``device``.

    Args:
        compiled: the ``CompiledStep`` (its ``warm_up`` done: the mode is settled, programs traced).
        layouts: one ``RegionLayout`` per bucket, bucket order (the ring's layout of the slot).
        device: where the accumulators live (the model GPU, or the replicas' first device); None = default.
    """

    def __init__(self, compiled: Any, layouts: Sequence[RegionLayout], device: str | None = None) -> None:
        self._compiled = compiled
        self.layouts = list(layouts)
        program, _, _ = compiled.program_for(0)
        self.accumulators = Accumulators(_output_names(program), device)
        self._programs: dict[int, Any] = {}   # bucket -> concrete function
        self.dispatched = 0

    @classmethod
    def for_buckets(cls, compiled: Any, buckets: Sequence[Any], device: str | None) -> PackedSteps:
        """Over the ring's slot layout of ``buckets`` (``Bucket``s); outputs accumulate on ``device``, or on the
        first replica's device with replicas."""
        from melfeed.shared.wire.layout import batch_layout
        layouts = [RegionLayout.of(batch_layout(b)) for b in buckets]
        return cls(compiled, layouts, compiled.devices[0] if compiled.devices else device)

    @property
    def factory(self) -> str:
        """The step factory's name (``model.step``), for error messages."""
        return str(self._compiled.factory)

    def program(self, bucket: int) -> Any:
        """The concrete function of ``bucket`` (traced on first use): ``(region uint8[nbytes][, rows]) -> ()``."""
        found = self._programs.get(bucket)
        if found is not None:
            return found
        inner, names, takes_rows = self._compiled.program_for(bucket)
        layout, accumulators = self.layouts[bucket], self.accumulators

        def packed(region: tf.Tensor, *rows: tf.Tensor) -> tf.Tensor:
            outputs = inner(*(layout.cut(region, name) for name in names), *rows)
            accumulators.update(outputs)
            return tf.constant(0, tf.int32)        # nothing to read: a tensor so the call has an output

        signature = [tf.TensorSpec([layout.nbytes], tf.uint8, name="region")]
        signature += [tf.TensorSpec([], tf.int32, name="rows")] if takes_rows else []
        xla = self._compiled.mode == "xla" and not self._compiled.devices   # replicas: XLA per replica inside
        program = tf.function(packed, jit_compile=xla, input_signature=signature).get_concrete_function()
        self._programs[bucket] = program
        return program

    def run(self, bucket: int, region: tf.Tensor, rows: int | None = None) -> None:
        """Dispatch one step on ``region`` (returns when the step is enqueued; on the CPU, when it ran)."""
        program = self.program(bucket)
        if len(program.structured_input_signature[0]) > 1:
            batch_rows = self.layouts[bucket].arrays["mel"][1][0]
            program(region, tf.constant(batch_rows if rows is None else rows, tf.int32))
        else:
            program(region)
        self.dispatched += 1

    def warm_up(self, variables: Sequence[Any], batches: Sequence[Any] | None = None) -> float:
        """Compile every bucket's program on its warm-up batch (``WarmBatch``: ``region`` and ``rows``, bucket
        order; None = an all-zero region, every length 0), then restore ``variables`` and reset the accumulators;
        returns the seconds it took."""
        started = time.perf_counter()
        saved = [v.numpy() for v in variables]       # host copies, as CompiledStep.warm_up
        try:
            for bucket, layout in enumerate(self.layouts):
                if batches is None:
                    self.run(bucket, tf.zeros([layout.nbytes], tf.uint8), rows=0)
                else:
                    self.run(bucket, tf.constant(batches[bucket].region[:layout.nbytes]), rows=batches[bucket].rows)
            self.accumulators.read()                 # compiles the read program too
        finally:
            for var, value in zip(variables, saved):
                var.assign(value)
            self.accumulators.reset()
            self.dispatched = 0
        seconds = time.perf_counter() - started
        log.info("packed step programs compiled buckets=%d s=%.2f", len(self.layouts), seconds)
        return seconds


def _output_names(program: Any) -> list[str]:
    """The named outputs of a compiled program, ``loss`` first then sorted (``normalize_outputs``' order)."""
    concrete = program if hasattr(program, "structured_outputs") else program.get_concrete_function()
    names = list(concrete.structured_outputs)
    return ["loss", *sorted(n for n in names if n != "loss")]
