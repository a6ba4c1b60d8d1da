"""Environment checks of ``melfeed doctor``: GPUs, memory, /dev/shm, the socket directory.

Role: ``gather_facts`` reads the machine once (NVML through ``melfeed.consumer.observe.gpu``, ``/proc/meminfo``,
``statvfs``, the runtime directory's mode); ``check_environment`` is a pure function of those
``EnvFacts``, so tests inject facts (same GPU on both sides, a runtime dir with mode 0755) without
touching the machine. Each check is one line: ok / warn / fail / n/a with its reason.
Invariants: gathering never raises for a missing tool (no NVML, no /dev/shm): the fact is None and
the check says n/a. Nothing here creates or changes a file.
Shutdown: the NVML sampler is stopped before ``gather_facts`` returns.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EnvFacts", "Check", "gather_facts", "check_environment", "mem_available_bytes"]

_MEM_WARN_FRACTION = 0.5  # the in-flight bound may take at most half of the free memory quietly
_RUNTIME_MODES_OK = (0o700, 0o770)  # 0770 when systemd's RuntimeDirectoryMode grants the group


@dataclass(frozen=True, slots=True)
class EnvFacts:
    consumer_gpus: list[str] | None  # NVML indices visible to the consumer; None = NVML n/a
    producer_gpus: list[str] | None  # ... to the producers
    model_gpu: str | None  # consumer.model_gpu (None = inherit)
    data_gpu: str  # producer.data_gpu ("" = CPU only)
    mem_available_bytes: int | None  # MemAvailable; None = unknown
    shm_free_bytes: int | None  # free bytes in /dev/shm; None = no /dev/shm
    ring_bytes: int  # ring slots x slot bytes
    in_flight_bytes: int  # the in-flight bound (ring + lease windows)
    runtime_dir: str
    runtime_exists: bool
    runtime_mode: int | None  # permission bits, when it exists
    runtime_writable: bool  # writable (or its nearest existing parent is, to create it)


@dataclass(frozen=True, slots=True)
class Check:
    status: str  # "ok", "warn", "fail" or "n/a"
    name: str
    reason: str

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.reason}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _gpu_check(side: str, key: str, gpus: list[str] | None) -> Check:
    if gpus is None:
        return Check("n/a", f"GPUs ({side})", "NVML unavailable (no driver or GPU): running on the CPU")
    if not gpus:
        return Check("ok", f"GPUs ({side})", f"none visible ({key}); CPU only")
    return Check("ok", f"GPUs ({side})", f"{len(gpus)} visible: {','.join(gpus)} ({key})")


def _split_gpu_check(f: EnvFacts) -> Check:
    name = "model vs data GPU"
    data = {g for g in f.data_gpu.split(",") if g}
    if not data:
        return Check("ok", name, "producers use no GPU (producer.data_gpu is empty)")
    if f.model_gpu is None:
        shared = data & set(f.consumer_gpus or []) if f.consumer_gpus is not None else data
        if shared:
            return Check(
                "warn",
                name,
                f"consumer.model_gpu is unset (the consumer inherits every GPU) and "
                f"producer.data_gpu={f.data_gpu}: the model may land on the data GPU",
            )
        return Check("ok", name, f"producers use GPU {f.data_gpu}, the consumer sees only others")
    same = data & {g for g in f.model_gpu.split(",") if g}
    if same:
        # producers reading a cache do no GPU work (docs/guide/two-gpus.md): nothing competes today
        return Check(
            "warn",
            name,
            f"consumer.model_gpu={f.model_gpu} and producer.data_gpu={f.data_gpu} "
            f"name the same GPU {','.join(sorted(same))}; producers reading a cache do no GPU "
            'work, so set producer.data_gpu: "" to keep anything else off the model\'s GPU',
        )
    return Check("ok", name, f"model on {f.model_gpu}, data on {f.data_gpu}")


def check_environment(f: EnvFacts) -> list[Check]:
    """One check per concern, in a fixed order."""
    out = [
        _gpu_check("consumer", f"consumer.model_gpu={f.model_gpu}", f.consumer_gpus),
        _gpu_check("producers", f"producer.data_gpu={f.data_gpu!r}", f.producer_gpus),
        _split_gpu_check(f),
    ]
    if f.mem_available_bytes is None:
        out.append(Check("n/a", "memory", "MemAvailable unknown (no /proc/meminfo)"))
    else:
        status = (
            "fail"
            if f.in_flight_bytes > f.mem_available_bytes
            else "warn"
            if f.in_flight_bytes > _MEM_WARN_FRACTION * f.mem_available_bytes
            else "ok"
        )
        out.append(
            Check(
                status,
                "memory",
                f"in-flight bound {_mb(f.in_flight_bytes)} vs MemAvailable {_mb(f.mem_available_bytes)}",
            )
        )
    if f.shm_free_bytes is None:
        out.append(Check("n/a", "/dev/shm", "not mounted (a shared-memory ring needs it)"))
    else:
        status = "fail" if f.ring_bytes > f.shm_free_bytes else "warn" if f.in_flight_bytes > f.shm_free_bytes else "ok"
        out.append(
            Check(
                status,
                "/dev/shm",
                f"{_mb(f.shm_free_bytes)} free vs ring {_mb(f.ring_bytes)} (+ lease windows: {_mb(f.in_flight_bytes)})",
            )
        )
    out.append(_runtime_check(f))
    return out


def _runtime_check(f: EnvFacts) -> Check:
    name = "socket directory"
    if not f.runtime_exists:
        if f.runtime_writable:
            return Check("ok", name, f"{f.runtime_dir} does not exist yet; it will be created with mode 0700")
        return Check("fail", name, f"{f.runtime_dir} does not exist and cannot be created (parent not writable)")
    if not f.runtime_writable:
        return Check("fail", name, f"{f.runtime_dir} is not writable: the socket cannot be bound there")
    if f.runtime_mode not in _RUNTIME_MODES_OK:
        mode = f"{f.runtime_mode:04o}" if f.runtime_mode is not None else "?"
        return Check(
            "warn", name, f"{f.runtime_dir} has mode {mode}, want 0700: other users could reach the socket (chmod 700)"
        )
    return Check("ok", name, f"{f.runtime_dir} exists, mode {f.runtime_mode:04o}, writable")


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes, or None when the file or line is missing."""
    try:
        for line in Path(meminfo).read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - any NVML failure means "n/a", as in melfeed.consumer.observe.gpu
        return False


def _visible_gpus(selector: str | None) -> list[str]:
    """NVML indices visible under CUDA_VISIBLE_DEVICES=selector (None = every GPU)."""
    from melfeed.consumer.observe.gpu import GpuSampler

    sampler = GpuSampler(interval_s=60.0, visible=selector, use_env=False)
    try:
        sampler.start()
        return [str(s["index"]) for s in sampler.snapshot()]
    finally:
        sampler.stop()


def _writable(path: Path) -> bool:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.access(probe, os.W_OK | os.X_OK)


def gather_facts(
    model_gpu: str | None,
    data_gpu: str,
    runtime_dir: Path,
    ring_bytes: int,
    in_flight_bytes: int,
    environ: Mapping[str, str],
) -> EnvFacts:
    """Read the machine once (see the module docstring)."""
    consumer_sel = model_gpu if model_gpu is not None else environ.get("CUDA_VISIBLE_DEVICES")
    has_nvml = _nvml_available()
    consumer = _visible_gpus(consumer_sel) if has_nvml else None
    producer = _visible_gpus(data_gpu) if has_nvml else None
    try:
        st = os.statvfs("/dev/shm")
        shm: int | None = st.f_bavail * st.f_frsize
    except OSError:
        shm = None
    try:
        mode: int | None = stat.S_IMODE(runtime_dir.stat().st_mode)
        exists = runtime_dir.is_dir()
    except OSError:
        mode, exists = None, False
    return EnvFacts(
        consumer_gpus=consumer,
        producer_gpus=producer,
        model_gpu=model_gpu,
        data_gpu=data_gpu,
        mem_available_bytes=mem_available_bytes(),
        shm_free_bytes=shm,
        ring_bytes=ring_bytes,
        in_flight_bytes=in_flight_bytes,
        runtime_dir=str(runtime_dir),
        runtime_exists=exists,
        runtime_mode=mode,
        runtime_writable=_writable(runtime_dir),
    )
