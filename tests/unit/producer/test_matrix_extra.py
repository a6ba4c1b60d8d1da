"""A matrix extra ([tokens, ceil(frames / r)] per utterance): index adopts it, producers pad it into [B, L, ceil(T /
r)]."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from melfeed import cli as run_pipeline
from melfeed.producer.batcher import BatchAssembler
from melfeed.producer.reader import CacheReader
from melfeed.shared.cache.batch_read import read_batch
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest, load_manifest, write_manifest
from melfeed.shared.cache.pack_write import write_pack
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.buckets import build_buckets
from tests.attention_data import R as _R
from tests.attention_data import write_attention


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A 6-utterance cache (8 mels) with ``extras/attn``: guided-attention matrices, [tokens, ceil(frames / 3)]."""
    root = tmp_path / "cache"
    demo = write_demo_cache(root, n_utterances=6, n_mels=8)
    write_attention(root / "extras" / "attn", {u.id: (u.tokens, u.frames) for u in demo.utterances})
    return root


def _manifest(root: Path) -> Manifest:
    manifest, problems = build_manifest(root, 8, kinds={"attn": f"matrix/{_R}"})
    assert problems == []
    write_manifest(manifest)
    return load_manifest(root, 8)  # the declaration as the manifest holds it


def test_index_says_in_one_line_that_the_files_fit_no_kind_and_which_declaration_fits(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CacheError) as err:
        build_manifest(root, 8)
    text = str(err.value)
    assert "\n" not in text and "has two ragged axes" in text and f"--extra attn:matrix/{_R}=DIR" in text, text
    assert run_pipeline.main(["index", "--cache-dir", str(root), "--n-mels", "8"]) != 0
    captured = capsys.readouterr()
    assert "bad:" not in captured.err and captured.err.count("two ragged axes") == 1, captured.err


def test_index_declares_a_matrix_with_its_divisor_and_a_reindex_keeps_it(root: Path) -> None:
    manifest = _manifest(root)
    (column,) = manifest.extras
    assert (column.spec.kind, column.spec.divisor, column.spec.dtype, column.spec.shape) == (
        "matrix",
        _R,
        "float16",
        (),
    )
    assert column.rows[:, 0].tolist() == manifest.token_counts.tolist()  # length = the tokens
    again, problems = build_manifest(root, 8)  # no --extra: the manifest's kind
    assert problems == [] and again.extras[0].spec == column.spec and again.fingerprint == manifest.fingerprint
    assert run_pipeline.main(["verify-cache", "--cache-dir", str(root), "--n-mels", "8"]) == 0
    with pytest.raises(CacheError, match="extra 'attn' is a matrix, which a pack does not hold"):
        write_pack(manifest, "float32")


def test_producers_pad_a_matrix_into_tokens_by_ceil_frames_over_r_with_zeros_and_cut_both_axes(root: Path) -> None:
    manifest = _manifest(root)
    longest = int(manifest.frames.max())
    cut_frames = int(np.sort(manifest.frames)[-2]) // _R * _R  # the longest utterance is cut
    buckets = build_buckets(
        manifest.frames,
        manifest.token_counts,
        8,
        BucketConfig(num_buckets=1, batch_size=8, max_frames=cut_frames, frame_multiple=_R),
        manifest.schema,
    )
    bucket = buckets.buckets[0]
    assert cut_frames < longest and bucket.max_frames == cut_frames
    assert bucket.shapes()["attn"] == (8, bucket.max_tokens, -(-cut_frames // _R))
    ids = list(range(len(manifest)))
    built = BatchAssembler(CacheReader(manifest), buckets).build(0, 0, ids).arrays["attn"]
    oracle = {k: np.zeros(s, bucket.dtypes()[k]) for k, s in bucket.shapes().items()}
    assert read_batch(manifest, ids, oracle) == []
    assert built.tobytes() == oracle["attn"].tobytes()
    for row, sid in enumerate(ids):
        values = np.load(manifest.extra_path("attn", sid))
        tokens, cols = values.shape[0], min(values.shape[1], built.shape[2])
        assert np.array_equal(built[row, :tokens, :cols], values[:, :cols]), sid
        assert not built[row, tokens:].any() and not built[row, :, cols:].any(), sid  # zeros after both axes
    assert not built[len(ids) :].any()  # padding rows
