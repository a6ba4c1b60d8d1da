"""Test steps whose validity or cost depends on the batch's values, as duration- and attention-driven TTS models do.

``positive_step`` checks what Tacotron2's attention and FastSpeech2's length regulator need: every row has frames
and tokens, every real token a positive ``duration`` (an extra of kind ``token``); on an all-padding batch it
fails. ``duration_cost_step`` does work in proportion to the batch's total duration (a decoder over the expanded
frames: one matmul per ``_FRAMES_PER_MATMUL`` frames), so a batch of zero durations costs next to nothing. Both
are ``tiny_step`` underneath: momentum and an iteration counter move every step (warm-up must put them back).
``positive_duration_cost_step`` is both at once: one run checks the values and times the cost; it also takes the
row inputs (consumer/train/rows.py) and reports them (``rows``, ``padding_rows``), as ``tests.steps:rows_step`` does.
``write_duration_cache`` (tests/duration_data.py) writes the demo cache plus that ``duration`` extra (1..8 frames
per token).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from melfeed.consumer.train.model import StepSpec
from tests.duration_data import write_duration_cache as write_duration_cache  # its home imports no TensorFlow
from tests.steps import _TinyStep

_COST_SIDE = 192  # [192, 192] matmuls: about 0.5 ms each on the 2-core CI machine
_FRAMES_PER_MATMUL = 32  # a batch of 8 rows of ~100 tokens x ~4.5 frames: ~110 matmuls, tens of ms


def _real_tokens(tok_len: tf.Tensor, tokens: tf.Tensor) -> tf.Tensor:
    return tf.sequence_mask(tok_len, tokens.shape[1])


def _positive_checks(mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, duration: tf.Tensor) -> list[Any]:
    """Assertions that every row has frames and tokens and every real token a positive duration."""
    return [
        tf.debugging.assert_positive(mel_len, message="mel_len"),
        tf.debugging.assert_positive(tok_len, message="tok_len"),
        tf.debugging.assert_positive(
            tf.where(_real_tokens(tok_len, tokens), duration, 1), message="duration of a real token"
        ),
    ]


class _PositiveStep(_TinyStep):
    def __call__(  # type: ignore[override]  # takes the durations too
        self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, duration: tf.Tensor
    ) -> tf.Tensor:
        with tf.control_dependencies(_positive_checks(mel_len, tokens, tok_len, duration)):
            return super().__call__(mel, mel_len, tokens, tok_len)


class _DurationCostStep(_TinyStep):
    def __init__(self, spec: StepSpec) -> None:
        super().__init__(spec)
        self.frames_per_matmul = int(spec.params.get("frames_per_matmul", _FRAMES_PER_MATMUL))  # smaller: costlier

    def __call__(  # type: ignore[override]  # takes the durations too
        self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, duration: tf.Tensor
    ) -> tf.Tensor:
        loss = super().__call__(mel, mel_len, tokens, tok_len)
        frames = tf.reduce_sum(tf.where(_real_tokens(tok_len, tokens), duration, 0))
        x = tf.fill([_COST_SIDE, _COST_SIDE], 1.0 / _COST_SIDE) + tf.reduce_mean(self.w)

        def body(i: tf.Tensor, acc: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return i + 1, tf.tanh(tf.matmul(acc, x))

        _, acc = tf.while_loop(lambda i, acc: i < frames // self.frames_per_matmul, body, (tf.constant(0), x))
        return loss + 0.0 * tf.reduce_mean(acc)  # depends on the decoder, so it must run


class _PositiveDurationCostStep(_DurationCostStep):
    def __call__(  # type: ignore[override]  # takes the durations and the row inputs too
        self,
        mel: tf.Tensor,
        mel_len: tf.Tensor,
        tokens: tf.Tensor,
        tok_len: tf.Tensor,
        duration: tf.Tensor,
        rows: tf.Tensor,
        row_mask: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        with tf.control_dependencies(_positive_checks(mel_len, tokens, tok_len, duration)):
            loss = super().__call__(mel, mel_len, tokens, tok_len, duration)
        padding = tf.cast(tf.shape(mel)[0] - tf.reduce_sum(tf.cast(row_mask, tf.int32)), tf.float32)
        return {"loss": loss, "rows": tf.cast(rows, tf.float32), "padding_rows": padding}


def positive_step(spec: StepSpec) -> _PositiveStep:
    return _PositiveStep(spec)


def duration_cost_step(spec: StepSpec) -> _DurationCostStep:
    return _DurationCostStep(spec)


def positive_duration_cost_step(spec: StepSpec) -> _PositiveDurationCostStep:
    return _PositiveDurationCostStep(spec)
