"""The batch schema reaches the step: extras by keyword, only those the step names; the spec describes them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.step import CompiledStep
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.schema import ExtraSpec

pytestmark = pytest.mark.tf

SPEAKER = ExtraSpec("speaker", "utterance", "int32")
ENERGY = ExtraSpec("energy", "frame", "float32")
REF = ExtraSpec("ref", "sequence", "float16", (2,))
EXTRAS = (SPEAKER, ENERGY, REF)
BUCKET = Bucket(0, 2, 8, 3, 4, extras=EXTRAS, seq_lengths=(5,))


class _Recorder:
    """A step that returns what it was given, by name: speaker sum, energy sum, ref_len sum."""

    def __init__(self) -> None:
        self.calls: list[set[str]] = []

    def __call__(
        self,
        mel: tf.Tensor,
        mel_len: tf.Tensor,
        tokens: tf.Tensor,
        tok_len: tf.Tensor,
        *,
        speaker: tf.Tensor,
        energy: tf.Tensor,
        ref_len: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        return {
            "loss": tf.reduce_sum(mel),
            "speaker": tf.cast(tf.reduce_sum(speaker), tf.float32),
            "energy": tf.reduce_sum(energy),
            "ref_len": tf.cast(tf.reduce_sum(ref_len), tf.float32),
        }

    def variables(self) -> list[Any]:
        return []

    def checkpoint_items(self) -> dict[str, object]:
        return {}


class _Everything(_Recorder):
    def __call__(
        self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, **extras: tf.Tensor
    ) -> dict[str, tf.Tensor]:
        self.calls.append(set(extras))
        return {"loss": tf.reduce_sum(mel) + tf.reduce_sum(tf.cast(extras["ref"], tf.float32))}


class _BaseOnly(_Recorder):
    def __call__(  # type: ignore[override]  # takes no extras: the subject
        self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor
    ) -> tf.Tensor:
        return tf.reduce_sum(mel)


def _batch() -> dict[str, tf.Tensor]:
    shapes, dtypes = BUCKET.shapes(), BUCKET.dtypes()
    out = {k: np.ones(shapes[k], dtypes[k]) for k in shapes}
    out["speaker"][:] = [3, 4]
    out["energy"][:] = 0.5
    out["ref_len"][:] = [5, 2]
    return {k: tf.constant(v) for k, v in out.items()}


def test_the_step_gets_the_extras_it_names_by_keyword() -> None:
    compiled = CompiledStep(_Recorder(), [BUCKET.shapes()], jit_compile=False, extras=EXTRAS)
    compiled.warm_up()
    out = {k: float(v) for k, v in compiled.run(0, _batch()).items()}
    assert out == {"loss": 2 * 8 * 4, "speaker": 7.0, "energy": 8.0, "ref_len": 7.0}


def test_a_step_with_var_keywords_gets_every_extra_and_a_base_only_step_gets_none() -> None:
    everything = _Everything()
    compiled = CompiledStep(everything, [BUCKET.shapes()], jit_compile=False, extras=EXTRAS)
    compiled.warm_up()
    assert float(compiled.run(0, _batch())["loss"]) == 2 * 8 * 4 + 2 * 5 * 2
    assert everything.calls[-1] == {"speaker", "energy", "ref", "ref_len", "rows", "row_mask"}  # row inputs too
    base = CompiledStep(_BaseOnly(), [BUCKET.shapes()], jit_compile=False, extras=EXTRAS)
    base.warm_up()
    assert float(base.run(0, _batch())["loss"]) == 2 * 8 * 4


def test_an_extra_of_the_wrong_dtype_is_refused_by_name() -> None:
    compiled = CompiledStep(_Recorder(), [BUCKET.shapes()], jit_compile=False, extras=EXTRAS)
    with pytest.raises(TypeError, match="speaker"):
        compiled.run(0, {**_batch(), "speaker": tf.zeros((2,), tf.int64)})


class _WantsPitch(_Recorder):
    def __call__(  # type: ignore[override]  # wants an extra the batch lacks: the subject
        self,
        mel: tf.Tensor,
        mel_len: tf.Tensor,
        tokens: tf.Tensor,
        tok_len: tf.Tensor,
        *,
        speaker: tf.Tensor,
        pitch: tf.Tensor,
    ) -> tf.Tensor:
        return tf.reduce_sum(mel)


def test_a_step_that_needs_an_array_the_cache_lacks_is_refused_by_name_before_compiling() -> None:
    with pytest.raises(ConfigError) as info:
        CompiledStep(_WantsPitch(), [BUCKET.shapes()], extras=EXTRAS, factory="tts:make")
    assert info.value.path == ("model", "step") and info.value.got == "tts:make"
    assert (
        "cannot take the batch: needs 'pitch', which the batch does not hold (it holds mel, mel_len, tokens, "
        "tok_len, speaker, energy, ref, ref_len, rows, row_mask)" in str(info.value)
    )


def test_extras_on_several_replicas_are_refused_naming_them() -> None:
    with pytest.raises(ConfigError) as info:  # any replicas object: the refusal comes before it is used
        CompiledStep(_Recorder(), [BUCKET.shapes()], extras=EXTRAS, replicas=object())  # type: ignore[arg-type]
    assert str(info.value) == (
        "consumer.replicas: a step that takes extra arrays (speaker, energy, ref_len) cannot "
        "run on several replicas yet (leave them out of __call__), or set consumer.replicas: 1"
    )


def test_the_step_spec_describes_the_schema() -> None:
    spec = StepSpec(4, 16, 0.01, False, 0, bucket_shapes=(BUCKET.shapes(),), extras=EXTRAS)
    assert spec.extras == EXTRAS and spec.bucket_shapes[0]["ref"] == (2, 5, 2)
    assert StepSpec(4, 16, 0.01, False, 0).extras == ()
