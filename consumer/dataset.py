"""``tf.data.Dataset`` view of a running ``Consumer`` for Keras ``fit`` and custom loops, without copies.

Elements: ``(features, mel [B,T,M] float32)``; ``features`` is a dict of the keys asked for, from
``tokens`` [B,L] int32, ``tok_len`` [B] int32, ``mel_len`` [B] int32, ``frames`` [B] int32 (every row
holds the bucket's padded T, so a model predicting [B,T,M] needs no ``.map``) and ``batch_id``
[B] int64, and the cache's extra arrays by name (the batch schema, ``Consumer.extras``; a sequence
extra's ``<name>_len`` too). Shapes per element are one of the bucket shapes (batch and time dims are ``None`` in
the spec, so a ``tf.function`` traces once per bucket), or the largest bucket's when ``single_shape``
(then the spec is fully static, T included).
Zero copy: the generator yields numpy views of the 64-byte-aligned ring slot and TensorFlow wraps
them without copying (an aligned numpy buffer becomes the tensor's buffer; a misaligned one would be
copied, never aborted on). ``single_shape`` pads the smaller buckets, which is one copy.
Invariants (consumer/README.md, "Exactly once on the library path"):
    * The dataset has no read-ahead of its own (no prefetch stage; ``inject_prefetch`` is off): the
      generator runs only when the dataset's caller asks for an element. The ring is the prefetch
      buffer: producers fill up to ``consumer.ring_slots`` slots ahead in the background.
    * A batch counts as applied when the dataset hands it out; its slot is freed only when the
      caller asks for the next element or the iterator ends (the step has finished reading it).
    * Each new iterator (each ``fit``) supersedes the previous one and continues the plan where the
      previous one stopped; batches given back by a dropped ``batches()`` loop come first. Starting it
      frees the slot the superseded one held, so a late-collected Keras iterator keeps no slot.
The dataset ends when the consumer's plan ends, ``close()`` is called, or a newer iterator took over.
Shutdown: a dropped iterator's generator frees the slot it still holds (``finally``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf


if TYPE_CHECKING:
    from consumer.feed import Consumer
    from consumer.handout import Batch

__all__ = ["make_dataset", "FEATURE_KEYS", "feature_keys"]

FEATURE_KEYS = ("tokens", "tok_len", "mel_len", "frames", "batch_id")   # of every cache; extras come after


def feature_keys(consumer: Consumer) -> tuple[str, ...]:
    """Every key ``features`` may name: ``FEATURE_KEYS`` then the batch schema's extra arrays."""
    base = set(FEATURE_KEYS) | {"mel"}
    return FEATURE_KEYS + tuple(k for k in consumer.bucket_shapes[0] if k not in base)


def _pad_to(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


def _big_shapes(consumer: Consumer) -> dict[str, tuple[int, ...]]:
    """The shape of every array when padded to the largest bucket in each dimension."""
    shapes = consumer.bucket_shapes
    return {k: tuple(max(s[k][d] for s in shapes) for d in range(len(shapes[0][k]))) for k in shapes[0]}


def _element(batch: Batch, features: Sequence[str], big: dict[str, tuple[int, ...]] | None
             ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    a = batch.arrays if big is None else {k: _pad_to(v, big[k]) for k, v in batch.arrays.items()}
    rows, frames = a["mel"].shape[:2]
    extra = {"frames": _constant_rows(rows, frames), "batch_id": np.full((rows,), batch.batch_id, np.int64)}
    feats = {k: a[k] if k in a else extra[k] for k in features}
    return feats, a["mel"]


@functools.lru_cache(maxsize=64)
def _constant_rows(rows: int, frames: int) -> np.ndarray:
    """The ``frames`` feature of a bucket, made once (read-only: TensorFlow copies nothing and writes nothing)."""
    out = np.full((rows,), frames, np.int32)
    out.flags.writeable = False
    return out


def _generate(consumer: Consumer, features: Sequence[str], big: dict[str, tuple[int, ...]] | None
              ) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    token = consumer.begin_iterator()        # runs at this iterator's first element request
    held: Batch | None = None
    try:
        while True:
            if held is not None:             # the caller asked for the next element: its step is done
                consumer.free_held_slot(held)
                held = None
            if not consumer.is_current(token):
                return                       # a newer iterator continues the plan
            try:
                batch = consumer.wait_next(token)
            except RuntimeError:             # superseded while waiting: the newer iterator goes on
                return
            if batch is None:
                return
            consumer.apply_and_hold(batch)   # handed to the caller = applied (see the module docstring)
            held = batch
            yield _element(batch, features, big)
    finally:
        if held is not None:
            consumer.free_held_slot(held)


def _spec(consumer: Consumer, features: Sequence[str], big: dict[str, tuple[int, ...]] | None
          ) -> tuple[dict[str, tf.TensorSpec], tf.TensorSpec]:
    m = consumer.cfg.n_mels
    if big is not None:
        shapes: dict[str, tuple[int | None, ...]] = dict(big)
        b = big["mel"][0]
    else:
        shapes = {k: _varying_dims(consumer, k) for k in consumer.bucket_shapes[0]}   # extras too
        shapes.update({"tokens": (None, None), "tok_len": (None,), "mel_len": (None,), "mel": (None, None, m)})
        b = None
    shapes.update(frames=(b,), batch_id=(b,))
    dtypes = {**{k: tf.as_dtype(v) for k, v in consumer.bucket_set.buckets[0].dtypes().items()},
              "frames": tf.int32, "batch_id": tf.int64}
    feats = {k: tf.TensorSpec(shapes[k], dtypes[k], name=k) for k in features}
    return feats, tf.TensorSpec(shapes["mel"], tf.float32, name="mel")


def _varying_dims(consumer: Consumer, key: str) -> tuple[int | None, ...]:
    """``key``'s shape across buckets: rows and any dim that differs between buckets are None."""
    shapes = [s[key] for s in consumer.bucket_shapes]
    return (None, *(d if all(s[i] == d for s in shapes) else None for i, d in enumerate(shapes[0]) if i > 0))


def make_dataset(consumer: Consumer, single_shape: bool, features: Sequence[str]) -> tf.data.Dataset:
    """The dataset described in the module docstring.

    Raises:
        ValueError: ``features`` is empty or names a key outside ``feature_keys(consumer)``.
    """
    allowed = feature_keys(consumer)
    unknown = [k for k in features if k not in allowed]
    if unknown or not features:
        raise ValueError(f"features must be a non-empty subset of {allowed}, got {tuple(features)}")
    keys = tuple(features)
    big = _big_shapes(consumer) if single_shape else None
    ds = tf.data.Dataset.from_generator(lambda: _generate(consumer, keys, big),
                                        output_signature=_spec(consumer, keys, big))
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False   # no read-ahead past the hand-out point
    return ds.with_options(options)
