"""NVML sampler: utilisation %, memory used/total and power of the GPUs this process can see.

Visible GPUs: when CUDA_VISIBLE_DEVICES is set, only the devices it names are sampled, in its
order; an empty value means no GPUs, unset every GPU NVML reports. The environment is read once, in
``GpuSampler.__init__`` (the process boundary), not deep in the sampling loop.
Matching (``resolve_gpus``): an index is NVML's index, which is PCI bus order, the order CUDA numbers the
GPUs in under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (every melfeed process sets it, ``shared/gpu_select.py``); a
``GPU-`` entry is a UUID or the unique prefix of one, as CUDA accepts it. Each GPU found is keyed by its UUID
(a GPU named twice is sampled once). A ``MIG-`` entry is not sampled: NVML reports no utilisation for MIG
instances (one INFO line points at DCGM). A GPU NVML cannot open (a container without access to it) is
skipped with one WARNING; the others are still sampled.
Absent NVML, driver or GPU: ``snapshot()`` returns ``[]`` and one INFO line is logged; never raises.
Shutdown: ``stop()`` sets an event and joins the thread with a bounded timeout; start/stop idempotent.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GpuSampler", "NvmlGpu", "format_gpus", "load_nvml", "resolve_gpus", "visible_gpu_selectors"]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 2.0  # > one NVML query round (milliseconds) plus one interval wait slice
_MIG_HINT = "NVML cannot sample MIG instances; use DCGM (DCGM_FI_PROF_GR_ENGINE_ACTIVE)"


def visible_gpu_selectors(env_value: str | None) -> list[str] | None:
    """Parse CUDA_VISIBLE_DEVICES into selectors; ``None`` means all GPUs."""
    if env_value is None:
        return None
    return [s.strip() for s in env_value.split(",") if s.strip()]


@dataclass(frozen=True, slots=True)
class NvmlGpu:
    """One physical GPU as NVML names it."""

    uuid: str  # "GPU-8f6c...": the key (the same GPU under any numbering)
    index: int  # NVML's index: PCI bus order
    name: str  # the model, e.g. "NVIDIA H100 80GB HBM3"
    handle: Any  # NVML's device handle


def load_nvml(nvml: Any = None, *, quiet: bool = False) -> Any | None:
    """``nvml`` (a module with pynvml's functions; default pynvml) after ``nvmlInit``; None without NVML.

    ``quiet``: its absence is logged at DEBUG (a probe before the sampler, which then says it once)."""
    try:
        module = nvml if nvml is not None else importlib.import_module("pynvml")
        module.nvmlInit()
    except Exception as err:  # noqa: BLE001 - any NVML failure means "n/a", by design
        (log.debug if quiet else log.info)("gpu metrics n/a (NVML unavailable: %s)", err)
        return None
    return module


def resolve_gpus(nvml: Any, selectors: list[str] | None, *, quiet: bool = False) -> list[NvmlGpu]:
    """The GPUs ``selectors`` name (None: every GPU NVML reports), in their order, each once (by UUID).

    ``quiet``: what is skipped is logged at DEBUG (a probe before the sampler, which then says it once).
    """
    info, warning = (log.debug, log.debug) if quiet else (log.info, log.warning)
    count = int(nvml.nvmlDeviceGetCount())
    wanted = [str(i) for i in range(count)] if selectors is None else selectors
    if mig := [s for s in wanted if s.startswith("MIG-")]:
        info("gpu metrics n/a for %s: %s", ",".join(mig), _MIG_HINT)
    opened: dict[int, NvmlGpu | None] = {}

    def by_index(index: int) -> NvmlGpu | None:
        if index not in opened:
            opened[index] = _open_index(nvml, index, warning)
        return opened[index]

    found: dict[str, NvmlGpu] = {}
    for selector in wanted:
        if selector.isdigit():
            gpu = by_index(int(selector))
        elif selector.startswith("GPU-"):
            gpu = next(
                (g for i in range(count) if (g := by_index(i)) is not None and g.uuid.startswith(selector)), None
            )
            if gpu is None:
                warning("gpu %s not sampled: NVML lists no GPU with that UUID", selector)
        else:
            gpu = None
        if gpu is not None:
            found.setdefault(gpu.uuid, gpu)
    return list(found.values())


def _open_index(nvml: Any, index: int, warning: Callable[..., None]) -> NvmlGpu | None:
    """NVML's GPU ``index``; None with one WARNING when NVML cannot open it."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        return NvmlGpu(_text(nvml.nvmlDeviceGetUUID(handle)), index, _text(nvml.nvmlDeviceGetName(handle)), handle)
    except Exception as err:  # noqa: BLE001 - one inaccessible GPU must not hide the others
        warning("gpu %d not sampled: NVML cannot open it (%s)", index, err)
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuSampler:
    """Background thread that samples NVML every ``interval_s`` seconds.

    ``nvml``: a module with pynvml's functions (tests inject a double); default pynvml.
    """

    def __init__(
        self, interval_s: float = 1.0, visible: str | None = None, use_env: bool = True, nvml: Any = None
    ) -> None:
        self._interval_s = interval_s
        raw = visible if visible is not None else (os.environ.get("CUDA_VISIBLE_DEVICES") if use_env else None)
        self._selectors = visible_gpu_selectors(raw)
        self._nvml_module = nvml
        self._nvml: Any = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._latest: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._gpus: list[NvmlGpu] = []

    def start(self) -> None:
        """Initialise NVML and start sampling; does nothing if NVML is unavailable."""
        if self._thread is not None or self._interval_s <= 0:
            return
        self._gpus = self._open()
        if not self._gpus:
            return
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (bounded join) and shut NVML down; safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT_S)
            self._thread = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutdown of an optional probe must not fail stop()
                pass
            self._nvml, self._gpus = None, []

    def snapshot(self) -> list[dict[str, Any]]:
        """Latest per-GPU samples (index, uuid, util_pct, mem_used_mib, mem_total_mib, power_w)."""
        with self._lock:
            return [dict(d) for d in self._latest]

    def _open(self) -> list[NvmlGpu]:
        self._nvml = load_nvml(self._nvml_module)
        if self._nvml is None:
            return []
        try:
            gpus = resolve_gpus(self._nvml, self._selectors)
        except Exception as err:  # noqa: BLE001 - NVML up but not answering: "n/a"
            log.info("gpu metrics n/a (NVML: %s)", err)
            gpus = []
        if not gpus:
            log.info("gpu metrics n/a (no visible GPU)")
        return gpus

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        nvml, out = self._nvml, []
        for gpu in self._gpus:
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(gpu.handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(gpu.handle)
            except Exception:  # noqa: BLE001 - a transient NVML error skips one sample
                continue
            try:
                power_w: float | None = nvml.nvmlDeviceGetPowerUsage(gpu.handle) / 1000.0
            except Exception:  # noqa: BLE001 - some boards do not report power: keep the rest
                power_w = None
            out.append(
                {
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "util_pct": float(util.gpu),
                    "mem_used_mib": mem.used / 2**20,
                    "mem_total_mib": mem.total / 2**20,
                    "power_w": power_w,
                }
            )
        with self._lock:
            self._latest = out


def format_gpus(samples: list[dict[str, Any]] | None) -> str:
    """The status-line part for GPUs: ``gpu model:0 97% 12.1/79.6 GiB 301 W data:1 12%``.

    Model GPUs show utilisation, memory and power; data GPUs only utilisation (the short form a
    status line has room for). ``None`` means sampling is off (empty string); ``[]`` gives ``gpu n/a``.
    """
    if samples is None:
        return ""
    if not samples:
        return "gpu n/a"
    parts = []
    for g in samples:
        text = f"{g.get('role', 'gpu')}:{g['index']} {g['util_pct']:.0f}%"
        if g.get("role") != "data":
            text += f" {g['mem_used_mib'] / 1024:.1f}/{g['mem_total_mib'] / 1024:.1f} GiB"
            if g.get("power_w") is not None:
                text += f" {g['power_w']:.0f} W"
        parts.append(text)
    return "gpu " + " ".join(parts)
