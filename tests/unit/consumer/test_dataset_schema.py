"""The Keras dataset's element spec carries the batch schema's extras by name (consumer/dataset.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import tensorflow as tf

from melfeed.consumer.dataset import _spec, feature_keys
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.schema import ExtraSpec

pytestmark = pytest.mark.tf

EXTRAS = (
    ExtraSpec("speaker", "utterance", "int32"),
    ExtraSpec("energy", "frame", "float32"),
    ExtraSpec("ref", "sequence", "float16", (2,)),
)


def _consumer(*buckets: Bucket) -> Any:
    return SimpleNamespace(
        _cfg=SimpleNamespace(n_mels=4),
        bucket_shapes=tuple(b.shapes() for b in buckets),
        _bucket_set=SimpleNamespace(buckets=buckets),
        extras=buckets[0].extras,
    )


def test_extras_are_features_with_their_dtypes_and_bucket_varying_dims_unknown() -> None:
    feed = _consumer(
        Bucket(0, 2, 8, 3, 4, extras=EXTRAS, seq_lengths=(5,)), Bucket(1, 2, 16, 6, 4, extras=EXTRAS, seq_lengths=(9,))
    )
    assert feature_keys(feed)[7:] == ("speaker", "energy", "ref", "ref_len")
    feats, mel = _spec(feed, ("tokens", "speaker", "energy", "ref", "ref_len"), None)
    assert mel == tf.TensorSpec((None, None, 4), tf.float32, name="mel")
    assert {k: (tuple(v.shape), v.dtype) for k, v in feats.items()} == {
        "tokens": ((None, None), tf.int32),
        "speaker": ((None,), tf.int32),
        "energy": ((None, None), tf.float32),
        "ref": ((None, None, 2), tf.float16),
        "ref_len": ((None,), tf.int32),
    }


def test_a_cache_without_extras_offers_the_base_features_only() -> None:
    assert feature_keys(_consumer(Bucket(0, 2, 8, 3, 4))) == (
        "tokens",
        "tok_len",
        "mel_len",
        "frames",
        "batch_id",
        "rows",
        "row_mask",
    )
    with pytest.raises(ValueError, match="subset"):
        from melfeed.consumer.dataset import make_dataset

        make_dataset(_consumer(Bucket(0, 2, 8, 3, 4)), False, ("speaker",))


def test_features_given_as_one_string_is_one_key_and_the_error_names_the_unknown_ones() -> None:
    from melfeed.consumer.dataset import make_dataset

    with pytest.raises(ValueError, match=r"got \('speaker',\); unknown: \['speaker'\]"):
        make_dataset(_consumer(Bucket(0, 2, 8, 3, 4)), False, "speaker")  # not ('s', 'p', 'e', ...)


def test_a_float16_wire_gives_the_element_spec_a_float16_mel() -> None:
    feats, mel = _spec(_consumer(Bucket(0, 2, 8, 3, 4, mel_dtype="float16")), ("tokens",), None)
    assert mel == tf.TensorSpec((None, None, 4), tf.float16, name="mel") and feats["tokens"].dtype == tf.int32


def test_the_longest_token_axis_leaves_the_cut_dimension_unknown_even_when_every_bucket_has_one_width() -> None:
    extras = (*EXTRAS, ExtraSpec("attn", "matrix", "float16", (), 3), ExtraSpec("dur", "token", "int32"))
    feed = _consumer(Bucket(0, 2, 9, 3, 4, extras=extras, seq_lengths=(5,)))
    keys = ("tokens", "energy", "ref", "attn", "dur", "speaker")
    bucket, _ = _spec(feed, keys, None)
    feats, _ = _spec(feed, keys, None, extras)
    assert {k: tuple(v.shape) for k, v in bucket.items()} == {
        "tokens": (None, None),
        "energy": (None, 9),
        "ref": (None, 5, 2),
        "attn": (None, 3, 3),
        "dur": (None, 3),
        "speaker": (None,),
    }
    assert {k: tuple(v.shape) for k, v in feats.items()} == {
        "tokens": (None, None),
        "energy": (None, 9),
        "ref": (None, None, 2),
        "attn": (None, None, 3),
        "dur": (None, None),
        "speaker": (None,),
    }


def test_a_token_axis_that_is_not_bucket_or_longest_is_one_clear_value_error() -> None:
    from melfeed.consumer.dataset import make_dataset

    with pytest.raises(ValueError, match=r"^token_axis must be one of \['bucket', 'longest'\], got 'shortest'$"):
        make_dataset(_consumer(Bucket(0, 2, 8, 3, 4)), False, ("tokens",), token_axis="shortest")
