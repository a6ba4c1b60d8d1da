"""A FastSpeech-kind (duration-driven) text-to-mel model for tests, in the ``tf.keras`` API that Keras 3 and tf_keras
(Keras 2, ``TF_USE_LEGACY_KERAS=1``) share: the same file is a Keras 3 model by default and a Keras 2 model
under that variable.

Encoder over tokens (embedding + conv), a duration predictor (log(1 + frames) per token), a length regulator
that expands each token's encoding to the frames it lasts (its per-token integer ``durations``, a token extra:
gather by cumulative durations, teacher-forced as FastSpeech trains) and a per-frame decoder. Named losses:
``mel_loss`` (masked L1), ``duration_loss`` (masked MSE of log durations) and their sum ``loss``.
Invariant checked on every step: for every real row the expanded length (the sum of its durations) equals
``mel_len``; a batch that breaks it (durations of zeros for real rows) fails the step.

Two ways to train it: ``make_step`` is the step factory of the built-in loop (``model.step:
tests.fastspeech_kind:make_step``); ``python -m tests.fastspeech_kind --cache-dir C --state-dir S --steps N``
trains it with Keras ``fit`` on ``Consumer.as_dataset`` with ``melfeed.FitResume`` and prints each batch's logs as
JSON; with ``--run-config CFG --run-summary S`` it first runs ``melfeed run --config CFG --producers 1 --steps N
--summary-json S`` (the built-in loop) in the same process, prints ``RUN_DONE`` on stderr after it and its exit code
in the JSON (one TensorFlow start for both ways under one Keras). The learning rate is a schedule, so under tf_keras
the optimizer has a ``current_learning_rate`` variable that ``optimizer.variables()`` leaves out
(``optimizer_variables`` adds it).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import tensorflow as tf

import melfeed
from melfeed.consumer.train.model import StepSpec, optimizer_variables

keras = tf.keras  # tf_keras under TF_USE_LEGACY_KERAS=1, else Keras 3
FEATURES = ("tokens", "tok_len", "mel_len", "frames", "durations", "row_mask")
RUN_DONE = "fastspeech_kind: the built-in run ended; Keras fit starts"  # on stderr: what comes before is the run's


def regulate(h: tf.Tensor, durations: tf.Tensor, n_frames: tf.Tensor) -> tf.Tensor:
    """Length regulator: [B, L, H] token encodings -> [B, T, H], token i repeated ``durations[:, i]`` times;
    frames after the last token's are zeros."""
    ends = tf.cumsum(durations, axis=1)  # [B, L] frame after each token
    frames = tf.broadcast_to(tf.range(n_frames, dtype=durations.dtype)[None, :], [tf.shape(h)[0], n_frames])
    index = tf.searchsorted(ends, frames, side="right")  # [B, T] token on screen; L: none
    inside = tf.cast(index < tf.shape(h)[1], h.dtype)[..., None]
    return tf.gather(h, tf.minimum(index, tf.shape(h)[1] - 1), batch_dims=1) * inside


class FastSpeechKind(keras.Model):  # type: ignore[misc, name-defined]  # tf.keras: untyped, a module variable here
    """{"tokens", "tok_len", "durations", "frames"} -> {"mel": [B, T, M], "log_duration": [B, L]}."""

    def __init__(self, vocab_size: int, n_mels: int, hidden: int = 32, seed: int = 0) -> None:
        super().__init__(name="fastspeech_kind")
        init = keras.initializers.GlorotUniform(seed=seed)
        self.embed = keras.layers.Embedding(vocab_size, hidden, name="embed")
        self.encoder = keras.layers.Conv1D(hidden, 3, padding="same", activation="relu", kernel_initializer=init)
        self.duration = keras.layers.Dense(1, kernel_initializer=init, name="duration")
        self.decoder = keras.layers.Dense(hidden, activation="tanh", kernel_initializer=init, name="decoder")
        self.mel_head = keras.layers.Dense(n_mels, kernel_initializer=init, name="mel_head")

    def call(self, x: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        tokens = x["tokens"]
        mask = tf.sequence_mask(x["tok_len"], tf.shape(tokens)[1], tf.float32)[..., None]
        h = self.encoder(self.embed(tokens) * mask) * mask  # [B, L, H]
        frames = regulate(h, tf.cast(x["durations"], tf.int32), tf.reshape(x["frames"][:1], []))
        return {"mel": self.mel_head(self.decoder(frames)), "log_duration": tf.squeeze(self.duration(h), -1)}

    def train_step(self, data: Any) -> dict[str, tf.Tensor]:
        """Keras ``fit``'s step: the same losses as the built-in loop's step."""
        x, mel = data
        with tf.GradientTape() as tape:
            parts = losses(
                self(x, training=True), mel, x["mel_len"], x["tokens"], x["tok_len"], x["durations"], x["row_mask"]
            )
        grads = tape.gradient(parts["loss"], self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return parts


def losses(
    out: dict[str, tf.Tensor],
    mel: tf.Tensor,
    mel_len: tf.Tensor,
    tokens: tf.Tensor,
    tok_len: tf.Tensor,
    durations: tf.Tensor,
    row_mask: tf.Tensor,
) -> dict[str, tf.Tensor]:
    """Named losses, normalised by valid frames and tokens (padding rows and frames count for nothing)."""
    expanded = tf.reduce_sum(tf.cast(durations, tf.int32), axis=1)
    tf.debugging.assert_equal(
        tf.where(row_mask, expanded, mel_len),
        mel_len,
        message="expanded length (sum of durations) != mel_len for a real row",
    )
    mel = tf.cast(mel, tf.float32)
    frame_mask = tf.sequence_mask(mel_len, tf.shape(mel)[1], tf.float32)[..., None]
    mel_loss = tf.reduce_sum(tf.abs(out["mel"] - mel) * frame_mask) / tf.maximum(
        tf.reduce_sum(frame_mask) * tf.cast(tf.shape(mel)[2], tf.float32), 1.0
    )
    tok_mask = tf.sequence_mask(tok_len, tf.shape(tokens)[1], tf.float32)
    target = tf.math.log1p(tf.cast(durations, tf.float32))
    duration_loss = tf.reduce_sum(tf.square(out["log_duration"] - target) * tok_mask) / tf.maximum(
        tf.reduce_sum(tok_mask), 1.0
    )
    return {"loss": mel_loss + duration_loss, "mel_loss": mel_loss, "duration_loss": duration_loss}


def _optimizer(learning_rate: float) -> Any:
    schedule = keras.optimizers.schedules.ExponentialDecay(learning_rate, decay_steps=50, decay_rate=0.9)
    return keras.optimizers.Adam(schedule)


class FastSpeechStep:
    """The built-in loop's step: one update per batch; every variable built before the factory returns."""

    def __init__(self, spec: StepSpec) -> None:
        expected = spec.params.get("keras")  # the test says which Keras it runs under: never the other silently
        if expected is not None and not keras.__name__.startswith(str(expected)):
            raise RuntimeError(f"tf.keras is {keras.__name__}, not {expected}")
        self.model = FastSpeechKind(spec.vocab_size, spec.n_mels, int(spec.params.get("hidden", 32)), spec.seed)
        self.optimizer = _optimizer(spec.learning_rate)
        one = tf.ones([1], tf.int32)
        self.model(
            {"tokens": tf.ones([1, 2], tf.int32), "tok_len": one, "durations": tf.ones([1, 2], tf.int32), "frames": one}
        )
        self.optimizer.build(self.model.trainable_variables)

    def __call__(
        self,
        mel: tf.Tensor,
        mel_len: tf.Tensor,
        tokens: tf.Tensor,
        tok_len: tf.Tensor,
        *,
        durations: tf.Tensor,
        row_mask: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        frames = tf.fill(tf.shape(mel_len), tf.shape(mel)[1])
        with tf.GradientTape() as tape:
            out = self.model({"tokens": tokens, "tok_len": tok_len, "durations": durations, "frames": frames})
            parts = losses(out, mel, mel_len, tokens, tok_len, durations, row_mask)
        trainable = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(parts["loss"], trainable), trainable))
        return parts

    def variables(self) -> list[Any]:
        return [*self.model.variables, *optimizer_variables(self.optimizer)]


def make_step(spec: StepSpec) -> FastSpeechStep:
    """Step factory: ``model.step: tests.fastspeech_kind:make_step``."""
    return FastSpeechStep(spec)


def main() -> None:
    ap = argparse.ArgumentParser(description="fit the FastSpeech-kind model on a cache with a durations extra")
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--run-config", help="first train with `melfeed run` on this config (model.step: make_step)")
    ap.add_argument("--run-summary", help="the run's --summary-json")
    args = ap.parse_args()
    run_exit = None if args.run_config is None else _run_builtin(args.run_config, args.run_summary, args.steps)
    cfg = melfeed.config_from_mapping(
        {
            "cache_dir": args.cache_dir,
            "buckets": {"num_buckets": 2, "batch_size": 16},
            "consumer": {"steps": args.steps, "state_dir": args.state_dir, "checkpoint_every_steps": 5},
        }
    )
    with melfeed.FitResume(cfg) as resume, melfeed.Consumer(cfg, start_batch=resume.next_batch, producers=1) as feed:
        model = FastSpeechKind(cfg.model.vocab_size, cfg.n_mels)
        model.compile(optimizer=_optimizer(0.01), jit_compile=False)  # graph mode: the length assertion runs
        dataset = feed.as_dataset(features=FEATURES)
        seen: list[dict[str, float]] = []  # each batch's named losses, as fit reports them
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda _, logs: seen.append({k: float(v) for k, v in logs.items()})
        )
        model.fit(
            dataset, epochs=1, verbose=0, shuffle=False, callbacks=[resume.callback(model, feed, dataset), record]
        )
    print(json.dumps({"keras": keras.__name__, "batches": seen, "run_exit": run_exit}))


def _run_builtin(config: str, summary: str | None, steps: int) -> int:
    """``melfeed run`` (the built-in loop, real producer processes) in this process; its exit code."""
    from melfeed.cli import main as melfeed_main

    argv = ["run", "--config", config, "--producers", "1", "--steps", str(steps)]
    code = melfeed_main([*argv, *(["--summary-json", summary] if summary else [])])
    print(RUN_DONE, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    main()
