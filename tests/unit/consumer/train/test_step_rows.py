"""Row inputs (consumer/train/rows.py): a padded partial batch through ``CompiledStep`` gives the loss of its
real rows alone, with the reference step and with a step that averages over rows using ``rows``/``row_mask``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.train.model import StepSpec, build_reference_step
from melfeed.consumer.train.rows import row_inputs_taken
from melfeed.consumer.train.step import CompiledStep

pytestmark = pytest.mark.tf

N_MELS = 8
_REAL, _PADDED = 3, 8  # rows of the partial batch, rows of its bucket
_KEYS = ("mel", "mel_len", "tokens", "tok_len")


def _shapes(rows: int) -> dict[str, tuple[int, ...]]:
    return {"mel": (rows, 16, N_MELS), "mel_len": (rows,), "tokens": (rows, 6), "tok_len": (rows,)}


def _real_and_padded() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``_REAL`` real rows, and the same rows followed by padding rows as a producer fills them."""
    rng = np.random.default_rng(3)
    real = {
        "mel": rng.normal(size=(_REAL, 16, N_MELS)).astype(np.float32),
        "mel_len": np.array([16, 9, 12], np.int32),
        "tokens": rng.integers(1, 32, (_REAL, 6)).astype(np.int32),
        "tok_len": np.array([6, 3, 5], np.int32),
    }
    pad = _PADDED - _REAL
    padded = {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]) for k, v in real.items()}
    return real, padded


class _RowMeanStep:
    """A loss averaged over rows (what jumps on padding rows unless the step knows which rows are real)."""

    def __init__(self) -> None:
        self.w = tf.Variable(tf.zeros([N_MELS]))

    def __call__(
        self,
        mel: tf.Tensor,
        mel_len: tf.Tensor,
        tokens: tf.Tensor,
        tok_len: tf.Tensor,
        rows: tf.Tensor,
        row_mask: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        per_row = tf.reduce_mean(tf.abs(mel - self.w), axis=[1, 2])  # [B]
        loss = tf.reduce_sum(tf.where(row_mask, per_row, 0.0)) / tf.cast(tf.maximum(rows, 1), tf.float32)
        self.w.assign_add(0.01 * tf.ones([N_MELS]))
        return {
            "loss": loss,
            "rows": tf.cast(rows, tf.float32),
            "mask_rows": tf.reduce_sum(tf.cast(row_mask, tf.float32)),
        }

    def variables(self) -> list[tf.Variable]:
        return [self.w]


def _run(step: Any, batch: dict[str, np.ndarray], rows: int | None) -> dict[str, float]:
    compiled = CompiledStep(step, [_shapes(batch["mel"].shape[0])], jit_compile=False)
    compiled.warm_up()
    out = compiled.run(0, {k: tf.constant(v) for k, v in batch.items()}, rows=rows)
    return {name: float(v) for name, v in out.items()}


def test_reference_loss_of_a_padded_partial_batch_equals_the_loss_of_its_real_rows_alone() -> None:
    real, padded = _real_and_padded()
    spec = StepSpec(n_mels=N_MELS, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=1)
    alone, in_padded = build_reference_step(spec), build_reference_step(spec)
    assert row_inputs_taken(alone) == ()  # the reference step is exact without them
    loss_alone = _run(alone, real, None)["loss"]
    loss_padded = _run(in_padded, padded, _REAL)["loss"]
    assert loss_alone > 0.1
    np.testing.assert_allclose(loss_padded, loss_alone, rtol=1e-6)
    for a, b in zip(alone.variables(), in_padded.variables()):  # and the same update
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


def test_a_step_that_averages_over_rows_gets_rows_and_row_mask_and_stays_exact() -> None:
    real, padded = _real_and_padded()
    padded["mel"][_REAL:] = 50.0  # garbage in padding rows must not count
    step = _RowMeanStep()
    assert row_inputs_taken(step) == ("rows", "row_mask")
    got = _run(step, padded, _REAL)
    assert (got["rows"], got["mask_rows"]) == (_REAL, _REAL)
    alone = _run(_RowMeanStep(), real, None)  # rows None = every row real
    assert alone["rows"] == alone["mask_rows"] == _REAL
    np.testing.assert_allclose(got["loss"], alone["loss"], rtol=1e-6)
    assert step.w.numpy()[0] == pytest.approx(0.01)  # warm-up (rows 0) was rolled back: one update


def test_row_inputs_are_offered_by_name_or_to_kwargs_only() -> None:
    def four(mel: Any, mel_len: Any, tokens: Any, tok_len: Any) -> Any: ...
    def masked(mel: Any, mel_len: Any, tokens: Any, tok_len: Any, *, row_mask: Any = None) -> Any: ...
    def anything(*batch: Any, **inputs: Any) -> Any: ...

    assert row_inputs_taken(four) == ()
    assert row_inputs_taken(masked) == ("row_mask",)
    assert row_inputs_taken(anything) == ("rows", "row_mask")
