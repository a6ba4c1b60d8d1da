"""Your own training loop on ``melfeed.Consumer``: batches in plan order, one compiled step per bucket shape.

    python docs/examples/own_loop.py --steps 100

Each batch's arrays are views of its ring slot; the batch is applied (exactly once) when the loop asks for the next
one (docs/guide/your-model.md, "A loop of your own").
"""

from __future__ import annotations

import argparse

import keras
import tensorflow as tf

import melfeed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", help="a melfeed cache (default: the demo cache, 300 utterances)")
    ap.add_argument("--steps", type=int, default=100, help="batches to train")
    args = ap.parse_args()
    cfg = melfeed.config_from_mapping(
        {"cache_dir": args.cache_dir or str(melfeed.demo_cache(300)), "consumer": {"steps": args.steps}}
    )
    model = keras.Sequential(
        [keras.layers.Embedding(256, 32), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(cfg.n_mels)]
    )  # tokens -> one mel frame for the utterance
    model.build((None, None))
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)

    @tf.function  # traced once per bucket shape: the consumer's shapes are fixed
    def step(mel: tf.Tensor, mel_len: tf.Tensor, tokens: tf.Tensor) -> tf.Tensor:
        frames = tf.sequence_mask(mel_len, tf.shape(mel)[1], tf.float32)[..., None]
        with tf.GradientTape() as tape:
            err = tf.abs(model(tokens)[:, None, :] - mel) * frames
            loss = tf.reduce_sum(err) / tf.maximum(tf.reduce_sum(frames) * cfg.n_mels, 1.0)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    losses = []
    with melfeed.Consumer(cfg, producers=1) as feed:  # starts one producer; stops it on leaving
        for batch in feed.batches():
            losses.append(float(step(batch.arrays["mel"], batch.arrays["mel_len"], batch.arrays["tokens"])))
    print(
        f"applied {feed.applied} batches ({feed.applied_ids[0]}..{feed.applied_ids[-1]}); "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )


if __name__ == "__main__":
    main()
