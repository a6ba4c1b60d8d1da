"""Keras ``fit`` on melfeed batches that resumes exactly after a crash (``melfeed.FitResume``), with TensorBoard.

    python docs/examples/keras_fit.py --state-dir /tmp/fit-state --steps 60 --tensorboard /tmp/fit-tb

Kill it at any moment (even SIGKILL) and run the same command again: it continues at the first batch the
committed variables have not seen, and ``melfeed audit /tmp/fit-state`` proves every batch trained once.
``--tensorboard DIR``: melfeed's feed figures go to ``DIR/feed`` (``melfeed.FeedBoard``, no extra package), and
with the ``tensorboard`` package installed Keras's own losses to ``DIR/train``: ``tensorboard --logdir DIR``.
"""

from __future__ import annotations

import argparse
import importlib.util

import keras
import numpy as np
import tensorflow as tf

import melfeed


class TinyTTS(keras.Model):
    """Tokens in, mel frames out: mean token embedding -> one frame, repeated over the bucket's frames."""

    def __init__(self, n_mels: int) -> None:
        super().__init__()
        self.embed = keras.layers.Embedding(256, 8)
        self.out = keras.layers.Dense(n_mels)

    def call(self, x: dict[str, tf.Tensor]) -> tf.Tensor:
        h = self.out(tf.reduce_mean(self.embed(x["tokens"]), axis=1))
        return tf.repeat(h[:, None, :], x["frames"][0], axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", help="a melfeed cache (default: the demo cache, 300 utterances)")
    ap.add_argument("--state-dir", required=True, help="checkpoints and the audit log: resume from here")
    ap.add_argument("--steps", type=int, default=60, help="batches the whole run trains")
    ap.add_argument("--save-weights", help="write the final weights to this .npz file")
    ap.add_argument("--tensorboard", help="TensorBoard log directory: feed figures, and Keras's losses")
    args = ap.parse_args()
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()  # the same batches give the same weights, bit for bit
    cfg = melfeed.config_from_mapping(
        {
            "cache_dir": args.cache_dir or str(melfeed.demo_cache(300)),
            "consumer": {"steps": args.steps, "state_dir": args.state_dir, "checkpoint_every_steps": 5},
        }
    )
    with melfeed.FitResume(cfg) as resume, melfeed.Consumer(cfg, start_batch=resume.next_batch, producers=1) as feed:
        model = TinyTTS(cfg.n_mels)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
        dataset = feed.as_dataset(features=("tokens", "frames"))
        callbacks = [resume.callback(model, feed, dataset)]
        if args.tensorboard:
            callbacks.append(melfeed.FeedBoard(feed, args.tensorboard, every_steps=5).callback())
            if importlib.util.find_spec("tensorboard") is not None:  # Keras's own writer needs the package
                callbacks.append(keras.callbacks.TensorBoard(args.tensorboard, update_freq=5))
        print(f"starts at batch {resume.next_batch} of {args.steps}", flush=True)
        model.fit(
            dataset,
            epochs=1,
            steps_per_epoch=args.steps - resume.next_batch,
            verbose=0,
            shuffle=False,
            callbacks=callbacks,
        )
    if args.save_weights:
        np.savez(args.save_weights, *[v.numpy() for v in model.weights])


if __name__ == "__main__":
    main()
