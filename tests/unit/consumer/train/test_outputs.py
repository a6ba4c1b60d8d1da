"""Named scalars: the contract's normal form (what a step may return) and reading them."""

from __future__ import annotations

import pytest
import tensorflow as tf

from melfeed.consumer.train.outputs import StepOutputError, normalize_outputs, read_outputs

pytestmark = pytest.mark.tf


def test_a_bare_scalar_means_loss_and_a_mapping_is_ordered_loss_first() -> None:
    assert list(normalize_outputs(tf.constant(1.5))) == ["loss"]
    out = normalize_outputs(
        {
            "stop_bce": tf.constant(0.25, tf.float16),
            "loss": tf.constant(2.0, tf.float64),
            "mel_l1": tf.constant(1.0),
            "steps_seen": tf.constant(3),
        }
    )
    assert list(out) == ["loss", "mel_l1", "steps_seen", "stop_bce"]
    assert all(v.dtype == tf.float32 and v.shape == () for v in out.values())
    assert read_outputs(out) == {"loss": 2.0, "mel_l1": 1.0, "steps_seen": 3.0, "stop_bce": 0.25}


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ({"mel_l1": tf.constant(1.0)}, "returned no 'loss' (names: mel_l1)"),
        ({"loss": tf.constant([1.0, 2.0])}, "output 'loss' must be a scalar number"),
        ({"loss": tf.constant(1.0), "bad name": tf.constant(1.0)}, "output name 'bad name'"),
        ({"loss": tf.constant(1.0), 3: tf.constant(1.0)}, "output name 3"),
        ({"loss": tf.constant("text")}, "must be a scalar number"),
        ({"loss": object()}, "is not a tensor: object"),
    ],
)
def test_a_broken_contract_is_one_line(result: object, reason: str) -> None:
    with pytest.raises(StepOutputError) as info:
        normalize_outputs(result)
    assert reason in str(info.value) and "\n" not in str(info.value)
