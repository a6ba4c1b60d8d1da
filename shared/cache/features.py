"""Recorded feature parameters of a cache: what ``prepare`` computed, checked at every start.

The definition itself (log-mel steps, the resampler) lives with the code that computes it,
``producer/prepare/dsp.py``; this module holds only its version strings and the parameter record
that ``prepare`` writes into the manifest and that producer and consumer starts compare with the
config (``check_features``, ``load_manifest_for``).

Invariants: a definition change bumps ``FEATURE_VERSION`` (or ``RESAMPLER_VERSION``), so an old
cache is refused with the key that differs instead of being trained on silently.
Shutdown: nothing to shut down.
"""

from __future__ import annotations

from typing import Any

from shared.config import FeatureConfig, PipelineConfig
from shared.errors import ConfigError
from shared.cache.manifest import MANIFEST_NAME, Manifest, load_manifest
from shared.cache.text import TEXT_VERSION

__all__ = ["FEATURE_VERSION", "RESAMPLER_VERSION", "N_MELS_MAX", "feature_params", "check_features", "check_n_mels_flag",
           "load_manifest_for"]

FEATURE_VERSION = "melfeed-logmel/1"  # bump when the definition in producer/prepare/dsp.py changes
RESAMPLER_VERSION = "kaiser-sinc/32/9.0/0.95"
N_MELS_MAX = 1024   # the range the config allows for n_mels (shared/config.py); tests hold the two equal


def check_n_mels_flag(n_mels: int, flag: str = "--n-mels") -> int:
    """``n_mels`` if it is in 1..N_MELS_MAX (``index``, ``verify-cache``, ``pack``), else one line naming ``flag``.

    Raises:
        ConfigError: out of range: no cache can hold it, so every file would be reported bad instead.
    """
    if not 1 <= n_mels <= N_MELS_MAX:
        raise ConfigError(f"must be in 1..{N_MELS_MAX} (mel bins per frame, as the config's n_mels)",
                          path=(flag,), got=n_mels)
    return n_mels


def feature_params(features: FeatureConfig, n_mels: int) -> dict[str, Any]:
    """Everything that decides what a cached mel or token id means, as the manifest records it.

    The duration limits are left out: they choose clips, they do not change any clip's values.
    """
    return {
        "definition": FEATURE_VERSION, "sample_rate_hz": features.sample_rate_hz,
        "n_fft": features.n_fft, "hop_samples": features.hop_samples,
        "win_samples": features.win_samples, "n_mels": n_mels, "fmin_hz": float(features.fmin_hz),
        "fmax_hz": float(features.top_hz), "power": float(features.power),
        "log_floor": float(features.log_floor), "text": TEXT_VERSION,
    }


def check_features(manifest: Manifest, cfg: PipelineConfig) -> None:
    """Refuse a config that would read the cache as something it is not.

    A cache without recorded features (demo data, an adopted cache) is not checked.

    Raises:
        ConfigError: One line naming the first differing key (``features.hop_samples: cache
            /data/c was prepared with 275, this config has 256``), or a ``model.vocab_size``
            smaller than the cache's vocabulary.
    """
    where = manifest.cache_dir / MANIFEST_NAME
    if manifest.features is not None:
        recorded, wanted = dict(manifest.features), feature_params(cfg.features, cfg.n_mels)
        for key in [*wanted, *sorted(recorded.keys() - wanted.keys())]:
            if recorded.get(key) != wanted.get(key):
                path = ("n_mels",) if key == "n_mels" else ("features", key)
                raise ConfigError(f"cache {where} was prepared with {recorded.get(key)!r}, "
                                  f"this config has {wanted.get(key)!r}", path=path)
    if manifest.vocabulary is not None and cfg.model.vocab_size < len(manifest.vocabulary):
        raise ConfigError(f"must be >= {len(manifest.vocabulary)}, the size of the vocabulary of {where}",
                          path=("model", "vocab_size"), got=cfg.model.vocab_size)


def load_manifest_for(cfg: PipelineConfig) -> Manifest:
    """``load_manifest(cfg.cache_dir, cfg.n_mels)`` plus ``check_features``: for producer and consumer starts.

    Raises:
        CacheError: See ``load_manifest``.
        ConfigError: See ``check_features``; also when ``cache_dir`` is not set.
    """
    if cfg.cache_dir is None:
        raise ConfigError("must be set (a directory with mels/, tokens/ and manifest.json)", path=("cache_dir",))
    manifest = load_manifest(cfg.cache_dir, cfg.n_mels)
    check_features(manifest, cfg)
    return manifest
