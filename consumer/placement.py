"""Which GPU(s) the consumer's TensorFlow sees and how much memory it takes; the XLA cache flag (its directory:
``consumer/xla_cache.py``).

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
from typing import Any

from melfeed.consumer.xla_cache import (
    XLA_CACHE_FLAG,
    active_xla_cache_dir,
    prepare_xla_cache,
    xla_cache_dir,
    xla_cache_namespace,
    xla_cache_warm,
)
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.gpu_select import DEVICE_ORDER, gpu_env

__all__ = [
    "XLA_CACHE_FLAG",
    "active_xla_cache_dir",
    "apply_placement",
    "check_model_gpus",
    "configure_memory",
    "placement_env",
    "prepare_tensorflow",
    "step_devices",
    "xla_cache_dir",
    "xla_cache_warm",
]

log = logging.getLogger(__name__)


def placement_env(
    cfg: PipelineConfig, environ: Mapping[str, str], cache_namespace: str | None = None
) -> dict[str, str]:
    """The variables to set (pure): the model GPU(s) in PCI bus order and the cache flag, merged into
    ``environ``'s. Without ``consumer.model_gpu`` an inherited ``CUDA_VISIBLE_DEVICES`` stays, numbered in PCI
    bus order unless ``environ`` chose an order. ``cache_namespace``: the directory below the cache root
    (``xla_cache_namespace``); None = the root itself."""
    out: dict[str, str] = {}
    if cfg.consumer.model_gpu is not None:
        out.update(gpu_env(cfg.consumer.model_gpu))
    elif "CUDA_DEVICE_ORDER" not in environ:
        out.update(DEVICE_ORDER)
    cache = xla_cache_dir(cfg)
    if cache is not None:
        cache = cache / cache_namespace if cache_namespace else cache
        flags = [f for f in environ.get("TF_XLA_FLAGS", "").split() if not f.startswith(XLA_CACHE_FLAG + "=")]
        out["TF_XLA_FLAGS"] = " ".join([*flags, f"{XLA_CACHE_FLAG}={cache}"])
    return out


def apply_placement(
    cfg: PipelineConfig, environ: MutableMapping[str, str] | None = None, modules: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """Set ``placement_env`` in ``environ`` (os.environ); returns what it set.

    Once TensorFlow is imported nothing is set (it would have no effect): a different model GPU is refused,
    a different XLA cache only warned about (the run works, it just compiles from scratch).

    Raises:
        ConfigError: TensorFlow is already imported and ``consumer.model_gpu`` would change the visible GPUs.
    """
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    root = xla_cache_dir(cfg)
    wanted = placement_env(cfg, environ, xla_cache_namespace(cfg, environ) if root is not None else None)
    changed = {k: v for k, v in wanted.items() if environ.get(k) != v}
    if changed and "tensorflow" in modules:
        if "CUDA_VISIBLE_DEVICES" in changed:
            raise ConfigError(
                f"TensorFlow was imported before it could be applied (CUDA_VISIBLE_DEVICES is "
                f"{environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}); set it before importing "
                f"TensorFlow or call melfeed.consumer.placement.apply_placement first",
                path=("consumer", "model_gpu"),
                got=cfg.consumer.model_gpu,
            )
        if "TF_XLA_FLAGS" in changed:
            log.warning(
                "XLA compilation cache off: TensorFlow was imported before TF_XLA_FLAGS could name %s",
                active_xla_cache_dir(wanted),
            )
        return {}
    if root is not None:
        prepare_xla_cache(cfg, root)
        prepare_xla_cache(cfg, active_xla_cache_dir(wanted) or root)
    environ.update(changed)
    return changed


def configure_memory(cfg: PipelineConfig, tf_module: Any = None) -> list[str]:
    """Memory growth (``consumer.gpu_memory_limit_mb`` null) or that cap on every visible GPU; without a GPU,
    ``consumer.replicas`` > 1 splits the CPU into that many logical devices (consumer/train/replicas.py).

    Call right after importing TensorFlow, before any op runs. Returns the GPUs configured ([] on CPU).

    Raises:
        ConfigError: ``consumer.model_gpu`` names a GPU TensorFlow does not see (``check_model_gpus``).
    """
    tf = tf_module if tf_module is not None else importlib.import_module("tensorflow")
    gpus = tf.config.list_physical_devices("GPU")
    check_model_gpus(cfg.consumer.model_gpu, [str(g.name) for g in gpus])
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
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mb)]
                )
    except RuntimeError as err:  # the devices were initialized already (an op ran before this call)
        log.warning("device settings not applied (TensorFlow already initialized its devices): %s", err)
    log.info(
        "placement: CUDA_VISIBLE_DEVICES=%s, %d GPU(s) visible, %s, XLA cache %s%s",
        os.environ.get("CUDA_VISIBLE_DEVICES", "<inherited: all>"),
        len(gpus),
        "memory growth" if limit_mb is None else f"{limit_mb} MiB cap each",
        active_xla_cache_dir() or "off",
        f", CPU split into {replicas} logical devices (replicas)" if not gpus and replicas > 1 else "",
    )
    return [str(g.name) for g in gpus]


def check_model_gpus(model_gpu: str | None, seen: list[str]) -> None:
    """Refuse a ``consumer.model_gpu`` that names more GPUs than TensorFlow sees (``seen``: its physical GPUs).

    CUDA skips an entry of ``CUDA_VISIBLE_DEVICES`` it cannot find (and every entry after it), and TensorFlow
    then places the step on what is left, the CPU when nothing is: a host index a container renumbered,
    TensorFlow without its CUDA libraries (``tensorflow[and-cuda]``) or a driver it cannot use.

    Raises:
        ConfigError: naming ``consumer.model_gpu`` and the GPUs TensorFlow does see.
    """
    named = [g for g in (model_gpu or "").split(",") if g.strip()]
    if len(seen) < len(named):
        sees = ", ".join(seen) if seen else "no GPU (it would train on the CPU)"
        raise ConfigError(
            f"names {len(named)} GPU(s) but TensorFlow sees {sees}: check the index or UUID "
            "against nvidia-smi -L in this container, that TensorFlow has CUDA (pip install "
            "'tensorflow[and-cuda]') and the driver",
            path=("consumer", "model_gpu"),
            got=model_gpu,
        )


def prepare_tensorflow(cfg: PipelineConfig) -> None:
    """``apply_placement``, then import TensorFlow and ``configure_memory``: for a library user's own loop
    (``run`` and ``consumer`` apply the env first thing and configure memory once the state dir is open)."""
    apply_placement(cfg)
    configure_memory(cfg)


def step_devices(outputs: Mapping[str, Any]) -> list[str]:
    """The device(s) the step's output tensors live on, e.g. "/job:localhost/replica:0/task:0/device:GPU:0"."""
    return sorted({str(t.device) for t in outputs.values() if getattr(t, "device", "")})
