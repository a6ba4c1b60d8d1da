"""Which GPU(s) the consumer's TensorFlow sees and how much memory it takes; the XLA compilation cache.

Everything here that sets the environment must run before TensorFlow is first imported in the process:
CUDA reads ``CUDA_VISIBLE_DEVICES`` and XLA reads ``TF_XLA_FLAGS`` once, at import. ``run`` and
``consumer`` call ``apply_placement`` first; a library user calls it (or sets the variables) before
``import tensorflow``. ``configure_memory`` runs right after the import, before any op touches a GPU.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from melfeed.consumer.resume.filemode import make_private_dir
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.filetrust import untrusted_reason
from melfeed.shared.flag_checks import resolve_path

__all__ = ["XLA_CACHE_FLAG", "active_xla_cache_dir", "apply_placement", "configure_memory", "placement_env",
           "prepare_tensorflow", "step_devices", "xla_cache_dir", "xla_cache_warm"]

log = logging.getLogger(__name__)

XLA_CACHE_FLAG = "--tf_xla_persistent_cache_directory"
_XLA_CACHE_SUBDIR = "xla-cache"


def xla_cache_dir(cfg: PipelineConfig) -> Path | None:
    """``consumer.xla_cache_dir``, else ``<state_dir>/xla-cache``; None without either (no cache)."""
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


def placement_env(cfg: PipelineConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set (pure): the model GPU(s) and the cache flag, merged into ``environ``'s."""
    out: dict[str, str] = {}
    if cfg.consumer.model_gpu is not None:
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"      # indices as nvidia-smi and NVML number them
        out["CUDA_VISIBLE_DEVICES"] = cfg.consumer.model_gpu
    cache = xla_cache_dir(cfg)
    if cache is not None:
        flags = [f for f in environ.get("TF_XLA_FLAGS", "").split() if not f.startswith(XLA_CACHE_FLAG + "=")]
        out["TF_XLA_FLAGS"] = " ".join([*flags, f"{XLA_CACHE_FLAG}={cache}"])
    return out


def apply_placement(cfg: PipelineConfig, environ: MutableMapping[str, str] | None = None,
                    modules: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Set ``placement_env`` in ``environ`` (os.environ); returns what it set.

    Once TensorFlow is imported nothing is set (it would have no effect): a different model GPU is refused,
    a different XLA cache only warned about (the run works, it just compiles from scratch).

    Raises:
        ConfigError: TensorFlow is already imported and ``consumer.model_gpu`` would change the visible GPUs.
    """
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    wanted = placement_env(cfg, environ)
    changed = {k: v for k, v in wanted.items() if environ.get(k) != v}
    if changed and "tensorflow" in modules:
        if "CUDA_VISIBLE_DEVICES" in changed:
            raise ConfigError(f"TensorFlow was imported before it could be applied (CUDA_VISIBLE_DEVICES is "
                              f"{environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}); set it before importing "
                              f"TensorFlow or call melfeed.consumer.placement.apply_placement first",
                              path=("consumer", "model_gpu"), got=cfg.consumer.model_gpu)
        if "TF_XLA_FLAGS" in changed:
            log.warning("XLA compilation cache off: TensorFlow was imported before TF_XLA_FLAGS could name %s",
                        xla_cache_dir(cfg))
        return {}
    if cache := xla_cache_dir(cfg):
        _prepare_xla_cache(cfg, cache)
    environ.update(changed)
    return changed


def _prepare_xla_cache(cfg: PipelineConfig, cache: Path) -> None:
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
        make_private_dir(cache)    # may create the state dir itself: 0750 as RunState would
        reason = untrusted_reason(cache, directory=True, follow=False)
    except OSError as err:
        raise ConfigError(f"cannot use {cache} as the XLA compilation cache: {err.strerror or err}",
                          path=key) from None
    if reason is not None:
        raise ConfigError(f"XLA compilation cache {cache} {reason} (TensorFlow would load programs planted "
                          "there); make it this user's, 0700 or 0750", path=key)


def configure_memory(cfg: PipelineConfig, tf_module: Any = None) -> list[str]:
    """Memory growth (``consumer.gpu_memory_limit_mb`` null) or that cap on every visible GPU; without a GPU,
    ``consumer.replicas`` > 1 splits the CPU into that many logical devices (consumer/train/replicas.py).

    Call right after importing TensorFlow, before any op runs. Returns the GPUs configured ([] on CPU).
    """
    tf = tf_module if tf_module is not None else importlib.import_module("tensorflow")
    gpus = tf.config.list_physical_devices("GPU")
    limit_mb = cfg.consumer.gpu_memory_limit_mb
    replicas = cfg.consumer.replica_count
    try:
        if not gpus and replicas > 1:
            cpus = tf.config.list_physical_devices("CPU")
            tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
        for gpu in gpus:
            if limit_mb is None:
                tf.config.experimental.set_memory_growth(gpu, True)
            else:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mb)])
    except RuntimeError as err:    # the devices were initialized already (an op ran before this call)
        log.warning("device settings not applied (TensorFlow already initialized its devices): %s", err)
    named = [g for g in (cfg.consumer.model_gpu or "").split(",") if g.strip()]
    if len(gpus) < len(named):    # e.g. "7" on a 2-GPU host, or a GPU config on a CPU-only box
        log.warning("consumer.model_gpu %r names %d GPU(s), TensorFlow sees %d: the step runs on %s",
                    cfg.consumer.model_gpu, len(named), len(gpus), "the CPU" if not gpus else "fewer GPUs than asked for")
    log.info("placement: CUDA_VISIBLE_DEVICES=%s, %d GPU(s) visible, %s, XLA cache %s%s",
             os.environ.get("CUDA_VISIBLE_DEVICES", "<inherited: all>"), len(gpus),
             "memory growth" if limit_mb is None else f"{limit_mb} MiB cap each", active_xla_cache_dir() or "off",
             f", CPU split into {replicas} logical devices (replicas)" if not gpus and replicas > 1 else "")
    return [str(g.name) for g in gpus]


def prepare_tensorflow(cfg: PipelineConfig) -> None:
    """``apply_placement``, then import TensorFlow and ``configure_memory``: for a library user's own loop
    (``run`` and ``consumer`` apply the env first thing and configure memory once the state dir is open)."""
    apply_placement(cfg)
    configure_memory(cfg)


def step_devices(outputs: Mapping[str, Any]) -> list[str]:
    """The device(s) the step's output tensors live on, e.g. "/job:localhost/replica:0/task:0/device:GPU:0"."""
    return sorted({str(t.device) for t in outputs.values() if getattr(t, "device", "")})
