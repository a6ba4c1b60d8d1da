"""The named outputs accumulated on the device: interval sums, first and last values, NaN/inf turns, one read."""

from __future__ import annotations

import math

import pytest
import tensorflow as tf

from melfeed.consumer.train.device.accumulators import Accumulators

pytestmark = pytest.mark.tf


def _program(acc: Accumulators) -> tf.types.experimental.ConcreteFunction:
    def step(loss: tf.Tensor, l1: tf.Tensor) -> tf.Tensor:
        acc.update({"loss": loss, "mel_l1": l1})
        return tf.constant(0)

    return tf.function(step, input_signature=[tf.TensorSpec([], tf.float32)] * 2).get_concrete_function()


def test_reads_hold_the_interval_and_start_the_next_and_the_last_value_carries_over() -> None:
    acc = Accumulators(["loss", "mel_l1"])
    run = _program(acc)
    for loss in (3.0, 5.0, 4.0):
        run(tf.constant(loss), tf.constant(loss / 2))
    first = acc.read()
    assert (first.steps, first.sums, first.first, first.last) == (
        3,
        {"loss": 12.0, "mel_l1": 6.0},
        {"loss": 3.0, "mel_l1": 1.5},
        {"loss": 4.0, "mel_l1": 2.0},
    )
    assert first.means() == {"loss": 4.0, "mel_l1": 2.0} and first.turns == 0 and first.first_turn_step is None
    empty = acc.read()
    assert empty.steps == 0 and empty.means() == {} and empty.last == {"loss": 4.0, "mel_l1": 2.0}
    run(tf.constant(7.0), tf.constant(1.0))
    assert acc.read().first == {"loss": 7.0, "mel_l1": 1.0} and acc.reads == 3


def test_a_loss_that_turns_non_finite_is_counted_once_per_turn_across_reads() -> None:
    acc = Accumulators(["loss", "mel_l1"])
    run = _program(acc)
    for loss in (1.0, math.nan, math.nan):
        run(tf.constant(loss), tf.constant(0.0))
    read = acc.read()
    assert (read.turns, read.nonfinite_steps, read.first_turn_step) == (1, 2, 2)
    for loss in (math.inf, 2.0, math.nan):  # still non-finite (same turn), recovers, turns again
        run(tf.constant(loss), tf.constant(0.0))
    read = acc.read()
    assert (read.turns, read.nonfinite_steps, read.first_turn_step) == (1, 2, 6)
    fresh = Accumulators(["loss"])

    def nan_first(loss: tf.Tensor) -> tf.Tensor:
        fresh.update({"loss": loss})
        return tf.constant(0)

    tf.function(nan_first)(tf.constant(math.nan))
    assert fresh.read().turns == 1  # a first step that is already NaN


def test_the_outputs_must_start_with_loss() -> None:
    with pytest.raises(ValueError, match="must start with 'loss'"):
        Accumulators(["mel_l1", "loss"])
