"""Unit tests for shared/wire/buckets.py: optimal boundaries, overlong handling, sizing, efficiency."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import (
    Bucket,
    BucketSet,
    apply_rows,
    build_buckets,
    derive_boundaries,
    learns_rows,
    one_row_settings,
)
from melfeed.shared.wire.layout import ALIGN_BYTES, batch_layout, layout_nbytes
from melfeed.shared.wire.messages import LEARN_ROWS


def _padded_cost(frames: list[int], bounds: tuple[int, ...]) -> int:
    """Sum of the bound each utterance lands in; overlong ones land in the last bucket."""
    return sum(next((b for b in bounds if b >= f), bounds[-1]) for f in frames)


def _brute_force_cost(frames: list[int], num_buckets: int, multiple: int, max_frames: int) -> int:
    """Best cost over every set of <= num_buckets multiples whose last is max_frames rounded up."""
    top = -(-max_frames // multiple) * multiple
    below = range(multiple, top, multiple)
    f = np.minimum(np.asarray(frames), top)
    best = len(frames) * top
    for k in range(num_buckets):
        chosen_lists = list(itertools.combinations(below, k))
        if not chosen_lists:  # fewer candidates than k
            break
        combos = np.array(chosen_lists, dtype=np.int64).reshape(len(chosen_lists), k)
        bounds = np.concatenate([combos, np.full((combos.shape[0], 1), top)], axis=1)
        fits = bounds[:, :, None] >= f[None, None, :]  # [combo, bucket, utterance]
        chosen = np.take_along_axis(bounds, fits.argmax(axis=1), axis=1)  # first bound that fits
        best = min(best, int(chosen.sum(axis=1).min()))
    return best


@settings(max_examples=120, deadline=None)
@given(
    frames=st.lists(st.integers(0, 40), min_size=1, max_size=25),
    num_buckets=st.integers(1, 4),
    multiple=st.sampled_from([1, 3, 8]),
    extra=st.integers(-10, 10),
)
def test_derive_boundaries_matches_brute_force_optimum(
    frames: list[int], num_buckets: int, multiple: int, extra: int
) -> None:
    max_frames = max(1, max(frames) + extra)  # sometimes below the longest: overlong utterances
    bounds = derive_boundaries(np.array(frames), num_buckets, multiple, max_frames)
    assert 1 <= len(bounds) <= num_buckets
    assert list(bounds) == sorted(set(bounds))
    assert all(b % multiple == 0 for b in bounds)
    assert bounds[-1] == -(-max_frames // multiple) * multiple
    assert _padded_cost(frames, bounds) == _brute_force_cost(frames, num_buckets, multiple, max_frames)


def test_derive_boundaries_returns_fewer_when_few_distinct_lengths() -> None:
    assert derive_boundaries(np.array([10, 10, 10]), 4, 8, 10) == (16,)
    assert derive_boundaries(np.array([3, 20, 20, 5]), 4, 8, 20) == (8, 24)
    assert derive_boundaries(np.array([3]), 4, 8, 40) == (8, 40)  # last bound is forced


def test_derive_boundaries_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        derive_boundaries(np.array([1.5, 2.0]), 2, 8, 10)
    with pytest.raises(ValueError):
        derive_boundaries(np.array([-1, 2]), 2, 8, 10)
    with pytest.raises(ValueError):
        derive_boundaries(np.array([1, 2]), 0, 8, 10)


def test_configured_boundaries_are_rounded_and_assign_first_fitting_bucket() -> None:
    cfg = BucketConfig(boundaries=(10, 20, 30), frame_multiple=8, batch_size=2)
    bs = build_buckets(np.array([1, 16, 17, 24, 32]), np.array([3, 4, 5, 6, 7]), 80, cfg)
    assert [b.max_frames for b in bs.buckets] == [16, 24, 32]
    assert bs.assignment.tolist() == [0, 0, 1, 1, 2]
    assert [b.max_tokens for b in bs.buckets] == [4, 6, 7]
    assert (bs.truncated, bs.dropped) == (0, 0)


def test_empty_buckets_are_removed_and_renumbered() -> None:
    cfg = BucketConfig(boundaries=(8, 16, 24, 32), batch_size=4)
    bs = build_buckets(np.array([5, 30, 31]), np.array([0, 2, 3]), 80, cfg)
    assert bs.as_wire() == [[0, 4, 8, 1, 80], [1, 4, 32, 3, 80]]  # max_tokens is at least 1
    assert bs.assignment.tolist() == [0, 1, 1]


def test_truncate_counts_overlong_frames_and_tokens_once_and_keeps_them() -> None:
    cfg = BucketConfig(boundaries=(16, 32), max_tokens=10, overlong="truncate")
    bs = build_buckets(np.array([10, 40, 20, 50]), np.array([5, 5, 11, 12]), 80, cfg)
    assert bs.truncated == 3 and bs.dropped == 0
    assert bs.assignment.tolist() == [0, 1, 1, 1]  # frames-overlong goes to the largest bucket
    assert all(b.max_tokens == 10 for b in bs.buckets)


def test_drop_marks_overlong_frames_and_tokens_minus_one() -> None:
    cfg = BucketConfig(boundaries=(16, 32), max_tokens=10, overlong="drop")
    bs = build_buckets(np.array([10, 40, 20, 30]), np.array([5, 5, 11, 4]), 80, cfg)
    assert bs.dropped == 2 and bs.truncated == 0
    assert bs.assignment.tolist() == [0, -1, -1, 1]


def test_max_frames_caps_derived_bucket_and_drops_longer() -> None:
    cfg = BucketConfig(max_frames=20, overlong="drop", num_buckets=2)
    bs = build_buckets(np.array([5, 18, 23, 100]), np.array([1, 1, 1, 1]), 80, cfg)
    assert bs.buckets[-1].max_frames == 24  # 20 rounded up to 8; 23 still fits, 100 does not
    assert bs.dropped == 1 and bs.assignment.tolist()[3] == -1


def test_dropping_everything_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        build_buckets(np.array([100, 200]), np.array([1, 1]), 80, BucketConfig(max_frames=5, overlong="drop"))
    assert info.value.path == ("buckets", "max_frames") and "drops every utterance" in str(info.value)
    with pytest.raises(ConfigError) as info:
        build_buckets(np.array([10, 20]), np.array([9, 9]), 80, BucketConfig(max_tokens=5, overlong="drop"))
    assert info.value.path == ("buckets", "max_tokens")


def test_frame_budget_sets_rows_per_bucket() -> None:
    cfg = BucketConfig(boundaries=(100, 400, 3000), frame_multiple=100, batch_size=None, frame_budget=1000)
    bs = build_buckets(np.array([50, 350, 2500]), np.array([1, 2, 3]), 80, cfg)
    assert [b.batch_size for b in bs.buckets] == [10, 2, 1]  # 1000 // 3000 would be 0


def test_padding_efficiency_hand_computed() -> None:
    # B=2. Bucket T=10 holds 5 and 10: one full batch, 2 * 10 = 20 padded frames. Bucket T=20 holds
    # 15, 25 (truncated to 20) and 12: two batches, the partial one counted full, 2 * 2 * 20 = 80.
    # Real frames 5 + 10 + 15 + 20 + 12 = 62, so efficiency = 62 / 100.
    cfg = BucketConfig(boundaries=(10, 20), frame_multiple=1, batch_size=2)
    bs = build_buckets(np.array([5, 10, 15, 25, 12]), np.array([1, 1, 1, 1, 1]), 80, cfg)
    assert bs.assignment.tolist() == [0, 0, 1, 1, 1] and bs.truncated == 1
    assert bs.real_frames == 5 + 10 + 15 + 20 + 12
    assert bs.padding_efficiency() == pytest.approx(62 / (20 + 80))


def test_bucket_shapes_dtypes_bytes_and_wire() -> None:
    b = Bucket(index=1, batch_size=4, max_frames=16, max_tokens=7, n_mels=80)
    assert b.shapes() == {"mel": (4, 16, 80), "mel_len": (4,), "tokens": (4, 7), "tok_len": (4,)}
    assert b.dtypes() == {"mel": "float32", "mel_len": "int32", "tokens": "int32", "tok_len": "int32"}
    assert b.nbytes() == 4 * (4 * 16 * 80 + 4 + 4 * 7 + 4)
    assert b.as_wire() == [1, 4, 16, 7, 80]
    small = Bucket(index=0, batch_size=4, max_frames=8, max_tokens=7, n_mels=80)
    bs = BucketSet(buckets=(small, b), assignment=np.array([0, 1, -1]), truncated=0, dropped=1, real_frames=20)
    assert bs.max_batch_nbytes() == b.nbytes() and bs.as_wire() == [small.as_wire(), b.as_wire()]
    with pytest.raises(ValueError):
        bs.assignment[0] = 1  # read-only: a BucketSet never changes after it is built
    with pytest.raises(ValueError):
        BucketSet(buckets=(b,), assignment=np.array([0]), truncated=0, dropped=0, real_frames=1)


@settings(max_examples=80, deadline=None)
@given(
    frames=st.lists(st.integers(0, 300), min_size=1, max_size=60),
    data=st.data(),
    num_buckets=st.integers(1, 6),
    multiple=st.sampled_from([1, 8, 16]),
    overlong=st.sampled_from(["truncate", "drop"]),
    max_frames=st.none() | st.integers(50, 300),
)
def test_build_buckets_invariants(
    frames: list[int], data: st.DataObject, num_buckets: int, multiple: int, overlong: str, max_frames: int | None
) -> None:
    tokens = data.draw(st.lists(st.integers(0, 50), min_size=len(frames), max_size=len(frames)))
    cfg = BucketConfig(
        num_buckets=num_buckets,
        frame_multiple=multiple,
        overlong=overlong,
        max_frames=max_frames,
        max_tokens=data.draw(st.none() | st.integers(20, 50)),
    )
    try:
        bs = build_buckets(np.array(frames), np.array(tokens), 80, cfg)
    except ConfigError:
        assert overlong == "drop"
        return
    sizes = [b.max_frames for b in bs.buckets]
    assert sizes == sorted(set(sizes)) and all(t % multiple == 0 for t in sizes)
    assert 1 <= len(bs.buckets) <= num_buckets
    assert set(bs.assignment.tolist()) - {-1} == set(range(len(bs.buckets)))  # none empty
    fitting = 0
    for f, t, a in zip(frames, tokens, bs.assignment.tolist()):
        if a < 0:
            continue
        first = next((k for k, s in enumerate(sizes) if s >= f), len(sizes) - 1)
        assert a == first or (f > sizes[-1] and a == len(sizes) - 1)
        fitting += f <= sizes[a] and t <= bs.buckets[a].max_tokens
    assert bs.truncated + bs.dropped == len(frames) - fitting
    assert 0 <= bs.padding_efficiency() <= 1
    assert (bs.padding_efficiency() > 0) == (bs.real_frames > 0)


def test_a_float16_mel_halves_the_mel_bytes_and_keeps_every_array_64_byte_aligned() -> None:
    wide = Bucket(index=0, batch_size=3, max_frames=7, max_tokens=5, n_mels=3)
    half = Bucket(index=0, batch_size=3, max_frames=7, max_tokens=5, n_mels=3, mel_dtype="float16")
    assert half.dtypes() == {**wide.dtypes(), "mel": "float16"} and half.shapes() == wide.shapes()
    assert wide.nbytes() - half.nbytes() == 3 * 7 * 3 * 2  # half the mel's bytes, nothing else
    layout = batch_layout(half)  # 126 mel bytes: the next array is padded
    assert [(k, str(d)) for k, _, _, d in layout][0] == ("mel", "float16")
    assert all(offset % ALIGN_BYTES == 0 for _, offset, _, _ in layout)
    assert layout_nbytes(half) < layout_nbytes(wide) and half.as_wire() == wide.as_wire()  # HELLO says the dtype
    with pytest.raises(ValueError, match="mel_dtype"):
        Bucket(index=0, batch_size=3, max_frames=7, max_tokens=5, n_mels=3, mel_dtype="float64")
    cfg = BucketConfig(boundaries=(16, 32), batch_size=2)
    plain = build_buckets(np.array([10, 30]), np.array([3, 4]), 80, cfg)
    halves = build_buckets(np.array([10, 30]), np.array([3, 4]), 80, cfg, mel_dtype="float16")
    assert [b.mel_dtype for b in halves.buckets] == ["float16"] * 2 and halves.as_wire() == plain.as_wire()
    assert halves.max_batch_nbytes() == plain.max_batch_nbytes() - 2 * 32 * 80 * 2


@pytest.mark.parametrize(
    "auto",
    [BucketConfig(batch_size="auto", num_buckets=3), BucketConfig(batch_size="auto", max_shapes=3)],
    ids=["1-D", "2-D"],
)
def test_a_producer_learning_its_rows_plans_the_consumers_shapes_and_takes_its_rows(auto: BucketConfig) -> None:
    rng = np.random.default_rng(3)
    frames = rng.integers(40, 900, 400)
    tokens = np.maximum(1, frames // 8 + rng.integers(-5, 5, 400))
    shapes = build_buckets(frames, tokens, 80, one_row_settings(auto))
    rows = tuple(4 * (k + 1) for k in range(len(shapes.buckets)))
    given_rows = dataclasses.replace(auto, rows=rows)  # what the consumer plans with once it measured them
    assert learns_rows(auto) and not learns_rows(given_rows)
    consumers = build_buckets(frames, tokens, 80, given_rows)
    assert [[w[0], *w[2:]] for w in shapes.as_wire(learn_rows=True)] == [[w[0], *w[2:]] for w in consumers.as_wire()]
    assert {w[1] for w in shapes.as_wire(learn_rows=True)} == {LEARN_ROWS}
    assert np.array_equal(shapes.assignment, consumers.assignment)
    assert [b.as_wire() for b in apply_rows(shapes.buckets, rows)] == consumers.as_wire()
    with pytest.raises(ValueError, match="one row count per bucket"):
        apply_rows(shapes.buckets, rows[:-1])
    with pytest.raises(ConfigError, match="producers learn them when they join"):
        build_buckets(frames, tokens, 80, auto)  # a command that neither measures nor joins needs the rows
