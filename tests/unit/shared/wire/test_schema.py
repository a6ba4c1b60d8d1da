"""Tests for melfeed.shared.wire.schema and the bucket shapes it adds: declarations, padding by kind, layout."""

from __future__ import annotations

import numpy as np
import pytest

from melfeed.shared.config import BucketConfig
from melfeed.shared.wire.buckets import Bucket, build_buckets
from melfeed.shared.wire.layout import batch_layout
from melfeed.shared.wire.schema import ExtraSchema, ExtraSpec, check_declaration, check_schema, pad_row, row_shape

ENERGY = ExtraSpec("energy", "frame", "float32")
PITCH2 = ExtraSpec("pitch", "frame", "float16", (2,))
DURATION = ExtraSpec("duration", "token", "int32")
SPEAKER = ExtraSpec("speaker", "utterance", "int32")
EMBEDDING = ExtraSpec("spk_emb", "utterance", "float32", (3,))
REF = ExtraSpec("ref", "sequence", "float32", (4,))


@pytest.mark.parametrize(
    ("spec", "values", "dst_shape", "kept", "want"),
    [
        (ENERGY, np.arange(1, 4, dtype=np.float32), (5,), 3, [1, 2, 3, 0, 0]),
        (ENERGY, np.arange(1, 8, dtype=np.float32), (5,), 5, [1, 2, 3, 4, 5]),  # cut to T with the mel
        (PITCH2, np.ones((2, 2), np.float16), (3, 2), 2, [[1, 1], [1, 1], [0, 0]]),
        (DURATION, np.array([4, 2], np.int32), (4,), 2, [4, 2, 0, 0]),
        (SPEAKER, np.array(7, np.int32), (), 1, 7),
        (EMBEDDING, np.array([0.5, -1, 2], np.float32), (3,), 1, [0.5, -1, 2]),
        (REF, np.full((2, 4), 3, np.float32), (3, 4), 2, [[3] * 4, [3] * 4, [0] * 4]),
    ],
)
def test_pad_row_cuts_and_zero_pads_each_kind(
    spec: ExtraSpec, values: np.ndarray, dst_shape: tuple[int, ...], kept: int, want: object
) -> None:
    dst = np.full(dst_shape, 9, dtype=spec.dtype)  # stale bytes from an earlier batch
    assert pad_row(spec, values, dst) == kept
    assert dst.tolist() == want


def test_pad_row_refuses_values_that_break_the_declaration() -> None:
    with pytest.raises(ValueError, match="declared"):
        pad_row(PITCH2, np.ones((2, 3), np.float16), np.zeros((3, 2), np.float16))
    with pytest.raises(ValueError, match="declared"):
        pad_row(SPEAKER, np.array(7, np.int64), np.zeros((), np.int32))


def test_row_shape_by_kind() -> None:
    assert [row_shape(s, 10, 4, 6) for s in (PITCH2, DURATION, SPEAKER, EMBEDDING, REF)] == [
        (10, 2),
        (4,),
        (),
        (3,),
        (6, 4),
    ]


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (("Energy", "frame", "float32", []), "name"),
        (("mel_len", "frame", "float32", []), "name"),
        (("row_mask", "frame", "float32", []), "name"),
        (("energy", "per_frame", "float32", []), "kind"),
        (("energy", "frame", "float64", []), "dtype"),
        (("energy", "frame", "float32", [0]), "shape"),
        (("energy", "frame", "float32", "2"), "shape"),
        (("energy", "frame", "float32", [True]), "shape"),
    ],
)
def test_bad_declarations_name_their_key(args: tuple[object, ...], key: str) -> None:
    bad = check_declaration(*args)
    assert bad is not None and bad[0] == key
    assert check_declaration("energy", "frame", "float32", []) is None


def test_a_sequence_owns_its_length_key() -> None:
    clash = ExtraSpec("ref_len", "utterance", "int32")
    assert check_schema([REF, clash]) == (1, "name", "'ref_len' is declared twice (a sequence also owns <name>_len)")
    assert check_schema([REF, SPEAKER]) is None


def test_bucket_shapes_dtypes_and_layout_follow_the_schema_in_declaration_order() -> None:
    b = Bucket(0, 2, 8, 5, 3, extras=(REF, ENERGY, SPEAKER), seq_lengths=(6,))
    assert b.shapes() == {
        "mel": (2, 8, 3),
        "mel_len": (2,),
        "tokens": (2, 5),
        "tok_len": (2,),
        "ref": (2, 6, 4),
        "ref_len": (2,),
        "energy": (2, 8),
        "speaker": (2,),
    }
    assert b.dtypes()["ref"] == "float32" and b.dtypes()["ref_len"] == "int32"
    assert b.as_wire() == [0, 2, 8, 5, 3, 6]
    layout = batch_layout(b)
    assert [k for k, *_ in layout] == list(b.shapes())
    assert all(offset % 64 == 0 for _, offset, _, _ in layout)
    assert b.nbytes() == sum(int(np.prod(s)) * np.dtype(b.dtypes()[k]).itemsize for k, s in b.shapes().items())
    with pytest.raises(ValueError, match="sequence"):
        Bucket(0, 2, 8, 5, 3, extras=(REF,))


def test_a_bucket_without_extras_is_unchanged() -> None:
    b = Bucket(1, 4, 16, 7, 80)
    assert list(b.shapes()) == ["mel", "mel_len", "tokens", "tok_len"] and b.as_wire() == [1, 4, 16, 7, 80]


def test_each_bucket_pads_a_sequence_to_its_longest_member() -> None:
    frames, tokens = np.array([10, 12, 40, 44]), np.array([3, 3, 9, 9])
    ref_lengths = np.array([5, 2, 30, 11])
    schema = ExtraSchema((SPEAKER, REF), {"ref": ref_lengths})
    bs = build_buckets(frames, tokens, 3, BucketConfig(boundaries=(16, 48), batch_size=2), schema)
    assert [b.seq_lengths for b in bs.buckets] == [(5,), (30,)]
    assert [b.shapes()["ref"] for b in bs.buckets] == [(2, 5, 4), (2, 30, 4)]
    plain = build_buckets(frames, tokens, 3, BucketConfig(boundaries=(16, 48), batch_size=2))
    assert [b.as_wire()[:5] for b in bs.buckets] == plain.as_wire()
