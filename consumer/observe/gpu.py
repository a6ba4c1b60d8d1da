"""NVML sampler: utilisation %, memory used/total and power of the GPUs this process can see.

Visible GPUs: when CUDA_VISIBLE_DEVICES is set, only the devices it names are sampled, in its
order; entries may be NVML indices ("0,2") or UUIDs/UUID prefixes ("GPU-5d3a..."); an empty
value means no GPUs. Unset means every GPU NVML reports. The environment is read once, in
``GpuSampler.__init__`` (the process boundary), not deep in the sampling loop.
Absent NVML, driver or GPU: ``snapshot()`` returns ``[]`` and one INFO line is logged; never raises.
Shutdown: ``stop()`` sets an event and joins the thread with a bounded timeout; start/stop idempotent.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

__all__ = ["GpuSampler", "visible_gpu_selectors", "format_gpus"]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 2.0  # > one NVML query round (milliseconds) plus one interval wait slice


def visible_gpu_selectors(env_value: str | None) -> list[str] | None:
    """Parse CUDA_VISIBLE_DEVICES into selectors; ``None`` means all GPUs."""
    if env_value is None:
        return None
    return [s.strip() for s in env_value.split(",") if s.strip()]


class GpuSampler:
    """Background thread that samples NVML every ``interval_s`` seconds."""

    def __init__(self, interval_s: float = 1.0, visible: str | None = None,
                 use_env: bool = True) -> None:
        self._interval_s = interval_s
        raw = visible if visible is not None else (
            os.environ.get("CUDA_VISIBLE_DEVICES") if use_env else None)
        self._selectors = visible_gpu_selectors(raw)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._latest: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._handles: list[tuple[int, Any]] | None = None

    def start(self) -> None:
        """Initialise NVML and start sampling; does nothing if NVML is unavailable."""
        if self._thread is not None or self._interval_s <= 0:
            return
        self._handles = self._open()
        if not self._handles:
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
        if self._handles:
            try:
                import pynvml  # type: ignore[import-untyped]  # no stubs shipped
                pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutdown of an optional probe must not fail stop()
                pass
            self._handles = None

    def snapshot(self) -> list[dict[str, Any]]:
        """Latest per-GPU samples (index, util_pct, mem_used_mib, mem_total_mib, power_w)."""
        with self._lock:
            return [dict(d) for d in self._latest]

    def _open(self) -> list[tuple[int, Any]]:
        try:
            import pynvml  # type: ignore[import-untyped]  # no stubs shipped
            pynvml.nvmlInit()
            handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i))
                       for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as err:  # noqa: BLE001 - any NVML failure means "n/a", by design
            log.info("gpu metrics n/a (NVML unavailable: %s)", err)
            return []
        if self._selectors is not None:
            handles = [h for h in handles if _is_selected(pynvml, h, self._selectors)]
        if not handles:
            log.info("gpu metrics n/a (no visible GPU)")
        return handles

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        import pynvml  # type: ignore[import-untyped]  # no stubs shipped
        out = []
        for index, h in self._handles or []:
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            except Exception:  # noqa: BLE001 - a transient NVML error skips one sample
                continue
            try:
                power_w: float | None = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            except Exception:  # noqa: BLE001 - some boards do not report power: keep the rest
                power_w = None
            out.append({"index": index, "util_pct": float(util.gpu),
                        "mem_used_mib": mem.used / 2**20, "mem_total_mib": mem.total / 2**20,
                        "power_w": power_w})
        with self._lock:
            self._latest = out


def _is_selected(pynvml: Any, handle: tuple[int, Any], selectors: list[str]) -> bool:
    """True when a CUDA_VISIBLE_DEVICES entry names this GPU by index or UUID prefix."""
    if str(handle[0]) in selectors:
        return True
    try:
        uuid = pynvml.nvmlDeviceGetUUID(handle[1])
    except Exception:  # noqa: BLE001 - no UUID means index selectors only
        return False
    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return any(s.startswith("GPU-") and uuid.startswith(s) for s in selectors)


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
