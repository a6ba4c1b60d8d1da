"""``tf.data.Dataset`` view of a running ``Consumer`` for Keras ``fit`` and custom loops.

Elements: ``({"tokens": [B,L] int32, "tok_len": [B] int32, "mel_len": [B] int32}, mel [B,T,M] float32)``.
Shapes per element are one of the bucket shapes (batch and time dims are ``None`` in the spec,
so a ``tf.function`` traces once per bucket), or the largest bucket's when ``single_shape``.
The generator copies each batch out of its ring slot (``from_generator`` copies anyway), so the
slot is released at once. The dataset ends when the consumer's plan ends or it is closed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from shared.wire.layout import ARRAY_DTYPES

if TYPE_CHECKING:
    from consumer.feed import Consumer

__all__ = ["make_dataset"]


def _pad_to(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


def make_dataset(consumer: Consumer, single_shape: bool) -> tf.data.Dataset:
    buckets = consumer.bucket_set.buckets
    largest = max(buckets, key=lambda b: (b.max_frames, b.batch_size))
    big = {"mel": largest.shapes()["mel"],
           "tokens": (max(b.batch_size for b in buckets), max(b.max_tokens for b in buckets)),
           "len": (max(b.batch_size for b in buckets),)}
    big["mel"] = (big["len"][0], max(b.max_frames for b in buckets), consumer.cfg.n_mels)

    def generate() -> Iterator[tuple[dict[str, Any], Any]]:
        for batch in consumer.batches():
            a = batch.arrays
            if single_shape:
                feats = {"tokens": _pad_to(a["tokens"], big["tokens"]),
                         "tok_len": _pad_to(a["tok_len"], big["len"]),
                         "mel_len": _pad_to(a["mel_len"], big["len"])}
                yield feats, _pad_to(a["mel"], big["mel"])
            else:
                yield ({"tokens": a["tokens"].copy(), "tok_len": a["tok_len"].copy(),
                        "mel_len": a["mel_len"].copy()}, a["mel"].copy())

    m = consumer.cfg.n_mels
    if single_shape:
        b, length, t = big["len"][0], big["tokens"][1], big["mel"][1]
        shapes: dict[str, tuple[int | None, ...]] = {"tokens": (b, length), "tok_len": (b,), "mel_len": (b,),
                                                     "mel": (b, t, m)}
    else:
        shapes = {"tokens": (None, None), "tok_len": (None,), "mel_len": (None,), "mel": (None, None, m)}
    specs = {k: tf.TensorSpec(shape, tf.as_dtype(ARRAY_DTYPES[k])) for k, shape in shapes.items()}
    spec = ({k: specs[k] for k in ("tokens", "tok_len", "mel_len")}, specs["mel"])
    return tf.data.Dataset.from_generator(generate, output_signature=spec)
