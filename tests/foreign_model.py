"""A "foreign" TTS step for tests: written the way users write theirs, unlike the reference model.

A subclassed Keras model with dict outputs (``{"mel": [B, T, M], "stop": [B, T]}``): a mel head and
a stop-token head over per-frame position features plus a masked mean of the token embeddings.
The loss has named parts: masked mel L1, masked stop-token BCE (target 1 on the last real frame)
and their weighted sum ``loss``; the step returns all three by name.

The mel L1 goes through a ``tf.cond`` on a Tacotron-style reduction factor held in a variable
(``reduction``, 1 here, so the first branch is always taken). The untaken branch keeps only whole
groups of ``reduction`` frames, a slice whose size depends on that variable: graph mode never
runs it, but XLA must compile both branches and cannot build the slice's gradient
(``StridedSliceGrad``: the slice's size is not a compile-time constant), so
``model.jit_compile: auto`` falls back to graph mode and ``true`` fails.

``StepSpec.params`` (``model.params``): ``hidden`` (width, default 32), ``stop_weight`` (default
0.5). ``StepSpec.bucket_shapes`` sizes the eager build (every variable exists before tracing). It takes a float16
wire (``transport.mel_dtype: float16``) as the model contract asks: the mel is cast inside the step.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from melfeed.consumer.train.model import StepSpec

_N_POS = 8  # position features per frame: r, 1, sin/cos of 3 octaves


def _positions(n_frames: int, mel_len: tf.Tensor) -> tf.Tensor:
    """[B, T, _N_POS] features of the relative frame position t / mel_len."""
    r = tf.cast(tf.range(n_frames), tf.float32)[None, :] / tf.cast(tf.maximum(mel_len, 1), tf.float32)[:, None]
    feats = [r, tf.ones_like(r)]
    for k in range(3):
        feats += [tf.sin(np.pi * 2**k * r), tf.cos(np.pi * 2**k * r)]
    return tf.stack(feats, axis=-1)


class _Speaker(keras.Model):  # type: ignore[misc]  # Keras is untyped
    """tokens + frame positions -> {"mel": [B, T, M], "stop": [B, T] logits}."""

    def __init__(self, spec: StepSpec, hidden: int) -> None:
        super().__init__(name="speaker")
        init = keras.initializers.GlorotUniform(seed=spec.seed)
        self.embed = keras.layers.Embedding(spec.vocab_size, hidden, name="embed")
        self.frame = keras.layers.Dense(hidden, activation="tanh", kernel_initializer=init, name="frame")
        self.mel_head = keras.layers.Dense(spec.n_mels, kernel_initializer=init, name="mel_head")
        self.stop_head = keras.layers.Dense(1, kernel_initializer=init, name="stop_head")

    def call(self, inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        tokens, tok_len, positions = inputs["tokens"], inputs["tok_len"], inputs["positions"]
        mask = tf.sequence_mask(tok_len, tf.shape(tokens)[1], tf.float32)[..., None]
        text = tf.reduce_sum(self.embed(tokens) * mask, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)
        h = self.frame(positions) + text[:, None, :]
        return {"mel": self.mel_head(h), "stop": tf.squeeze(self.stop_head(h), -1)}


class ForeignStep:
    def __init__(self, spec: StepSpec) -> None:
        self.hidden = int(spec.params.get("hidden", 32))
        self.stop_weight = float(spec.params.get("stop_weight", 0.5))
        self.model = _Speaker(spec, self.hidden)
        self.optimizer = keras.optimizers.Adam(learning_rate=spec.learning_rate)
        self.reduction = tf.Variable(1, dtype=tf.int32, trainable=False, name="reduction")
        biggest = max(spec.bucket_shapes, key=lambda b: b["mel"][1]) if spec.bucket_shapes else None
        frames, n_tok = (biggest["mel"][1], biggest["tokens"][1]) if biggest else (8, 4)
        one = tf.ones([1], tf.int32)
        self.model({"tokens": tf.ones([1, n_tok], tf.int32), "tok_len": one, "positions": _positions(frames, one)})
        self.optimizer.build(self.model.trainable_variables)

    def _mel_l1(self, pred: tf.Tensor, mel: tf.Tensor, frame_mask: tf.Tensor) -> tf.Tensor:
        def l1(p: tf.Tensor, m: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
            err = tf.where(mask[..., None], tf.abs(p - m), 0.0)
            return tf.reduce_sum(err) / tf.maximum(tf.reduce_sum(tf.cast(mask, tf.float32)) * m.shape[-1], 1.0)

        def whole_groups() -> tf.Tensor:  # never taken (reduction is 1); XLA cannot differentiate it
            keep = (tf.shape(mel)[1] // self.reduction) * self.reduction
            return l1(pred[:, :keep], mel[:, :keep], frame_mask[:, :keep])

        return tf.cond(self.reduction == 1, lambda: l1(pred, mel, frame_mask), whole_groups)

    def __call__(
        self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor
    ) -> dict[str, tf.Tensor]:
        mel = tf.cast(mel, tf.float32)  # a float16 wire (StepSpec.mel_dtype): cast inside the program; else a no-op
        n_frames = mel.shape[1]
        frame_mask = tf.sequence_mask(mel_len, n_frames)  # [B, T]
        stop_target = tf.cast(tf.range(n_frames)[None, :] >= (mel_len - 1)[:, None], tf.float32)
        with tf.GradientTape() as tape:
            out = self.model({"tokens": tokens, "tok_len": tok_len, "positions": _positions(n_frames, mel_len)})
            mel_l1 = self._mel_l1(out["mel"], mel, frame_mask)
            bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=stop_target, logits=out["stop"])
            valid = tf.cast(frame_mask, tf.float32)
            stop_bce = tf.reduce_sum(bce * valid) / tf.maximum(tf.reduce_sum(valid), 1.0)
            loss = mel_l1 + self.stop_weight * stop_bce
        trainable = self.model.trainable_variables
        self.optimizer.apply(tape.gradient(loss, trainable), trainable)
        return {"loss": loss, "mel_l1": mel_l1, "stop_bce": stop_bce}

    def variables(self) -> list[tf.Variable]:
        out: dict[int, tf.Variable] = {}
        for v in [*self.model.variables, *self.optimizer.variables]:
            tv = v.value if isinstance(v, keras.Variable) else v
            out.setdefault(id(tv), tv)
        return [*out.values(), self.reduction]

    def checkpoint_items(self) -> dict[str, object]:
        return {"model": self.model, "optimizer": self.optimizer, "reduction": self.reduction}


def build_foreign_step(spec: StepSpec) -> ForeignStep:
    """Step factory: ``model.step: tests.foreign_model:build_foreign_step``."""
    return ForeignStep(spec)


def build_lossless_step(spec: StepSpec) -> object:
    """A step that breaks the contract: its outputs have no ``loss``."""
    step = ForeignStep(spec)

    class _NoLoss:
        def __call__(self, *batch: tf.Tensor) -> dict[str, tf.Tensor]:
            out = step(*batch)
            return {"mel_l1": out["mel_l1"], "stop_bce": out["stop_bce"]}

        variables = staticmethod(step.variables)

    return _NoLoss()
