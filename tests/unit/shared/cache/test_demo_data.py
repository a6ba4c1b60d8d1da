"""Tests for shared.cache.demo_data: determinism, LJSpeech-like shape, learnable text -> mel, reuse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.cache import demo_data
from shared.cache.demo_data import DEMO_MARKER, DEMO_VOCAB_SIZE, demo_utterance_id, write_demo_cache
from shared.errors import CacheError
from shared.cache.manifest import Manifest, load_manifest


@pytest.fixture(scope="module")
def demo200(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    return write_demo_cache(tmp_path_factory.mktemp("demo200"), 200, seed=7)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*.npy"))}


def test_same_params_give_byte_identical_files(tmp_path: Path) -> None:
    a = write_demo_cache(tmp_path / "a", 12, seed=3, n_mels=16)
    b = write_demo_cache(tmp_path / "b", 12, seed=3, n_mels=16)
    assert a.fingerprint == b.fingerprint
    files_a = _files(tmp_path / "a")
    assert len(files_a) == 24 and files_a == _files(tmp_path / "b")
    manifests = [(tmp_path / d / "manifest.json").read_bytes() for d in ("a", "b")]
    assert manifests[0] == manifests[1]


def test_different_seed_gives_different_data(tmp_path: Path) -> None:
    a = write_demo_cache(tmp_path / "a", 12, seed=3, n_mels=16)
    b = write_demo_cache(tmp_path / "b", 12, seed=4, n_mels=16)
    assert a.fingerprint != b.fingerprint


def test_ids_look_like_ljspeech(demo200: Manifest) -> None:
    assert demo200.utterances[0].id == "LJ001-0001"
    assert demo_utterance_id(299) == "LJ001-0300"
    assert demo_utterance_id(300) == "LJ002-0001"


def test_lengths_are_ljspeech_like(demo200: Manifest) -> None:
    frames, tokens = demo200.frames, demo200.token_counts
    assert len(demo200) == 200
    assert frames.min() >= 100 and frames.max() <= 870
    assert tokens.min() >= 20 and tokens.max() <= 190
    assert 500 <= frames.mean() <= 640
    assert frames.std() > 100  # a spread of lengths, so bucketing has work to do
    ratio = frames / tokens
    assert 4.0 <= np.median(ratio) <= 5.0
    assert np.corrcoef(frames, tokens)[0, 1] > 0.9


def test_files_have_promised_dtypes_and_value_shape(demo200: Manifest) -> None:
    for i in (0, 57, 199):
        mel = np.load(demo200.mel_path(i))
        tok = np.load(demo200.tokens_path(i))
        assert mel.dtype == np.float32 and mel.shape == (demo200.frames[i], 80)
        assert tok.dtype == np.int32 and tok.shape == (demo200.token_counts[i],)
        assert tok.min() >= 1 and tok.max() < DEMO_VOCAB_SIZE
        assert mel.min() >= -11.5 and mel.max() <= 2.0
        spectrum = mel.mean(axis=0)
        assert spectrum[:10].mean() > spectrum[-10:].mean() + 2.0  # low bins louder
        bin_step = np.abs(np.diff(mel, axis=1)).mean()
        assert bin_step < 0.5 * mel.std()  # smooth across bins (noise aside)


def _token_spectra(manifest: Manifest, indices: range) -> np.ndarray:
    """Mean mel of the frames showing each token id, float64 [V, n_mels]."""
    sums = np.zeros((DEMO_VOCAB_SIZE, manifest.n_mels))
    counts = np.zeros(DEMO_VOCAB_SIZE)
    for i in indices:
        mel, tok = np.load(manifest.mel_path(i)), np.load(manifest.tokens_path(i))
        shown = tok[np.arange(len(mel)) * len(tok) // len(mel)]
        np.add.at(sums, shown, mel)
        np.add.at(counts, shown, 1)
    return sums / np.maximum(counts, 1)[:, None]


def test_mels_are_predictable_from_tokens(demo200: Manifest) -> None:
    """Spectra learned from half the utterances predict the other half's mels well."""
    learned = _token_spectra(demo200, range(0, 100))
    errors, spreads = [], []
    for i in range(100, 110):
        mel, tok = np.load(demo200.mel_path(i)), np.load(demo200.tokens_path(i))
        predicted = learned[tok[np.arange(len(mel)) * len(tok) // len(mel)]]
        errors.append(np.mean((mel - predicted) ** 2))
        spreads.append(np.mean((mel - mel.mean(axis=0)) ** 2))
    assert np.mean(errors) < 0.5 * np.mean(spreads)


def test_second_call_reuses_cache_without_writing(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    first = write_demo_cache(tmp_path, 10, n_mels=16)

    def _fail(*args: object) -> None:
        raise AssertionError("regenerated instead of reusing")

    monkeypatch.setattr(demo_data, "_utterance", _fail)
    again = write_demo_cache(tmp_path, 10, n_mels=16)
    assert again == first
    assert json.loads((tmp_path / DEMO_MARKER).read_text())["n_utterances"] == 10


def test_changed_params_rewrite_and_drop_stale_files(tmp_path: Path) -> None:
    write_demo_cache(tmp_path, 10, n_mels=16)
    smaller = write_demo_cache(tmp_path, 4, n_mels=16)
    assert len(smaller) == 4
    assert len(list((tmp_path / "mels").glob("*.npy"))) == 4
    assert load_manifest(tmp_path, 16) == smaller


def test_broken_manifest_triggers_rewrite(tmp_path: Path) -> None:
    first = write_demo_cache(tmp_path, 5, n_mels=16)
    (tmp_path / "manifest.json").write_text("{}")
    assert write_demo_cache(tmp_path, 5, n_mels=16) == first


def test_refuses_to_write_over_a_real_cache(tmp_path: Path) -> None:
    (tmp_path / "mels").mkdir()
    np.save(tmp_path / "mels" / "real-0001.npy", np.zeros((3, 16), np.float32))
    with pytest.raises(CacheError, match="not a demo cache"):
        write_demo_cache(tmp_path, 5, n_mels=16)
    assert (tmp_path / "mels" / "real-0001.npy").exists()


def test_rejects_nonsense_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_demo_cache(tmp_path, 0)


def test_a_second_writer_waits_for_the_first_and_gives_up_after_its_bound(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl
    import os
    root = tmp_path / "demo"
    fd = os.open(tmp_path / ".demo.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)                    # another writer holds the cache
    monkeypatch.setattr(demo_data, "_LOCK_WAIT_S", 0.3)
    try:
        with pytest.raises(CacheError, match="another process has been writing this demo cache"):
            write_demo_cache(root, n_utterances=3)
        assert not root.exists()                      # nothing written while the other writer held it
    finally:
        os.close(fd)
    assert len(write_demo_cache(root, n_utterances=3).utterances) == 3    # the lock is free again

