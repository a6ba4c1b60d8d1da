"""Tests for melfeed.producer.batcher.BatchAssembler: rows in place, quarantine and fail policies."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from melfeed.producer.batcher import BatchAssembler
from melfeed.producer.reader import CacheReader, TransientReadError
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.buckets import BucketSet, build_buckets


@pytest.fixture
def cache(tmp_path: Path) -> tuple[Manifest, BucketSet]:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6)
    buckets = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=4))
    return manifest, buckets


def _break(manifest: Manifest, i: int) -> Path:
    """NaN in utterance ``i``'s mel, same size: only reading the data finds it."""
    path = manifest.mel_path(i)
    mel = np.load(path)
    mel[1, 1] = np.nan
    np.save(path, mel)
    return path


def test_quarantine_leaves_the_bad_row_empty_and_names_the_file_once(
    cache: tuple[Manifest, BucketSet], caplog: pytest.LogCaptureFixture
) -> None:
    manifest, buckets = cache
    path = _break(manifest, 2)
    assembler = BatchAssembler(CacheReader(manifest), buckets)
    with caplog.at_level(logging.WARNING, logger="melfeed.producer.batcher"):
        batch = assembler.build(0, 0, [1, 2, 3])
        assert batch.quarantined == [2]
        mel_len = batch.arrays["mel_len"].copy()
        assert assembler.build(1, 0, [2]).quarantined == [2]
    assert list(mel_len) == [manifest.frames[1], 0, manifest.frames[3], 0]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(path) in warnings[0]  # rate-limited: once per sample


def test_quarantined_row_is_all_zeros_even_in_a_reused_buffer(cache: tuple[Manifest, BucketSet]) -> None:
    manifest, buckets = cache
    _break(manifest, 2)
    assembler = BatchAssembler(CacheReader(manifest), buckets, max_buffers=1)
    assembler.build(0, 0, [0, 1, 3, 4])  # fills the only buffer
    batch = assembler.build(1, 0, [2, 1])
    for key in ("mel", "tokens", "mel_len", "tok_len"):
        assert not batch.arrays[key][0].any() and not batch.arrays[key][2:].any()


def test_fail_policy_raises_naming_the_file(cache: tuple[Manifest, BucketSet]) -> None:
    manifest, buckets = cache
    path = _break(manifest, 2)
    assembler = BatchAssembler(CacheReader(manifest), buckets, bad_sample_policy="fail")
    with pytest.raises(CacheError) as info:
        assembler.build(0, 0, [1, 2])
    assert info.value.path == str(path) and "non-finite" in info.value.reason


def test_transient_errors_are_never_quarantined(
    cache: tuple[Manifest, BucketSet], monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest, buckets = cache
    reader = CacheReader(manifest)

    def out_of_fds(index: int, rows: object, row: int) -> int:
        raise TransientReadError("x.npy", "cannot open (Too many open files)")

    monkeypatch.setattr(reader, "read_mel_row", out_of_fds)
    with pytest.raises(TransientReadError):
        BatchAssembler(reader, buckets).build(0, 0, [1])


def test_read_time_accumulates_over_builds(cache: tuple[Manifest, BucketSet]) -> None:
    manifest, buckets = cache
    assembler = BatchAssembler(CacheReader(manifest), buckets)
    assert assembler.read_s_total == 0.0
    assembler.build(0, 0, [0, 1])
    first = assembler.read_s_total
    assembler.build(1, 0, [2, 3])
    assert 0.0 < first < assembler.read_s_total


def test_close_gives_back_the_kept_cache_files(cache: tuple[Manifest, BucketSet]) -> None:
    manifest, buckets = cache
    reader = CacheReader(manifest)
    assembler = BatchAssembler(reader, buckets)
    assembler.build(0, 0, [0, 1, 2, 3])
    assert len(reader._files) == 8  # mel + tokens of 4 rows, kept open between batches
    assembler.close()
    assembler.close()  # idempotent
    assert len(reader._files) == 0


def test_a_plan_learned_in_the_handshake_shapes_every_later_batch(cache: tuple[Manifest, BucketSet]) -> None:
    manifest, _ = cache
    assembler = BatchAssembler(CacheReader(manifest), None, max_buffers=1)  # no plan until the WELCOME
    with pytest.raises(ValueError, match="have 0"):
        assembler.build(0, 0, [0])
    cfg = BucketConfig(max_shapes=2, batch_size=2)  # a 2-D plan: each shape its own T and L
    short = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=2))
    longest = int(np.argmax(manifest.frames))
    narrow = tuple(dataclasses.replace(b, max_frames=8, max_tokens=2) for b in short.buckets)  # every row cut
    assembler.use_buckets(narrow)
    batch = assembler.build(1, 0, [longest])
    assert batch.arrays["mel"].shape == (2, 8, 80) and batch.arrays["tokens"].shape == (2, 2)
    planned = build_buckets(manifest.frames, manifest.token_counts, 80, cfg).buckets
    assembler.use_buckets(planned)  # another epoch's plan: longer rows than the last (the padding source grows)
    k = next(b.index for b in planned if b.max_frames >= manifest.frames[longest])
    batch = assembler.build(2, k, [longest])
    mel = batch.arrays["mel"]
    assert mel.shape == (2, planned[k].max_frames, 80) and batch.arrays["mel_len"][0] == manifest.frames[longest]
    assert np.array_equal(mel[0, : manifest.frames[longest]], np.load(manifest.mel_path(longest)))
    assert not mel[0, manifest.frames[longest] :].any() and not mel[1].any()


def test_rows_learned_in_the_handshake_shape_every_later_batch(cache: tuple[Manifest, BucketSet]) -> None:
    manifest, buckets = cache  # built with 4 rows per bucket
    assembler = BatchAssembler(CacheReader(manifest), buckets, max_buffers=1)
    assert assembler.build(0, 0, [0, 1]).arrays["mel"].shape[0] == 4
    assembler.use_rows([2])
    batch = assembler.build(1, 0, [2, 3])
    assert batch.arrays["mel"].shape[0] == batch.arrays["tokens"].shape[0] == batch.arrays["mel_len"].size == 2
    assert list(batch.arrays["mel_len"]) == [manifest.frames[2], manifest.frames[3]]
    with pytest.raises(ValueError, match="bucket holds 2"):
        assembler.build(2, 0, [0, 1, 2])
