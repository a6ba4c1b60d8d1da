"""``python tests/fit_resume_run.py CACHE STATE WEIGHTS.npz STEPS [DELAY_MS]``: a deterministic Keras ``fit`` that
resumes through ``FitResume`` (the test kills it with SIGKILL and starts it again), saving its final weights."""

from __future__ import annotations

import sys

import keras
import numpy as np
import tensorflow as tf

from melfeed.consumer.app import start_producers, stop_producers
from melfeed.consumer.feed import Consumer
from melfeed.consumer.fit_resume import FitResume
from melfeed.shared.config_loader import config_from_mapping, with_overrides


class Tiny(keras.Model):
    def __init__(self, n_mels: int) -> None:
        super().__init__()
        self.embed = keras.layers.Embedding(256, 8)
        self.out = keras.layers.Dense(n_mels)

    def call(self, x: dict[str, tf.Tensor]) -> tf.Tensor:
        h = self.out(tf.reduce_mean(self.embed(x["tokens"]), axis=1))
        return tf.repeat(h[:, None, :], x["frames"][0], axis=1)


def main(cache: str, state: str, weights: str, steps: int, delay_ms: float) -> None:
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    cfg = config_from_mapping({"cache_dir": cache, "producer": {"count": 1},
                               "consumer": {"steps": steps, "state_dir": state, "checkpoint_every_steps": 4}})
    with FitResume(cfg) as resume, Consumer(cfg, start_batch=resume.next_batch) as feed:
        group = start_producers(with_overrides(cfg, {"transport.endpoint": feed.endpoint}), delay_ms)
        try:
            model = Tiny(cfg.n_mels)
            model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
            ds = feed.as_dataset(features=("tokens", "frames"))
            print(f"starts at batch {resume.next_batch}", flush=True)
            model.fit(ds, epochs=1, verbose=0, shuffle=False, callbacks=[resume.callback(model, feed, ds)])
        finally:
            stop_producers(group)
    np.savez(weights, *[v.numpy() for v in model.weights])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]) if len(sys.argv) > 5 else 0.0)
