"""Tests for melfeed.shared.cache.features: the log-mel against an independent NumPy implementation of its written
definition, frame counts, the resampler's accuracy, and the feature checks a cache imposes on a config.

Tolerance of the mel comparison (TensorFlow computes in float32, the reference in float64):
|mel_tf - mel_ref| <= 2e-5 x the clip's largest mel value everywhere, and |logmel_tf - logmel_ref|
<= 1e-3 wherever the mel is within 30 dB (1e-3) of that largest value. Measured: 5.5e-6 and 1.3e-4.
Far below that, float32 FFT leakage (~1e-7 of the peak) is above ``log_floor`` for pure tones, so
log values of near-silent bins can differ by up to ~0.7; those bins are checked only linearly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from melfeed.producer.prepare.dsp import LogMel, frame_count, resample
from melfeed.shared.cache.features import feature_params, load_manifest_for, write_feature_record
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest, Utterance, load_manifest, write_manifest
from melfeed.shared.cache.text import VOCABULARY
from melfeed.shared.config import FeatureConfig, PipelineConfig
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import CacheError, ConfigError

_LINEAR_TOL = 2e-5  # x the clip's largest mel value
_LOG_TOL = 1e-3  # where the mel is within 30 dB of the largest
_RESAMPLE_TOL = 5e-5  # of full scale, sines up to 0.8 x the lower Nyquist, edges excluded


def _reference_logmel(x: np.ndarray, f: FeatureConfig, n_mels: int) -> np.ndarray:
    """The module docstring's definition, written from it with NumPy only (float64)."""
    pad = f.win_samples // 2
    padded = np.pad(x.astype(np.float64), pad, mode="reflect")
    n_frames = 1 + (padded.shape[0] - f.win_samples) // f.hop_samples
    index = np.arange(n_frames)[:, None] * f.hop_samples + np.arange(f.win_samples)[None, :]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(f.win_samples) / f.win_samples)
    spectrum = np.abs(np.fft.rfft(padded[index] * window, n=f.n_fft)) ** f.power

    def mel(hz: np.ndarray | float) -> np.ndarray:
        return 1127.0 * np.log1p(np.asarray(hz) / 700.0)

    bins = mel(np.arange(f.n_fft // 2 + 1) * f.sample_rate_hz / f.n_fft)[:, None]
    edges = np.linspace(mel(f.fmin_hz), mel(f.top_hz), n_mels + 2)
    rising = (bins - edges[:-2]) / (edges[1:-1] - edges[:-2])
    falling = (edges[2:] - bins) / (edges[2:] - edges[1:-1])
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights[0] = 0.0  # DC
    log_mel: npt.NDArray[Any] = np.log(np.maximum(spectrum @ weights, f.log_floor))
    return log_mel


def _signals(rate: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    t = np.arange(int(1.3 * rate)) / rate
    return {
        "noise": np.asarray(rng.normal(0.0, 0.3, t.shape[0])),
        "tone": np.asarray(0.5 * np.sin(2 * np.pi * 440 * t)),
        "chirp": np.asarray(0.5 * np.sin(2 * np.pi * (100 * t + 2000 * t * t))),
        "quiet noise": np.asarray(rng.normal(0.0, 1e-3, t.shape[0])),
    }


@pytest.mark.tf  # LogMel runs on TensorFlow
@pytest.mark.parametrize(
    ("features", "n_mels"),
    [
        (FeatureConfig(), 80),
        (
            FeatureConfig(
                sample_rate_hz=16000,
                n_fft=512,
                hop_samples=160,
                win_samples=400,
                fmin_hz=50.0,
                fmax_hz=None,
                power=2.0,
                log_floor=1e-6,
            ),
            40,
        ),
    ],
    ids=["default", "16k-short-window-power"],
)
def test_logmel_matches_the_numpy_definition(features: FeatureConfig, n_mels: int) -> None:
    logmel = LogMel(features, n_mels)
    for name, x in _signals(features.sample_rate_hz, np.random.default_rng(0)).items():
        got, want = logmel(x).astype(np.float64), _reference_logmel(x, features, n_mels)
        assert got.shape == want.shape == (frame_count(x.shape[0], features), n_mels), name
        peak = np.exp(want).max()
        assert np.abs(np.exp(got) - np.exp(want)).max() <= _LINEAR_TOL * peak, name
        loud = np.exp(want) >= 1e-3 * peak
        assert np.abs(got - want)[loud].max() <= _LOG_TOL, name


@pytest.mark.tf
@pytest.mark.parametrize("n", [513, 1000, 22050, 22050 + 255, 22050 + 256])
def test_frames_are_one_plus_samples_over_hop_and_one_program_serves_all(n: int) -> None:
    f = FeatureConfig()
    logmel = _shared_logmel()
    assert frame_count(n, f) == 1 + n // 256
    assert logmel(np.zeros(n)).shape == (1 + n // 256, 80)
    assert logmel._compiled.experimental_get_tracing_count() == 1  # no retracing per length


@pytest.mark.tf
def test_clip_too_short_to_pad_is_refused() -> None:
    assert frame_count(512, FeatureConfig()) == 0
    with pytest.raises(ValueError, match="too short"):
        _shared_logmel()(np.zeros(512))


@pytest.mark.tf
def test_silence_reads_the_log_floor() -> None:
    mel = _shared_logmel()(np.zeros(4000))
    np.testing.assert_allclose(mel, np.log(1e-5), rtol=0, atol=2e-6)  # float32 log of float32(1e-5)


_LOGMEL: list[LogMel] = []


def _shared_logmel() -> LogMel:
    if not _LOGMEL:
        _LOGMEL.append(LogMel(FeatureConfig(), 80))
    return _LOGMEL[0]


@pytest.mark.parametrize(("src", "dst"), [(16000, 22050), (44100, 22050), (48000, 22050), (8000, 22050)])
def test_resampled_sines_match_the_exact_signal(src: int, dst: int) -> None:
    nyquist = min(src, dst) / 2
    for freq in (100.0, 440.0, 0.5 * nyquist, 0.8 * nyquist):
        x = np.sin(2 * np.pi * freq * np.arange(src) / src)
        y = resample(x, src, dst)
        assert y.shape == (dst,)
        exact = np.sin(2 * np.pi * freq * np.arange(dst) / dst)
        edge = int(0.04 * dst)
        assert np.abs(y - exact)[edge:-edge].max() <= _RESAMPLE_TOL, (src, dst, freq)


def test_resample_lengths_and_identity() -> None:
    x = np.random.default_rng(1).normal(size=1001)
    assert resample(x, 22050, 22050) is not None and np.array_equal(resample(x, 22050, 22050), x)
    assert resample(x, 16000, 22050).shape == (int(np.ceil(1001 * 22050 / 16000)),)
    assert resample(x, 44100, 22050).shape == (501,)
    np.testing.assert_array_equal(resample(x, 16000, 22050), resample(x.copy(), 16000, 22050))


# ---- what a cache's recorded features impose on a config -------------------------------------


def _prepared_cache(root: Path, features: dict[str, Any] | None = None) -> Path:
    (root / "mels").mkdir(parents=True)
    (root / "tokens").mkdir()
    np.save(root / "mels" / "a.npy", np.zeros((5, 80), np.float32))
    np.save(root / "tokens" / "a.npy", np.arange(1, 4, dtype=np.int32))
    params = features if features is not None else feature_params(FeatureConfig(), 80)
    write_feature_record(root, params, VOCABULARY, {"selection": {}})
    write_manifest(build_manifest(root, 80)[0])
    return root


def test_prepared_cache_loads_for_the_same_config(tmp_path: Path) -> None:
    cache = _prepared_cache(tmp_path / "c")
    manifest = load_manifest_for(config_from_mapping({"cache_dir": str(cache)}))
    assert dict(manifest.features or ())["hop_samples"] == 256
    assert manifest.vocabulary == VOCABULARY
    doc = json.loads((cache / "manifest.json").read_text())
    assert doc["features"] == feature_params(FeatureConfig(), 80) and doc["vocabulary"] == list(VOCABULARY)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            {"features": {"hop_samples": 275}},
            "features.hop_samples: cache {m} was prepared with 256, this config has 275",
        ),
        (
            {"features": {"fmax_hz": None}},
            "features.fmax_hz: cache {m} was prepared with 8000.0, this config has 11025.0",
        ),
        (
            {"features": {"log_floor": 1e-4}},
            "features.log_floor: cache {m} was prepared with 1e-05, this config has 0.0001",
        ),
        ({"model": {"vocab_size": 40}}, "model.vocab_size: must be >= 49, the size of the vocabulary of {m}, got 40"),
    ],
)
def test_a_config_that_differs_from_the_cache_is_refused_naming_the_key(
    tmp_path: Path, overrides: dict[str, Any], line: str
) -> None:
    cache = _prepared_cache(tmp_path / "c")
    with pytest.raises(ConfigError) as info:
        load_manifest_for(config_from_mapping({"cache_dir": str(cache), **overrides}))
    assert str(info.value) == line.format(m=cache / "manifest.json")


def test_recorded_definition_from_another_version_is_refused(tmp_path: Path) -> None:
    cache = _prepared_cache(tmp_path / "c", {**feature_params(FeatureConfig(), 80), "definition": "old/0"})
    with pytest.raises(ConfigError, match="features.definition: cache .* was prepared with 'old/0'"):
        load_manifest_for(PipelineConfig(cache_dir=str(cache)))


def test_cache_without_recorded_features_is_not_checked_and_keeps_its_fingerprint(tmp_path: Path) -> None:
    rows = (
        Utterance("LJ001-0001", 120, 30, "float32", 128, 128 + 120 * 80 * 4, 128, 128 + 120),
        Utterance("LJ001-0002", 7, 2, "float16", 128, 128 + 7 * 80 * 2, 128, 136),
    )
    assert (
        Manifest(tmp_path, 80, rows).fingerprint == "7bfabcf7e5f8adf0"
    )  # no features: the fingerprint of the rows alone
    described = Manifest(tmp_path, 80, rows, tuple(feature_params(FeatureConfig(), 80).items()), VOCABULARY)
    assert described.fingerprint != "7bfabcf7e5f8adf0"
    other = Manifest(tmp_path, 80, rows, tuple(feature_params(FeatureConfig(hop_samples=200), 80).items()), VOCABULARY)
    assert other.fingerprint != described.fingerprint
    (tmp_path / "mels").mkdir()
    (tmp_path / "tokens").mkdir()
    np.save(tmp_path / "mels" / "a.npy", np.zeros((5, 80), np.float32))
    np.save(tmp_path / "tokens" / "a.npy", np.arange(1, 4, dtype=np.int32))
    write_manifest(build_manifest(tmp_path, 80)[0])
    odd = config_from_mapping({"cache_dir": str(tmp_path), "features": {"hop_samples": 1}, "model": {"vocab_size": 4}})
    assert load_manifest_for(odd).features is None


def test_edited_features_in_the_manifest_break_its_fingerprint(tmp_path: Path) -> None:
    cache = _prepared_cache(tmp_path / "c")
    path = cache / "manifest.json"
    doc = json.loads(path.read_text())
    doc["features"]["hop_samples"] = 275
    path.write_text(json.dumps(doc))
    with pytest.raises(CacheError, match="fingerprint mismatch"):
        load_manifest(cache)
    doc["features"] = {"hop_samples": True}
    path.write_text(json.dumps(doc))
    with pytest.raises(CacheError, match="malformed features"):
        load_manifest(cache)


def test_index_refuses_a_feature_record_with_other_n_mels(tmp_path: Path) -> None:
    cache = _prepared_cache(tmp_path / "c")
    with pytest.raises(CacheError, match="prepared with n_mels=80, indexing with n_mels=40"):
        build_manifest(cache, 40)


# ---- token ids against the running model's vocabulary (index's token_range) ----------------------


def _adopted_cache(root: Path, tokens: dict[str, list[int]]) -> Path:
    """A user's own cache, as ``index`` adopts it: no features.json, so no vocabulary either."""
    (root / "mels").mkdir(parents=True)
    (root / "tokens").mkdir()
    for uid, ids in tokens.items():
        np.save(root / "mels" / f"{uid}.npy", np.zeros((5, 80), np.float32))
        np.save(root / "tokens" / f"{uid}.npy", np.array(ids, np.int32))
    manifest, problems = build_manifest(root, 80)
    assert problems == []
    write_manifest(manifest)
    return root


def test_a_token_id_beyond_model_vocab_size_is_refused_at_consumer_start_naming_the_cache(tmp_path: Path) -> None:
    from melfeed.consumer.app import _opened_state
    from melfeed.consumer.feed import Consumer
    from melfeed.shared.service.tf_config import SINGLE_WORKER

    cache = _adopted_cache(tmp_path / "c", {"a": [1, 2, 3], "b": [4, 312, 0]})
    cfg = config_from_mapping({"cache_dir": str(cache), "model": {"vocab_size": 256}})
    with pytest.raises(ConfigError) as info, _opened_state(cfg, SINGLE_WORKER):  # run/consumer: before the feed
        pass
    assert str(info.value) == (
        f"model.vocab_size: must be > 312, the largest token id in {cache} (melfeed "
        f"verify-cache --cache-dir {cache} --vocab-size 256 names the files with ids >= 256), got 256"
    )
    assert load_manifest_for(cfg, feeds_model=False).token_range == (0, 312)  # a producer runs no model: not refused
    feed = Consumer(cfg)  # nor the library: the model is the caller's own
    feed.close()
    assert feed.manifest.token_range == (0, 312)
    fits = config_from_mapping({"cache_dir": str(cache), "model": {"vocab_size": 313}})
    assert load_manifest_for(fits).token_range == (0, 312)


def test_a_negative_token_id_in_a_manifest_is_refused_naming_it(tmp_path: Path) -> None:
    cache = _adopted_cache(tmp_path / "c", {"a": [1, 2]})
    manifest = load_manifest(cache)
    write_manifest(Manifest(cache, 80, manifest.utterances, token_range=(-1, 2)))  # index never writes this
    with pytest.raises(CacheError) as info:
        load_manifest_for(config_from_mapping({"cache_dir": str(cache)}))
    assert (
        str(info.value) == f"{cache / 'manifest.json'}: token id -1 is negative; re-run index, which names the files"
        " that hold one"
    )


def test_a_manifest_from_before_token_range_gets_one_warning_and_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = _adopted_cache(tmp_path / "c", {"a": [1, 300]})
    manifest = load_manifest(cache)
    write_manifest(Manifest(cache, 80, manifest.utterances))  # as an older index wrote it: no token_range
    cfg = config_from_mapping({"cache_dir": str(cache), "model": {"vocab_size": 256}})
    with caplog.at_level("WARNING", logger="melfeed.shared.cache.features"):
        for _ in range(2):  # state directory, then the feed: one warning
            assert load_manifest_for(cfg).token_range is None
    assert [r.getMessage() for r in caplog.records] == [
        f"token ids of cache {cache} not checked against model.vocab_size: its manifest was written before index "
        f"recorded them; re-run `melfeed index --cache-dir {cache}` to check them "
        "(this changes the fingerprint: re-run "
        "pack too, and an interrupted run cannot resume across it)"
    ]
    caplog.clear()
    write_manifest(build_manifest(cache, 80)[0])  # re-indexed: checked, and refused
    with (
        caplog.at_level("WARNING", logger="melfeed.shared.cache.features"),
        pytest.raises(ConfigError, match="must be > 300"),
    ):
        load_manifest_for(cfg)
    assert caplog.records == []


def test_a_manifest_that_lists_no_utterance_is_one_line_naming_it_not_a_traceback(tmp_path: Path) -> None:
    """``index --skip-bad`` with every file bad writes one; every start built buckets from it (ValueError)."""
    for sub in ("mels", "tokens"):
        (tmp_path / sub).mkdir()
    np.save(tmp_path / "mels" / "a.npy", np.zeros((3, 80), np.float32))
    np.save(tmp_path / "tokens" / "a.npy", np.array([-1], np.int32))
    manifest, problems = build_manifest(tmp_path, 80)
    assert len(manifest) == 0 and problems
    write_manifest(manifest)
    with pytest.raises(
        CacheError, match=f"^{tmp_path}/manifest.json: lists no utterances: index skipped every file as bad"
    ):
        load_manifest_for(config_from_mapping({"cache_dir": str(tmp_path)}))
