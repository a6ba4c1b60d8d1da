"""Extras in a built batch: read into their rows, padded by kind, a bad extra file quarantines its row."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from melfeed.producer.batcher import BatchAssembler
from melfeed.producer.reader import CacheReader
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from melfeed.shared.wire.schema import pad_row


@pytest.fixture
def cache(tmp_path: Path) -> tuple[Manifest, BucketSet]:
    root = tmp_path / "cache"
    demo = write_demo_cache(root, n_utterances=6, n_mels=8, extras=True)
    (root / "extras" / "ref").mkdir()
    for i, u in enumerate(demo.utterances):
        np.save(root / "extras" / "ref" / f"{u.id}.npy", np.arange(2 * (i + 1), dtype=np.float16).reshape(-1, 2) + 1)
    manifest, problems = build_manifest(root, 8, kinds={"ref": "sequence"})
    assert problems == []
    return manifest, build_buckets(
        manifest.frames, manifest.token_counts, 8, BucketConfig(num_buckets=1, batch_size=4), manifest.schema
    )


def _want(manifest: Manifest, buckets: BucketSet, sid: int) -> dict[str, np.ndarray]:
    shapes, dtypes = buckets.buckets[0].shapes(), buckets.buckets[0].dtypes()
    out: dict[str, Any] = {}  # arrays, and the lengths as numpy scalars
    for spec in manifest.schema.extras:
        row = np.zeros(shapes[spec.name][1:], dtypes[spec.name])
        n = pad_row(spec, np.load(manifest.extra_path(spec.name, sid)), row)
        out[spec.name] = row
        if spec.length_key:
            out[spec.length_key] = np.int32(n)
    return out


def test_extras_are_padded_by_kind_in_every_row_and_a_reused_buffer_keeps_no_stale_bytes(
    cache: tuple[Manifest, BucketSet],
) -> None:
    manifest, buckets = cache
    assembler = BatchAssembler(CacheReader(manifest), buckets, max_buffers=1)
    assembler.build(0, 0, [5, 4, 3, 2]).attach(None)  # long sequences first, then the same buffer again
    batch = assembler.build(1, 0, [0, 1])
    for row, sid in enumerate([0, 1]):
        for key, value in _want(manifest, buckets, sid).items():
            assert batch.arrays[key][row].tobytes() == np.asarray(value).tobytes(), (sid, key)
    for key in ("energy", "speaker", "ref", "ref_len"):
        assert not batch.arrays[key][2:].any(), key  # padding rows are zeros


def test_a_bad_extra_file_quarantines_its_row_and_zeroes_every_extra(cache: tuple[Manifest, BucketSet]) -> None:
    manifest, buckets = cache
    path = manifest.extra_path("energy", 2)
    energy = np.load(path)
    energy[0] = np.inf
    np.save(path, energy)  # same size: only the value check finds it
    batch = BatchAssembler(CacheReader(manifest), buckets).build(0, 0, [1, 2, 3])
    assert batch.quarantined == [2]
    assert batch.arrays["mel_len"][1] == 0 and batch.arrays["ref_len"][1] == 0
    for key in ("energy", "speaker", "ref"):
        assert not batch.arrays[key][1].any(), key
    assert batch.arrays["ref_len"][2] == 4 and batch.arrays["ref"][2].any()
    with pytest.raises(CacheError, match="non-finite"):
        BatchAssembler(CacheReader(manifest), buckets, bad_sample_policy="fail").build(0, 0, [2])


def test_extras_share_the_producers_open_file_cache_and_a_second_epoch_opens_nothing(
    cache: tuple[Manifest, BucketSet],
) -> None:
    manifest, buckets = cache
    reader = CacheReader(manifest, open_files=64)
    assembler = BatchAssembler(reader, buckets, max_buffers=2)
    assembler.build(0, 0, [0, 1, 2, 3]).attach(None)
    opens = reader.open_files.opens
    assert opens == 4 * (2 + len(manifest.schema.extras))  # mel, tokens and every extra of 4 rows
    batch = assembler.build(1, 0, [0, 1, 2, 3])  # the same files again: all kept open
    assert reader.open_files.opens == opens
    for row, sid in enumerate([0, 1, 2, 3]):
        for key, value in _want(manifest, buckets, sid).items():
            assert batch.arrays[key][row].tobytes() == np.asarray(value).tobytes(), (sid, key)
    reader.close()
    assert len(reader.open_files) == 0


def test_a_float_extra_is_checked_once_per_file_and_again_once_replaced(
    cache: tuple[Manifest, BucketSet], monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest, buckets = cache
    checks: list[int] = []
    real_isfinite = np.isfinite

    def counted(values: np.ndarray, **kw: object) -> np.ndarray:
        if "out" not in kw:  # the mel reader's check passes out=; the extras' does not
            checks.append(values.size)
        return real_isfinite(values, **kw)  # type: ignore[no-any-return, call-overload]

    monkeypatch.setattr(np, "isfinite", counted)
    assembler = BatchAssembler(CacheReader(manifest, revalidate_s=0.0), buckets, max_buffers=1)
    assembler.build(0, 0, [2]).attach(None)
    first = len(checks)
    assert first == 2  # energy and ref (float); speaker is an integer
    assembler.build(1, 0, [2]).attach(None)
    assert len(checks) == first  # same files, same identities: not checked again
    path = manifest.extra_path("energy", 2)
    energy = np.load(path)
    energy[0] = np.nan
    np.save(str(path) + ".new.npy", energy)
    os.replace(str(path) + ".new.npy", path)  # replaced by a rename: another inode
    batch = assembler.build(2, 0, [2])
    assert batch.quarantined == [2] and len(checks) == first + 1
