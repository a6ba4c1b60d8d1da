"""The step's named outputs, accumulated on the model device and read to the host once per interval.

Role: ``Accumulators`` holds, per named scalar of the step (``loss`` first, consumer/train/outputs.py), a
float64 sum, the last and the first value since the last read, plus a step count, a count of steps whose
loss was not finite, the number of times the loss turned non-finite (finite step, then a NaN/inf one)
and the global step of the first such turn. ``update`` runs inside the compiled program (it adds ops to
the traced graph); ``read`` is the only host read: one program that packs every figure into one float64
vector and zeroes the interval's figures, then one ``.numpy()`` of it (one device drain per interval).
Invariants: the sums add the float32 values in step order in float64, so an interval's mean equals the
mean the host would have computed from per-step floats; the last value and the finite flag carry over
reads, so a turn that spans two intervals is counted once. Shutdown: nothing to release.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import tensorflow as tf

__all__ = ["Accumulators", "IntervalRead"]

_HEAD = 4  # steps, non-finite steps, turns, global step of the first turn (-1: none)


@dataclass(frozen=True, slots=True)
class IntervalRead:
    """One host read: what the steps dispatched since the previous read added up to."""

    steps: int  # steps in the interval
    sums: dict[str, float]  # per name, float64 sum of the float32 values
    last: dict[str, float]  # per name, the newest step's value (carried over empty intervals)
    first: dict[str, float]  # per name, the interval's first step's value (last's when steps == 0)
    nonfinite_steps: int  # steps whose loss was NaN/inf
    turns: int  # times the loss turned non-finite after a finite step (or at step 1)
    first_turn_step: int | None  # global step number (1-based) of the first such turn

    def means(self) -> dict[str, float]:
        """Per-name means over the interval ({} for an empty one)."""
        return {name: total / self.steps for name, total in self.sums.items()} if self.steps else {}


class Accumulators:
    """On-device accumulators of the named outputs ``names`` (variables created on ``device``)."""

    def __init__(self, names: Sequence[str], device: str | None = None) -> None:
        if not names or names[0] != "loss":
            raise ValueError(f"the outputs must start with 'loss', got {list(names)}")
        self.names = tuple(names)
        self.reads = 0  # host reads so far (one device drain each)
        with tf.device(device) if device else nullcontext():
            n = len(self.names)
            self._sums = tf.Variable(tf.zeros([n], tf.float64), trainable=False, name="out_sums")
            self._last = tf.Variable(tf.fill([n], math.nan), trainable=False, name="out_last")
            self._first = tf.Variable(tf.fill([n], math.nan), trainable=False, name="out_first")
            # steps, non-finite, turns, first turn's global step; then the global step and the last loss's finiteness
            self._head = tf.Variable(tf.constant([0, 0, 0, -1], tf.int64), trainable=False, name="out_head")
            self._global = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="out_global_step")
            self._was_finite = tf.Variable(True, trainable=False, name="out_was_finite")
        self._read = tf.function(self._read_and_reset, jit_compile=False)

    @property
    def variables(self) -> list[tf.Variable]:
        return [self._sums, self._last, self._first, self._head, self._global, self._was_finite]

    def update(self, outputs: Mapping[str, tf.Tensor]) -> None:
        """Add one step's outputs (call inside the traced program, after the step)."""
        values = tf.stack([tf.cast(outputs[name], tf.float32) for name in self.names])
        is_first = tf.equal(self._head[0], 0)
        self._first.assign(tf.where(is_first, values, self._first))
        self._sums.assign_add(tf.cast(values, tf.float64))
        self._last.assign(values)
        step = self._global.assign_add(1)
        finite = tf.math.is_finite(values[0])
        turned = tf.logical_and(self._was_finite, tf.logical_not(finite))
        first_turn = tf.where(tf.logical_and(turned, self._head[3] < 0), step, self._head[3])
        self._head.assign(
            tf.stack(
                [
                    self._head[0] + 1,
                    self._head[1] + tf.cast(tf.logical_not(finite), tf.int64),
                    self._head[2] + tf.cast(turned, tf.int64),
                    first_turn,
                ]
            )
        )
        self._was_finite.assign(finite)

    def _read_and_reset(self) -> tf.Tensor:
        packed = tf.concat(
            [
                tf.cast(self._head, tf.float64),
                self._sums.read_value(),
                tf.cast(self._last, tf.float64),
                tf.cast(self._first, tf.float64),
            ],
            axis=0,
        )
        with tf.control_dependencies([packed]):
            self._sums.assign(tf.zeros_like(self._sums))
            self._first.assign(tf.fill(tf.shape(self._first), math.nan))
            self._head.assign(tf.constant([0, 0, 0, -1], tf.int64))
        return packed

    def read(self) -> IntervalRead:
        """The interval since the previous read, and start the next one (waits for every step dispatched)."""
        self.reads += 1
        values = self._read().numpy().tolist()  # the one device -> host transfer of the interval
        n = len(self.names)
        steps, nonfinite, turns, first_turn = (int(v) for v in values[:_HEAD])
        sums = dict(zip(self.names, values[_HEAD : _HEAD + n]))
        last = dict(zip(self.names, values[_HEAD + n : _HEAD + 2 * n]))
        first = dict(zip(self.names, values[_HEAD + 2 * n :])) if steps else dict(last)
        return IntervalRead(steps, sums, last, first, nonfinite, turns, first_turn if first_turn >= 0 else None)

    def reset(self) -> None:
        """Forget everything (after warm-up or a measurement ran the programs on synthetic batches)."""
        for var, value in zip(
            self.variables,
            (
                tf.zeros([len(self.names)], tf.float64),
                tf.fill([len(self.names)], math.nan),
                tf.fill([len(self.names)], math.nan),
                tf.constant([0, 0, 0, -1], tf.int64),
                tf.constant(0, tf.int64),
                tf.constant(True),
            ),
        ):
            var.assign(value)
        self.reads = 0
