"""A complete step factory for the built-in loop, with named losses and one extra array (the demo's ``energy``).

    cd docs/examples && melfeed run --demo --steps 300 --set model.step=step_factory:make_step

Energy-conditioned text-to-mel: each frame's mel comes from the mean token embedding plus that frame's energy, and a
second head predicts the energy from the text. The contract (what ``make_step`` gets, what the step receives and
returns, ``variables()``) is docs/guide/your-model.md, "A step in the built-in loop".
"""

from __future__ import annotations

import keras
import tensorflow as tf

from melfeed.consumer.train.model import StepSpec, optimizer_variables


class EnergyTTS(keras.Model):
    def __init__(self, spec: StepSpec) -> None:
        super().__init__()
        hidden = int(spec.params.get("hidden", 64))  # model.params: {hidden: 64}
        self.embed, self.energy_in = keras.layers.Embedding(spec.vocab_size, hidden), keras.layers.Dense(hidden)
        self.mel_out, self.energy_out = keras.layers.Dense(spec.n_mels), keras.layers.Dense(1)

    def call(self, tokens: tf.Tensor, tok_len: tf.Tensor, energy: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        mask = tf.sequence_mask(tok_len, tf.shape(tokens)[1], tf.float32)[..., None]
        text = tf.reduce_sum(self.embed(tokens) * mask, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)  # [B, H]
        mel = self.mel_out(tf.tanh(text[:, None, :] + self.energy_in(energy[..., None])))  # [B, T, M]
        return mel, self.energy_out(text)  # [B, 1]


class Step:
    def __init__(self, spec: StepSpec) -> None:
        self.model, self.optimizer = EnergyTTS(spec), keras.optimizers.Adam(spec.learning_rate)
        one = tf.ones([1], tf.int32)
        self.model(tf.ones([1, 1], tf.int32), one, tf.zeros([1, 1]))  # every variable exists before training
        self.optimizer.build(self.model.trainable_variables)

    def __call__(
        self, mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor, tok_len: tf.Tensor, *, energy: tf.Tensor
    ) -> dict[str, tf.Tensor]:
        frames = tf.sequence_mask(mel_len, mel.shape[1], tf.float32)  # [B, T]
        n_frames = tf.maximum(tf.reduce_sum(frames), 1.0)
        mean_energy = tf.reduce_sum(energy * frames, 1, keepdims=True) / tf.maximum(
            tf.reduce_sum(frames, 1, keepdims=True), 1.0
        )  # [B, 1]
        with tf.GradientTape() as tape:
            pred_mel, pred_energy = self.model(tokens, tok_len, energy)
            mel_l1 = tf.reduce_sum(tf.abs(pred_mel - mel) * frames[..., None]) / (n_frames * mel.shape[2])
            rows = tf.cast(mel_len > 0, tf.float32)[:, None]  # padding rows count for nothing
            energy_l1 = tf.reduce_sum(tf.abs(pred_energy - mean_energy) * rows) / tf.maximum(tf.reduce_sum(rows), 1.0)
            loss = mel_l1 + energy_l1
        variables = self.model.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss, "mel_l1": mel_l1, "energy_l1": energy_l1}

    def variables(self) -> list[tf.Variable]:  # restored after warm-up, saved in checkpoints: every variable
        return [*self.model.variables, *optimizer_variables(self.optimizer)]


def make_step(spec: StepSpec) -> Step:
    return Step(spec)
