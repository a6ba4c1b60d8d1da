"""What a step declares about its axes: ``token_axis = "longest"`` cuts the token axis inside the program (graph
mode, traced once with it unknown), ``frame_multiple`` refuses buckets that do not fit; bad values are one line."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.train.axes import check_frame_multiple
from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.step import CompiledStep
from melfeed.consumer.train.warm_batches import WarmBatch
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError, StepError  # ConfigError: exit 78 (melfeed/cli.py)
from melfeed.shared.wire.buckets import Bucket, build_buckets
from melfeed.shared.wire.schema import ExtraSpec
from tests.attention_data import R
from tests.tts_models import FIT_FEATURES, TacotronFit, tacotron_step, uncut_tacotron_step

pytestmark = pytest.mark.tf

DUR = ExtraSpec("dur", "token", "int32")
REF = ExtraSpec("ref", "sequence", "float16", (2,))
ATTN = ExtraSpec("attn", "matrix", "float16", (), R)
BUCKET = Bucket(0, 4, 30, 10, 8, extras=(DUR, REF, ATTN), seq_lengths=(6,))  # attn [4, 10, 10]


class _Widths:
    """Returns the token-axis width of every array it takes; records the static widths it was traced with."""

    token_axis = "longest"

    def __init__(self) -> None:
        self.traced: list[tuple[Any, ...]] = []

    def __call__(
        self,
        mel: tf.Tensor,
        mel_len: tf.Tensor,
        tokens: tf.Tensor,
        tok_len: tf.Tensor,
        *,
        dur: tf.Tensor,
        ref: tf.Tensor,
        attn: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        self.traced.append((tokens.shape[1], dur.shape[1], ref.shape[1], attn.shape[1], attn.shape[2]))
        width = {
            k: tf.cast(tf.shape(v)[1], tf.float32)
            for k, v in {"tokens": tokens, "dur": dur, "ref": ref, "attn": attn}.items()
        }
        return {"loss": tf.reduce_sum(mel), **width, "attn_cols": tf.cast(tf.shape(attn)[2], tf.float32)}

    def variables(self) -> list[Any]:
        return []


def _batch(tok_len: list[int], ref_len: list[int], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes, dtypes = BUCKET.shapes(), BUCKET.dtypes()
    out = {k: np.zeros(s, dtypes[k]) for k, s in shapes.items()}
    out["mel"][...] = rng.standard_normal(shapes["mel"])
    out["mel_len"][...] = [30, 21, 12, 27]
    out["tok_len"][...], out["ref_len"][...] = tok_len, ref_len
    for row, n in enumerate(tok_len):
        out["tokens"][row, :n] = rng.integers(1, 20, n)
        out["attn"][row, :n, : -(-int(out["mel_len"][row]) // R)] = rng.random((n, -(-int(out["mel_len"][row]) // R)))
    return out


def _warm(arrays: dict[str, np.ndarray]) -> list[WarmBatch]:
    return [WarmBatch(0, 0, 4, np.zeros(1, np.uint8), arrays)]


def _run(compiled: CompiledStep, arrays: dict[str, np.ndarray]) -> dict[str, float]:
    tensors = {k: tf.constant(v) for k, v in arrays.items()}
    return {k: float(v) for k, v in compiled.run(0, tensors).items()}


def test_longest_cuts_tokens_token_matrix_and_sequence_extras_in_graph_mode_traced_once() -> None:
    step = _Widths()
    compiled = CompiledStep(step, [BUCKET.shapes()], jit_compile=False, extras=BUCKET.extras)
    compiled.warm_up(_warm(_batch([6, 4, 3, 5], [2, 5, 1, 1])))
    assert step.traced == [(None, None, None, None, 10)]  # one trace, the token axes unknown
    first = _run(compiled, _batch([6, 4, 3, 5], [2, 5, 1, 1]))
    second = _run(compiled, _batch([2, 9, 1, 1], [6, 1, 1, 3], seed=1))
    assert (first["tokens"], first["dur"], first["attn"], first["ref"], first["attn_cols"]) == (6, 6, 6, 5, 10)
    assert (second["tokens"], second["dur"], second["attn"], second["ref"]) == (9, 9, 9, 6)
    assert compiled.compiles_after_ready == 0 and compiled.traces == 1


def test_xla_keeps_the_buckets_token_width() -> None:
    compiled = CompiledStep(_Widths(), [BUCKET.shapes()], jit_compile=True, extras=BUCKET.extras)
    compiled.warm_up(_warm(_batch([6, 4, 3, 5], [2, 5, 1, 1])))
    out = _run(compiled, _batch([6, 4, 3, 5], [2, 5, 1, 1]))
    assert (out["tokens"], out["dur"], out["attn"], out["ref"]) == (10, 10, 10, 6)


def test_a_masked_bilstm_encoder_trains_with_the_cut_and_fails_in_graph_mode_without_it() -> None:
    shapes = {k: v for k, v in BUCKET.shapes().items() if k in ("mel", "mel_len", "tokens", "tok_len", "attn")}
    spec = StepSpec(8, 20, 0.01, False, 1, bucket_shapes=(shapes,), extras=(ATTN,))
    batch = _batch([6, 4, 3, 5], [1, 1, 1, 1])
    cut = CompiledStep(tacotron_step(spec), [shapes], jit_compile=False, extras=(ATTN,), factory="tacotron")
    cut.warm_up(_warm(batch))
    out = _run(cut, batch)
    assert set(out) == {"loss", "mel_l1", "guided_attn"} and np.isfinite(out["loss"]) and out["guided_attn"] > 0
    _run(cut, _batch([2, 9, 1, 1], [1, 1, 1, 1], seed=1))
    assert cut.compiles_after_ready == 0
    uncut = CompiledStep(uncut_tacotron_step(spec), [shapes], jit_compile=False, extras=(ATTN,), factory="uncut")
    with pytest.raises(StepError, match="fails in graph mode on the warm-up batch"):
        uncut.warm_up(_warm(batch))


def test_keras_fit_of_the_same_model_fails_in_graph_mode_on_the_buckets_token_width() -> None:
    """The bucket's width is what ``as_dataset(token_axis="bucket")`` gives it; on the cut it trains
    (tests/integration/library/test_fit_token_cut.py)."""
    import keras

    batch = _batch([6, 4, 3, 5], [1, 1, 1, 1])
    bucket = tf.data.Dataset.from_tensors(({k: tf.constant(batch[k]) for k in FIT_FEATURES}, tf.constant(batch["mel"])))
    model = TacotronFit(StepSpec(8, 20, 0.01, False, 1))
    model.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=False)  # graph mode, as on the CPU
    with pytest.raises(tf.errors.InvalidArgumentError, match="lstm"):  # the encoder's narrower mask
        model.fit(bucket, verbose=0, shuffle=False)


def test_a_bad_token_axis_or_frame_multiple_is_one_line_naming_model_step() -> None:
    for attr, value in (("token_axis", "shortest"), ("frame_multiple", 0), ("frame_multiple", "3")):
        step = type("Step", (_Widths,), {attr: value})()
        with pytest.raises(ConfigError) as err:
            if attr == "token_axis":
                CompiledStep(step, [BUCKET.shapes()], jit_compile=False, extras=BUCKET.extras, factory="m:f")
            else:
                check_frame_multiple(step, "m:f", [30], 3)
        assert str(err.value).startswith("model.step: Step.") and "\n" not in str(err.value)


def test_buckets_that_are_not_multiples_of_the_steps_frame_multiple_are_refused_naming_buckets_frame_multiple() -> None:
    step = type("Step", (), {"frame_multiple": R})()
    frames = np.array([100, 205, 340, 521, 870])
    tokens = frames // 5

    def sizes(multiple: int) -> list[int]:
        cfg = BucketConfig(num_buckets=3, batch_size=4, frame_multiple=multiple)
        return [b.max_frames for b in build_buckets(frames, tokens, 8, cfg).buckets]

    with pytest.raises(ConfigError) as err:
        check_frame_multiple(step, "m:f", sizes(8), 8)  # the default buckets.frame_multiple
    text = str(err.value)
    assert (
        text.startswith("buckets.frame_multiple: the step (m:f) needs bucket frame sizes that are multiples of 3")
        and "set buckets.frame_multiple: 3 (or a multiple of it, e.g. 24)" in text
    ), text
    assert all(t % R == 0 for t in sizes(R))
    check_frame_multiple(step, "m:f", sizes(R), R)  # the derived buckets then fit
