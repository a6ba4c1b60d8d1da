"""The reference assembly of a batch (``read_batch``) makes the producer's bytes, and empties a row it cannot read.

Oracle: the producer's ``BatchAssembler`` (one ``preadv`` per file into the row) on the same planned samples, in a
bucket that holds every row whole and in one shorter than most rows (cut mels, tokens and sequence extras), with
float32 and float16 mels: every array equal, byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from melfeed.producer.batcher import BatchAssembler
from melfeed.producer.reader import CacheReader
from melfeed.shared.cache.batch_read import read_batch
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import BucketConfig
from melfeed.shared.wire.buckets import Bucket, BucketSet, build_buckets

N_MELS = 8
_SAMPLES = ([0, 1, 2, 3], [4, 5], [5, 0, 3, 1])  # full, partial (padding rows), another order


@pytest.fixture
def manifest(tmp_path: Path) -> Manifest:
    """6 utterances with one extra of each kind (frame, utterance, sequence, token)."""
    root = tmp_path / "cache"
    demo = write_demo_cache(root, n_utterances=6, n_mels=N_MELS, extras=True)  # energy: frame, speaker: utterance
    for name in ("ref", "phon"):
        (root / "extras" / name).mkdir()
    for i, u in enumerate(demo.utterances):
        np.save(root / "extras" / "ref" / f"{u.id}.npy", np.arange(2 * (i + 1), dtype=np.float16).reshape(-1, 2) + 1)
        np.save(root / "extras" / "phon" / f"{u.id}.npy", np.arange(u.tokens, dtype=np.int16) * 3 - 7)
    full, problems = build_manifest(root, N_MELS, kinds={"ref": "sequence", "phon": "token"})
    assert problems == []
    return full


def _buckets(manifest: Manifest, mel_dtype: str) -> BucketSet:
    """Bucket 0 holds every row whole; bucket 1 (T=400, L=100, S=3) cuts mels, token rows and refs."""
    full = build_buckets(
        manifest.frames,
        manifest.token_counts,
        N_MELS,
        BucketConfig(num_buckets=1, batch_size=4),
        manifest.schema,
        mel_dtype=mel_dtype,
    )
    whole = full.buckets[0]
    short = Bucket(
        index=1,
        batch_size=4,
        max_frames=400,
        max_tokens=100,
        n_mels=N_MELS,
        extras=whole.extras,
        seq_lengths=(3,),
        mel_dtype=mel_dtype,
    )
    return BucketSet((whole, short), full.assignment, 0, 0, full.real_frames)


def _zeros(bucket: Bucket) -> dict[str, npt.NDArray[np.generic]]:
    dtypes = bucket.dtypes()
    return {key: np.zeros(shape, dtypes[key]) for key, shape in bucket.shapes().items()}


@pytest.mark.parametrize("mel_dtype", ["float32", "float16"])
def test_read_batch_makes_the_producers_bytes_in_every_array(manifest: Manifest, mel_dtype: str) -> None:
    buckets = _buckets(manifest, mel_dtype)
    assembler = BatchAssembler(CacheReader(manifest, mel_dtype=mel_dtype), buckets)
    try:
        for bucket in buckets.buckets:
            for ids in _SAMPLES:
                want = assembler.build(0, bucket.index, ids).arrays
                got = _zeros(bucket)
                assert read_batch(manifest, ids, got) == []
                assert list(got) == list(want)
                for key in want:
                    assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key
    finally:
        assembler.close()


def test_read_batch_leaves_a_row_it_cannot_read_empty_and_names_the_file(manifest: Manifest) -> None:
    bucket = _buckets(manifest, "float32").buckets[0]
    manifest.extra_path("phon", 1).unlink()
    got, whole = _zeros(bucket), _zeros(bucket)
    problems = read_batch(manifest, [0, 1, 2], got)
    assert (
        len(problems) == 1
        and problems[0].startswith("sample 1: ")
        and str(manifest.extra_path("phon", 1)) in problems[0]
    )
    assert all(not got[key][1].any() for key in got)  # every array of row 1: zeros
    read_batch(manifest, [0, 3, 2], whole)
    assert all(np.array_equal(got[key][[0, 2]], whole[key][[0, 2]]) for key in got)  # the other rows as read
    assert got["mel_len"][0] > 0 and got["mel_len"][2] > 0
