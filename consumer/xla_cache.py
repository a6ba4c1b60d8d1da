"""The persistent XLA compilation cache: where it lives, what its directory is named after, and the programs
XLA compiled into it.

TensorFlow's cache (``--tf_xla_persistent_cache_directory`` in ``TF_XLA_FLAGS``, read once when TensorFlow is
imported) names each file after the cluster's signature (the function's name and its argument shapes), the
HLO module's fingerprint and the device type (XLA_CPU_JIT, XLA_GPU_JIT). The GPU model, the driver, the
TensorFlow version and ``XLA_FLAGS`` are not part of that key, so the directory TensorFlow gets is a namespace
below ``consumer.xla_cache_dir`` built from them (``cache_namespace``): a cache moved to another GPU model, kept
across a TensorFlow upgrade or shared by two steps never hands one of them the other's program.

TensorFlow writes one ``.pb`` file per program it compiles and nothing for a program it loads, so the count
of new files in the directory (``CompileFiles``) is the count of XLA compilations; TensorFlow 2.21 keeps its own
counter of them (``/tensorflow/core/xla_compilations``) in C++, out of Python's reach.
Invariant: nothing here imports TensorFlow (the namespace must be known before it is imported).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from melfeed.consumer.observe.gpu import load_nvml, resolve_gpus, visible_gpu_selectors
from melfeed.consumer.resume.filemode import make_private_dir
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.filetrust import untrusted_reason
from melfeed.shared.flag_checks import resolve_path

__all__ = [
    "XLA_CACHE_FLAG",
    "CompileFiles",
    "active_xla_cache_dir",
    "cache_namespace",
    "prepare_xla_cache",
    "step_identity",
    "xla_cache_dir",
    "xla_cache_namespace",
    "xla_cache_warm",
]

log = logging.getLogger(__name__)

XLA_CACHE_FLAG = "--tf_xla_persistent_cache_directory"
_XLA_CACHE_SUBDIR = "xla-cache"
_TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tf-nightly")  # the pip names TensorFlow ships as
_HASH_CHARS = 10  # 40 bits: no two flag sets or steps of one cache meet by chance
_RECOUNT_INTERVAL_S = 1.0  # CompileFiles lists the directory at most this often (it is read every step)


def xla_cache_dir(cfg: PipelineConfig) -> Path | None:
    """``consumer.xla_cache_dir``, else ``<state_dir>/xla-cache``; None without either (no cache).

    This is the root; TensorFlow gets the ``xla_cache_namespace`` directory below it.
    """
    if cfg.consumer.xla_cache_dir is not None:
        return resolve_path(cfg.consumer.xla_cache_dir, ("consumer", "xla_cache_dir"))
    if cfg.consumer.state_dir is not None:
        return resolve_path(Path(cfg.consumer.state_dir) / _XLA_CACHE_SUBDIR, ("consumer", "state_dir"))
    return None


def active_xla_cache_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The cache directory TensorFlow in this process uses (from ``TF_XLA_FLAGS``), None without one."""
    environ = os.environ if environ is None else environ
    for flag in environ.get("TF_XLA_FLAGS", "").split():
        if flag.startswith(XLA_CACHE_FLAG + "="):
            return Path(flag.split("=", 1)[1])
    return None


def xla_cache_warm(cache_dir: Path | None) -> bool | None:
    """Whether the cache already holds compiled programs (None: no cache)."""
    if cache_dir is None:
        return None
    return cache_dir.is_dir() and any(cache_dir.glob("*.pb"))


def cache_namespace(
    tf_version: str, devices: list[str], driver: str | None, environ: Mapping[str, str], step: str
) -> str:
    """The directory name (pure): ``tf2.21.0-nvidia-h100-80gb-hbm3-drv550.54.15-flags<hash>-step<hash>``.

    ``devices``: the model GPUs' names (``["cpu"]`` without one); ``driver``: NVIDIA's driver version (None
    without NVML); the flags hash covers ``TF_XLA_FLAGS`` (less the cache flag) and ``XLA_FLAGS``; ``step`` is
    ``step_identity``.
    """
    flags = [f for f in environ.get("TF_XLA_FLAGS", "").split() if not f.startswith(XLA_CACHE_FLAG + "=")]
    flags_hash = _short_hash([flags, environ.get("XLA_FLAGS", "")])
    parts = [
        f"tf{tf_version}",
        *dict.fromkeys(_slug(d) for d in devices),
        *([f"drv{driver}"] if driver else []),
        f"flags{flags_hash}",
        f"step{step}",
    ]
    return "-".join(parts)


def step_identity(cfg: PipelineConfig, bucket_shapes: Callable[[PipelineConfig], list[Any]] | None = None) -> str:
    """A short hash of ``model.step`` and the bucket shapes its programs are compiled for.

    ``bucket_shapes``: cfg -> the shapes (default: derived from the cache's manifest as the consumer derives
    them; none without ``cache_dir``).
    """
    shapes = (bucket_shapes or _bucket_shapes)(cfg)
    return _short_hash([cfg.model.step, cfg.transport.mel_dtype, shapes])


def xla_cache_namespace(cfg: PipelineConfig, environ: Mapping[str, str], nvml: Any = None) -> str:
    """``cache_namespace`` of this host: TensorFlow's version (its package metadata: TensorFlow is not
    imported), the model GPUs (``consumer.model_gpu``, else ``CUDA_VISIBLE_DEVICES``) and the driver as NVML
    names them (``nvml``: a pynvml double for tests), and this config's step."""
    devices, driver = _model_gpus(cfg, environ, nvml)
    return cache_namespace(_tensorflow_version(), devices, driver, environ, step_identity(cfg))


def prepare_xla_cache(cfg: PipelineConfig, cache: Path) -> None:
    """Create the XLA cache directory 0750 (and the state dir, as RunState would) and refuse one others control.

    TensorFlow writes the cache's files with the umask's modes (0666 under umask 000) and loads the
    compiled programs it finds there; the directory is what keeps other users from reading them or
    planting their own. ``cache`` is resolved already, so a symbolic link there now was put there since.

    Raises:
        ConfigError: naming ``consumer.xla_cache_dir`` (or ``consumer.state_dir`` when the cache is derived
            from it): it cannot be created, is a symbolic link, belongs to another user (not root), or its
            group or others can write to it.
    """
    key = ("consumer", "xla_cache_dir" if cfg.consumer.xla_cache_dir is not None else "state_dir")
    try:
        make_private_dir(cache)  # may create the state dir itself: 0750 as RunState would
        reason = untrusted_reason(cache, directory=True, follow=False)
    except OSError as err:
        raise ConfigError(f"cannot use {cache} as the XLA compilation cache: {err.strerror or err}", path=key) from None
    if reason is not None:
        raise ConfigError(
            f"XLA compilation cache {cache} {reason} (TensorFlow would load programs planted "
            "there); make it this user's, 0700 or 0750",
            path=key,
        )


class CompileFiles:
    """XLA compilations since ``mark()``: the new ``.pb`` files in ``cache_dir`` (None: no cache, always 0).

    ``since_mark()`` is cheap enough for every step: it lists the directory at most every
    ``recount_interval_s`` (``clock`` is ``time.monotonic``; tests inject one). Another process compiling
    into the same directory meanwhile is counted too: the figure is an upper bound then.
    """

    def __init__(
        self,
        cache_dir: Path | None,
        recount_interval_s: float = _RECOUNT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dir, self._interval_s, self._clock = cache_dir, recount_interval_s, clock
        self._marked: set[str] = set()
        self._new = 0
        self._listed_at_s = float("-inf")

    def mark(self) -> None:
        """From now on: the files there now are not counted."""
        self._marked, self._new, self._listed_at_s = self._files(), 0, self._clock()

    def since_mark(self) -> int:
        """New program files since ``mark()`` (as of the latest listing)."""
        now_s = self._clock()
        if self._dir is not None and now_s - self._listed_at_s >= self._interval_s:
            self._new, self._listed_at_s = len(self._files() - self._marked), now_s
        return self._new

    def _files(self) -> set[str]:
        if self._dir is None:
            return set()
        try:
            return {e.name for e in os.scandir(self._dir) if e.name.endswith(".pb")}
        except OSError:  # removed under us: nothing new to count
            return set()


def _model_gpus(cfg: PipelineConfig, environ: Mapping[str, str], nvml: Any) -> tuple[list[str], str | None]:
    """The model GPUs' names and the driver version, as NVML reports them; (["cpu"], None) without any."""
    raw = cfg.consumer.model_gpu if cfg.consumer.model_gpu is not None else environ.get("CUDA_VISIBLE_DEVICES")
    selectors = visible_gpu_selectors(raw)
    if selectors == []:
        return ["cpu"], None
    mig = ["mig"] if any(s.startswith("MIG-") for s in selectors or ()) else []
    module = load_nvml(nvml, quiet=True)  # the sampler reports NVML itself, once
    if module is None:
        return mig or (["cpu"] if selectors is None else ["gpu"]), None
    try:
        names = [g.name for g in resolve_gpus(module, selectors, quiet=True)]
        driver = _text(module.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 - NVML up but not answering: the namespace says less
        names, driver = [], None
    finally:
        _shutdown(module)
    return (names + mig) or ["cpu"], driver


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - a probe's shutdown must not fail the start
        pass


def _bucket_shapes(cfg: PipelineConfig) -> list[Any]:
    """Each bucket's array shapes, as the consumer derives them from the manifest ([] without ``cache_dir``)."""
    if cfg.cache_dir is None:
        return []
    from melfeed.shared.cache.features import load_manifest_for
    from melfeed.shared.wire.buckets import build_buckets, learns_costs, with_costs

    manifest = load_manifest_for(cfg, feeds_model=False)
    settings = cfg.buckets
    if settings.batch_size == "auto" and settings.rows is None:  # measured after TensorFlow starts: keyed by 1 row
        settings = dataclasses.replace(settings, batch_size=1)
    if learns_costs(settings):  # the weights too: keyed by the plan of the weights as set
        settings = with_costs(settings, settings.token_cost, settings.attention_cost)
    buckets = build_buckets(
        manifest.frames, manifest.token_counts, cfg.n_mels, settings, manifest.schema, mel_dtype=cfg.transport.mel_dtype
    )
    return [sorted(b.shapes().items()) for b in buckets.buckets]


def _tensorflow_version() -> str:
    for name in _TF_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _short_hash(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:_HASH_CHARS]


def _slug(name: str) -> str:
    return re.sub(r"[^0-9a-z.]+", "-", name.lower()).strip("-") or "gpu"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
