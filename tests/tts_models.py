"""A tiny Tacotron-kind step for tests: a masked BiLSTM encoder, a reduction-factor decoder, guided attention.

Written the way TensorFlowTTS-style models are: token embedding, a bidirectional LSTM over the text masked with
``tf.sequence_mask(tok_len, maxlen=tf.reduce_max(tok_len))`` (so the tokens must be cut to the batch's longest
row: the step declares ``token_axis = "longest"``), a decoder that emits ``R`` = 3 frames per decoder step from
an attention over the encoder outputs with memory lengths (so the frame axis must be a multiple of 3:
``frame_multiple = 3``), ``tf.debugging.assert_positive`` on both lengths (the run uses ``buckets.partial:
drop``: no padding rows), and named losses: a masked mel L1 and, when the cache has it, a guided-attention
loss against the ``attn`` matrix extra (``[tokens, ceil(frames / 3)]`` per utterance: the batch gives
``[B, L, T / 3]``, its token axis cut with the tokens).

``tacotron_step``: takes ``attn`` (the cache must have it). ``uncut_tacotron_step``: the same model with the
default ``token_axis`` (the bucket's width): in graph mode its encoder's mask is narrower than its input.
``TacotronFit``: the same model and losses for Keras ``fit`` on ``as_dataset(features=FIT_FEATURES,
token_axis="longest")``.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from melfeed.consumer.train.model import StepSpec
from tests.attention_data import R  # frames per decoder step (reduction factor)

_D = 16  # embedding, encoder (per direction) and attention width
_N_POS = 6  # decoder query features: r, 1, sin/cos of 2 octaves
FIT_FEATURES = ("tokens", "tok_len", "mel_len", "attn")


def _queries(n_steps: int, mel_len: tf.Tensor) -> tf.Tensor:
    """[B, n_steps, _N_POS] features of each decoder step's relative position."""
    r = (
        (tf.cast(tf.range(n_steps), tf.float32)[None, :] + 0.5)
        * R
        / tf.cast(tf.maximum(mel_len, 1), tf.float32)[:, None]
    )
    feats = [r, tf.ones_like(r)]
    for k in range(2):
        feats += [tf.sin(np.pi * 2**k * r), tf.cos(np.pi * 2**k * r)]
    return tf.stack(feats, axis=-1)


class _Tacotron(keras.Model):  # type: ignore[misc]  # Keras is untyped
    """tokens [B, L'] + lengths -> (mel [B, T, M], alignment [B, L', T / R])."""

    def __init__(self, spec: StepSpec) -> None:
        super().__init__(name="tiny_tacotron")
        seeds = iter(int(s) for s in np.random.SeedSequence(spec.seed).generate_state(8))

        def init() -> keras.initializers.Initializer:
            return keras.initializers.GlorotUniform(seed=next(seeds))

        self.embed = keras.layers.Embedding(spec.vocab_size, _D, embeddings_initializer=init())
        self.encoder = keras.layers.Bidirectional(
            keras.layers.LSTM(_D, return_sequences=True, kernel_initializer=init(), recurrent_initializer=init())
        )
        self.query = keras.layers.Dense(2 * _D, kernel_initializer=init())
        self.out = keras.layers.Dense(R * spec.n_mels, kernel_initializer=init())
        self.n_mels = spec.n_mels

    def call(self, tokens: tf.Tensor, tok_len: tf.Tensor, mel_len: tf.Tensor, n_frames: int) -> tuple[Any, Any]:
        mask = tf.sequence_mask(tok_len, maxlen=tf.reduce_max(tok_len))  # [B, L'] (dynamic padding)
        memory = self.encoder(self.embed(tokens), mask=mask)  # [B, L', 2D]
        steps = n_frames // R  # T is a multiple of R
        q = self.query(_queries(steps, mel_len))  # [B, T/R, 2D]
        scores = tf.einsum("bsd,bld->bsl", q, memory)
        memory_mask = tf.sequence_mask(tok_len, tf.shape(memory)[1])  # the memory lengths
        weights = tf.nn.softmax(tf.where(memory_mask[:, None, :], scores, -1e9), axis=-1)
        context = tf.einsum("bsl,bld->bsd", weights, memory)
        mel = tf.reshape(self.out(context), [-1, steps * R, self.n_mels])  # R frames per decoder step
        return mel, tf.transpose(weights, [0, 2, 1])  # alignment [B, L', T/R]


def _losses(
    model: _Tacotron, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, attn: tf.Tensor | None
) -> dict[str, tf.Tensor]:
    """Named losses: masked mel L1, guided attention (with ``attn``), their sum ``loss``; T may be unknown."""
    tf.debugging.assert_positive(tok_len, message="tok_len")
    tf.debugging.assert_positive(mel_len, message="mel_len")
    n_frames = mel.shape[1] if mel.shape[1] is not None else tf.shape(mel)[1]  # None in a fit dataset's spec
    pred, align = model(tokens, tok_len, mel_len, n_frames=n_frames)
    frame_mask = tf.sequence_mask(mel_len, n_frames)[..., None]
    n_valid = tf.maximum(tf.reduce_sum(tf.cast(frame_mask, tf.float32)) * mel.shape[2], 1.0)
    mel_l1 = tf.reduce_sum(tf.where(frame_mask, tf.abs(pred - mel), 0.0)) / n_valid
    out = {"mel_l1": mel_l1}
    if attn is not None:  # [B, L', T/R] like the alignment: both token axes cut alike
        attn_mask = tf.cast(attn > 0, tf.float32)
        out["guided_attn"] = tf.reduce_sum(align * tf.cast(attn, tf.float32)) / tf.maximum(
            tf.reduce_sum(attn_mask), 1.0
        )
    out["loss"] = tf.add_n(list(out.values()))
    return out


class _TacotronStep:
    token_axis = "longest"
    frame_multiple = R

    def __init__(self, spec: StepSpec) -> None:
        self.model = _Tacotron(spec)
        self.optimizer = keras.optimizers.Adam(learning_rate=float(spec.learning_rate))
        one = tf.ones([1], tf.int32)
        self.model(tf.ones([1, 1], tf.int32), one, one * R, n_frames=R)  # every variable before tracing
        self.optimizer.build(self.model.trainable_variables)

    def __call__(
        self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, *, attn: tf.Tensor
    ) -> dict[str, tf.Tensor]:
        trainable = self.model.trainable_variables
        with tf.GradientTape() as tape:
            out = _losses(self.model, tf.cast(mel, tf.float32), mel_len, tokens, tok_len, attn)
        self.optimizer.apply(tape.gradient(out["loss"], trainable), trainable)
        return out

    def variables(self) -> list[tf.Variable]:
        found: dict[int, tf.Variable] = {}
        for v in [*self.model.variables, *self.optimizer.variables]:
            tv = v.value if isinstance(v, keras.Variable) else v
            found.setdefault(id(tv), tv)
        return list(found.values())

    def checkpoint_items(self) -> dict[str, object]:
        return {"model": self.model, "optimizer": self.optimizer}


class _UncutTacotronStep(_TacotronStep):
    token_axis = "bucket"


def tacotron_step(spec: StepSpec) -> _TacotronStep:
    return _TacotronStep(spec)


def uncut_tacotron_step(spec: StepSpec) -> _UncutTacotronStep:
    return _UncutTacotronStep(spec)


class TacotronFit(keras.Model):  # type: ignore[misc]  # Keras is untyped
    """The model for Keras ``fit``: ``({FIT_FEATURES...}, mel)`` elements, the step's losses as fit's logs."""

    def __init__(self, spec: StepSpec) -> None:
        super().__init__(name="tiny_tacotron_fit")
        self.net = _Tacotron(spec)
        one = tf.ones([1], tf.int32)
        self.net(tf.ones([1, 1], tf.int32), one, one * R, n_frames=R)  # every variable before fit

    def call(self, x: dict[str, tf.Tensor]) -> Any:
        n_frames = R * -(-tf.reduce_max(x["mel_len"]) // R)  # the longest row, in decoder steps
        return self.net(x["tokens"], x["tok_len"], x["mel_len"], n_frames=n_frames)

    def train_step(self, data: Any) -> dict[str, tf.Tensor]:
        x, mel = data
        with tf.GradientTape() as tape:
            out = _losses(self.net, tf.cast(mel, tf.float32), x["mel_len"], x["tokens"], x["tok_len"], x["attn"])
        grads = tape.gradient(out["loss"], self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return out
