"""Recorded feature parameters of a cache: what ``prepare`` computed, checked at every start.

The definition itself (log-mel steps, the resampler) lives with the code that computes it,
``producer/prepare/dsp.py``; this module holds only its version strings, the parameter record
``features.json`` that ``prepare`` writes (``write_feature_record``, ``read_feature_record``; ``index``
copies it into the manifest), and the checks producer and consumer starts make against the config
(``check_features``, ``load_manifest_for``): the feature parameters, and on a consumer start the token ids
``index`` recorded against ``model.vocab_size`` (``check_token_ids``).

Invariants: a definition change bumps ``FEATURE_VERSION`` (or ``RESAMPLER_VERSION``), so an old
cache is refused with the key that differs instead of being trained on silently.
Shutdown: nothing to shut down.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from melfeed.shared.cache.filekind import read_json, write_atomic
from melfeed.shared.cache.manifest import MANIFEST_NAME, Manifest, load_manifest, parse_features, parse_vocabulary
from melfeed.shared.cache.text import TEXT_VERSION
from melfeed.shared.config import FeatureConfig, PipelineConfig
from melfeed.shared.errors import CacheError, ConfigError

__all__ = [
    "FEATURE_VERSION",
    "RESAMPLER_VERSION",
    "N_MELS_MAX",
    "FEATURES_NAME",
    "feature_params",
    "check_features",
    "check_token_ids",
    "check_n_mels_flag",
    "load_manifest_for",
    "read_feature_record",
    "write_feature_record",
]

log = logging.getLogger(__name__)

FEATURE_VERSION = "melfeed-logmel/1"  # bump when the definition in producer/prepare/dsp.py changes
RESAMPLER_VERSION = "kaiser-sinc/32/9.0/0.95"
N_MELS_MAX = 1024  # the range the config allows for n_mels (shared/config/__init__.py); tests hold the two equal
FEATURES_NAME = "features.json"
_FEATURES_FORMAT = 1


def check_n_mels_flag(n_mels: int, flag: str = "--n-mels") -> int:
    """``n_mels`` if it is in 1..N_MELS_MAX (``index``, ``verify-cache``, ``pack``), else one line naming ``flag``.

    Raises:
        ConfigError: out of range: no cache can hold it, so every file would be reported bad instead.
    """
    if not 1 <= n_mels <= N_MELS_MAX:
        raise ConfigError(
            f"must be in 1..{N_MELS_MAX} (mel bins per frame, as the config's n_mels)", path=(flag,), got=n_mels
        )
    return n_mels


def feature_params(features: FeatureConfig, n_mels: int) -> dict[str, Any]:
    """Everything that decides what a cached mel or token id means, as the manifest records it.

    The duration limits are left out: they choose clips, they do not change any clip's values.
    """
    return {
        "definition": FEATURE_VERSION,
        "sample_rate_hz": features.sample_rate_hz,
        "n_fft": features.n_fft,
        "hop_samples": features.hop_samples,
        "win_samples": features.win_samples,
        "n_mels": n_mels,
        "fmin_hz": float(features.fmin_hz),
        "fmax_hz": float(features.top_hz),
        "power": float(features.power),
        "log_floor": float(features.log_floor),
        "text": TEXT_VERSION,
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
                raise ConfigError(
                    f"cache {where} was prepared with {recorded.get(key)!r}, this config has {wanted.get(key)!r}",
                    path=path,
                )
    if manifest.vocabulary is not None and cfg.model.vocab_size < len(manifest.vocabulary):
        raise ConfigError(
            f"must be >= {len(manifest.vocabulary)}, the size of the vocabulary of {where}",
            path=("model", "vocab_size"),
            got=cfg.model.vocab_size,
        )


def check_token_ids(manifest: Manifest, vocab_size: int) -> None:
    """Refuse a cache whose token ids the model cannot embed: every id must be in 0..vocab_size-1.

    ``vocab_size`` is the running model's, ``model.vocab_size``: the ``StepSpec.vocab_size`` every step
    factory is given, with the contract that ids are below it. An id outside need not fail: an embedding
    lookup compiled with XLA clamps it to a valid row, and TensorFlow's GPU gather gives zeros for it, so the run
    would train on the wrong rows silently (graph mode on a CPU is the one that raises). A manifest
    written before ``index`` recorded ``token_range`` gets one WARNING per cache and process instead.

    Raises:
        ConfigError: the largest id is >= ``vocab_size``, naming the cache and ``model.vocab_size``.
        CacheError: the smallest id is negative (``index`` refuses such a file, so only a manifest written by
            something else has one), naming the manifest.
    """
    if manifest.token_range is None:
        key = (str(manifest.cache_dir.resolve()), manifest.fingerprint)
        if len(manifest) and key not in _WARNED_UNCHECKED:
            _WARNED_UNCHECKED.add(key)
            log.warning(
                "token ids of cache %s not checked against model.vocab_size: its manifest was written "
                "before index recorded them; re-run `melfeed index --cache-dir %s` to check them (this changes "
                "the fingerprint: re-run pack too, and an interrupted run cannot resume across it)",
                manifest.cache_dir,
                manifest.cache_dir,
            )
        return
    smallest, largest = manifest.token_range
    if smallest < 0:
        raise CacheError(
            manifest.cache_dir / MANIFEST_NAME,
            f"token id {smallest} is negative; re-run index, which names the files that hold one",
        )
    if largest >= vocab_size:
        cache = manifest.cache_dir
        raise ConfigError(
            f"must be > {largest}, the largest token id in {cache} (melfeed verify-cache --cache-dir {cache} "
            f"--vocab-size {vocab_size} names the files with ids >= {vocab_size})",
            path=("model", "vocab_size"),
            got=vocab_size,
        )


# (cache dir, fingerprint) of the unchecked caches already warned about: one WARNING per cache and process, however
# often a process loads its manifest (bench: once per command, and again per trial).
_WARNED_UNCHECKED: set[tuple[str, str]] = set()


def load_manifest_for(cfg: PipelineConfig, *, feeds_model: bool = True) -> Manifest:
    """``load_manifest(cfg.cache_dir, cfg.n_mels)`` plus ``check_features``: for producer and consumer starts.

    Args:
        feeds_model: The caller trains or measures ``cfg.model`` on this cache (the built-in loop of ``run`` and
            ``consumer``, ``doctor``, ``bench``), so ``check_token_ids`` compares the cache's ids with
            ``model.vocab_size`` too. False where the model section is not the one that runs: producers (they
            run none, and one configured with another must not be refused for it) and the library's
            ``Consumer`` (the caller's own model, whose vocabulary melfeed does not know).

    Raises:
        CacheError: See ``load_manifest``; a manifest with no utterance; a negative token id (``check_token_ids``).
        ConfigError: See ``check_features`` and ``check_token_ids``; also when ``cache_dir`` is not set.
    """
    if cfg.cache_dir is None:
        raise ConfigError("must be set (a directory with mels/, tokens/ and manifest.json)", path=("cache_dir",))
    manifest = load_manifest(cfg.cache_dir, cfg.n_mels)
    if not len(manifest):  # `index --skip-bad` with every file bad writes one; buckets and plans need a row
        raise CacheError(
            manifest.cache_dir / MANIFEST_NAME,
            "lists no utterances: index skipped every file as bad "
            f"(melfeed index --cache-dir {manifest.cache_dir} names each one); nothing to train on",
        )
    check_features(manifest, cfg)
    if feeds_model:
        check_token_ids(manifest, cfg.model.vocab_size)
    return manifest


def read_feature_record(cache_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``CACHE/features.json`` as written by ``prepare`` (checked), or None when there is none.

    Raises:
        CacheError: The record exists but is unreadable or malformed.
    """
    path = Path(cache_dir) / FEATURES_NAME
    try:
        doc = read_json(path)
    except CacheError as err:
        if err.reason == "missing":
            return None
        raise
    except OSError as err:  # EACCES, ENOTDIR (a file where the cache directory should be), EIO
        raise CacheError(path, f"cannot read ({err.strerror})") from err
    except ValueError as err:
        raise CacheError(path, f"malformed feature record: {err}".replace("\n", " ")) from err
    if not isinstance(doc, dict) or doc.get("format") != _FEATURES_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise CacheError(path, f"unsupported feature record format {got!r}, expected {_FEATURES_FORMAT}")
    parse_features(doc.get("features"), path)
    parse_vocabulary(doc.get("vocabulary"), path)
    return doc


def write_feature_record(
    cache_dir: str | os.PathLike[str],
    features: Mapping[str, Any],
    vocabulary: tuple[str, ...],
    extra: Mapping[str, Any],
) -> Path:
    """Write ``CACHE/features.json`` atomically: what every file of the cache was computed with.

    Args:
        features: Feature parameters (names to numbers or strings), e.g. from
            ``feature_params``.
        vocabulary: Symbol of each token id; index 0 is padding.
        extra: Further settings kept for ``prepare``'s resume check (not in the manifest).
    """
    doc = {"format": _FEATURES_FORMAT, "features": dict(features), "vocabulary": list(vocabulary), **extra}
    return write_atomic(Path(cache_dir), FEATURES_NAME, json.dumps(doc, indent=1, sort_keys=True).encode())
