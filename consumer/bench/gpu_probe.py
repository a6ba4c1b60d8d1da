"""``python -m melfeed.consumer.bench.gpu_probe --out DIR``: the GPU half measured on a machine without TensorFlow.

Role: one prepared run for a GPU machine that has PyTorch, JAX and NVML but no TensorFlow (docs/performance.md
"The GPU hand-off on a real GPU" gives the command and how to carry melfeed and pyzmq there). Stages, each
written to its own JSON file in ``--out`` as soon as it ends, so a run cut short still reports what it measured:
    * ``env.json``: the GPU (name, UUID, PCI bus id, PCIe link generation and width, current and max, MIG mode),
      its NUMA node (sysfs), the driver, CUDA, torch and JAX versions, ``nvidia-smi topo -m``;
    * ``h2d.json``: host->device GB/s (CUDA events, median of ``_COPY_REPEATS``) of 9, 18 and 36 MB from
      pageable memory, from a ring slot (a ``MAP_SHARED`` mapping of a /dev/shm file, as the consumer's ring
      is), from the same slot after ``cudaHostRegister`` (pinned in place) and from torch's pinned memory,
      with how long the host was blocked by each copy call;
    * ``emulation.json``: TensorFlow's hand-off emulated in PyTorch with a step of about 5 ms and 20 ms (a
      matmul loop that reads the batch): ``serial`` is the pattern the TensorFlow semantics force on a
      naive loop (a blocking pageable copy ordered after the queued step, then the previous step's loss
      read with a full drain), ``interval`` the same with the loss read every ``_READ_EVERY`` steps,
      ``tf_ahead`` melfeed's TensorFlow hand-off as built (pinned slots, each batch's copy issued on the copy
      thread before the step ahead of it, ordered after the compute stream as it stood then), and
      ``overlapped`` the best a hand-off can do (one copy per batch from a pinned slot on a copy stream, the
      step waiting on the copy's event only, losses summed on the device and read every ``_READ_EVERY``
      steps, the slot free once the copy's event completed); feed efficiency of each = resident step time /
      fed period, with NVML utilisation sampled during it;
    * ``jax-5ms.json``, ``jax-20ms.json``: ``melfeed.consumer.clients.jax_bench`` (real producers, the
      shared-memory ring, the stager) with its MLP sized to a resident step of about 5 and 20 ms;
    * ``summary.json``: the goals (JAX feed efficiency >= 0.98 at 5 ms, NVML >= 95 %, the ``tf_ahead``
      emulation within 2 % of the JAX client) judged from what was measured.
Exit 0 when every stage ran, 1 when one failed (its error is in its file and in ``summary.json``), 69 when no
CUDA GPU is visible to torch (one line; ``env.json`` still says what was found).
Shutdown: every stage frees what it allocated (slot files unlinked, registered memory unregistered first).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "judge", "pick_width", "sysfs_numa_path", "efficiency"]

EXIT_NO_GPU = 69  # EX_UNAVAILABLE: nothing to measure here
_SIZES_MB = (9, 18, 36)  # the demo's largest float32 batch is about 9 MB; 2x and 4x for the slope
_COPY_REPEATS = 10
_STEP_TARGETS_MS = (5.0, 20.0)
_EMULATED_STEPS = 300
_READ_EVERY = 50  # a status interval's worth of steps between host reads of the summed loss
_SLOTS = 4  # ring slots of the emulation (consumer.ring_slots on a GPU)
_GOALS = {"jax_feed_efficiency_5ms": 0.98, "jax_gpu_util_pct_5ms": 95.0, "emulation_vs_jax": 0.02}
_JAX_WIDTHS = (256, 512, 1024, 2048, 4096, 8192)


def sysfs_numa_path(pci_bus_id: str) -> Path:
    """NVML's bus id ``00000000:19:00.0`` -> ``/sys/bus/pci/devices/0000:19:00.0/numa_node``."""
    domain, _, rest = pci_bus_id.strip().lower().partition(":")
    return Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}" / "numa_node"


def efficiency(resident_step_s: float, fed_period_s: float) -> float:
    """Feed efficiency: the resident step's time over the fed period (1.0: the limit no loader can beat)."""
    return resident_step_s / fed_period_s if fed_period_s > 0 else 0.0


def pick_width(step_ms_by_width: dict[int, float], target_ms: float) -> int:
    """The width whose measured step is nearest ``target_ms``, refined by the step's quadratic growth in width
    (an MLP's matmuls) between the two measured widths around the target; a multiple of 128."""
    widths = sorted(step_ms_by_width)
    below = [w for w in widths if step_ms_by_width[w] <= target_ms]
    above = [w for w in widths if step_ms_by_width[w] > target_ms]
    if not below:
        return widths[0]
    if not above:
        return widths[-1]
    low = below[-1]
    guess = low * (target_ms / max(step_ms_by_width[low], 1e-6)) ** 0.5
    return max(128, min(above[0], int(round(guess / 128)) * 128))


def judge(jax_runs: dict[str, Any], emulation: dict[str, Any]) -> dict[str, Any]:
    """The goals from what was measured: each one PASS, FAIL or not measured (None)."""

    def best(report: Any, key: str) -> float | None:
        runs = report.get("runs", []) if isinstance(report, dict) else []
        values = [r[key] for r in runs if r.get(key) is not None]
        return max(values) if values else None

    eff_5 = best(jax_runs.get("5ms"), "feed_efficiency")
    util_5 = best(jax_runs.get("5ms"), "gpu_util_pct")
    tf_ahead = (emulation.get("5ms") or {}).get("tf_ahead", {}).get("feed_efficiency")  # the TensorFlow pattern
    gap = None if eff_5 is None or tf_ahead is None else eff_5 - tf_ahead
    verdict = {"jax_feed_efficiency_5ms": eff_5, "jax_gpu_util_pct_5ms": util_5, "emulation_vs_jax": gap}
    passed = {
        "jax_feed_efficiency_5ms": eff_5 is not None and eff_5 >= _GOALS["jax_feed_efficiency_5ms"],
        "jax_gpu_util_pct_5ms": util_5 is not None and util_5 >= _GOALS["jax_gpu_util_pct_5ms"],
        "emulation_vs_jax": gap is not None and gap <= _GOALS["emulation_vs_jax"],
    }
    return {
        name: {
            "value": value,
            "goal": _GOALS[name],
            "verdict": None if value is None else ("PASS" if passed[name] else "FAIL"),
        }
        for name, value in verdict.items()
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m melfeed.consumer.bench.gpu_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON files (created)")
    ap.add_argument("--skip-jax", action="store_true", help="only the environment, H2D and emulation stages")
    ap.add_argument("--jax-steps", type=int, default=200, help="measured steps per jax_bench depth")
    ap.add_argument("--demo-utterances", type=int, default=600, help="demo cache size for jax_bench")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed: dict[str, str] = {}
    env = _stage(out, "env", _environment, failed)
    if not env.get("cuda_available"):
        print(
            f"gpu_probe: no CUDA GPU visible to torch ({env.get('why', 'unknown')}): nothing to measure",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    _stage(out, "h2d", _h2d_matrix, failed)
    emulation = _stage(out, "emulation", _emulation, failed)
    jax_runs: dict[str, Any] = {}
    if not args.skip_jax:
        for target in _STEP_TARGETS_MS:
            name = f"{target:.0f}ms"
            jax_runs[name] = _stage(out, f"jax-{name}", functools.partial(_jax_bench, out, target, args), failed)
    summary = {"goals": judge(jax_runs, emulation), "failed_stages": failed, "argv": sys.argv[1:]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(json.dumps(summary["goals"]))
    return 1 if failed else 0


def _stage(out: Path, name: str, run: Callable[[], dict[str, Any]], failed: dict[str, str]) -> dict[str, Any]:
    """Run one stage and write its file; a failure is recorded in the file and in ``failed``, never fatal."""
    started = time.perf_counter()
    try:
        result = run()
    except Exception as err:  # noqa: BLE001 - a stage's failure is a result; the next stage still runs
        failed[name] = f"{type(err).__name__}: {err}"
        result = {"error": failed[name], "traceback": traceback.format_exc()}
    result["stage_s"] = time.perf_counter() - started
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(f"gpu_probe: {name} done in {result['stage_s']:.1f} s" + (" (failed)" if name in failed else ""), flush=True)
    return result


def _environment() -> dict[str, Any]:
    """What the GPU is and where it sits; torch's and NVML's views side by side."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "cuda_available": False}
    try:
        import torch
    except ImportError as err:
        return found | {"why": f"no torch: {err}"}
    found |= {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": bool(torch.cuda.is_available()),
    }
    if not found["cuda_available"]:
        return found | {"why": "torch.cuda.is_available() is False"}
    found["torch_devices"] = [_torch_device(torch, i) for i in range(torch.cuda.device_count())]
    found["nvml"] = _nvml_devices()
    found["jax"] = _jax_version()
    found["topology"] = _command(["nvidia-smi", "topo", "-m"])
    found["numactl"] = _command(["numactl", "-H"])
    return found


def _torch_device(torch: Any, index: int) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(index)
    return {
        "index": index,
        "name": props.name,
        "uuid": str(getattr(props, "uuid", "")),
        "memory_gib": props.total_memory / 2**30,
        "sm_count": props.multi_processor_count,
    }


def _nvml_devices() -> list[dict[str, Any]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        rows = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            bus_id = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
            numa = sysfs_numa_path(bus_id)
            rows.append(
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "pci_bus_id": bus_id,
                    "numa_node": numa.read_text().strip() if numa.exists() else None,
                    "pcie_gen": [
                        _nvml(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
                        _nvml(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                    ],
                    "pcie_width": [
                        _nvml(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
                        _nvml(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
                    ],
                    "mig_mode": _nvml(pynvml.nvmlDeviceGetMigMode, handle),
                    "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                }
            )
        return rows
    finally:
        pynvml.nvmlShutdown()


def _nvml(query: Callable[[Any], Any], handle: Any) -> Any:
    try:
        return query(handle)
    except Exception as err:  # noqa: BLE001 - one field NVML cannot give is recorded, not fatal
        return f"n/a: {err}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _jax_version() -> str | None:
    try:
        import jax
    except ImportError:
        return None
    return str(jax.__version__)


def _command(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def _h2d_matrix() -> dict[str, Any]:
    import numpy as np
    import torch

    from melfeed.consumer.bench.gpu_handoff import registered, shm_slot

    rows = []
    for size_mb in _SIZES_MB:
        nbytes = size_mb * 2**20
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pageable = np.ones(nbytes, np.uint8)
        rows.append(_copy_row("pageable", size_mb, torch.from_numpy(pageable), device))
        with shm_slot(nbytes) as mapped:
            slot = np.frombuffer(mapped, np.uint8)
            slot[:] = 1
            rows.append(_copy_row("slot", size_mb, torch.from_numpy(slot), device))
            started = time.perf_counter()
            with registered(torch, slot):
                register_s = time.perf_counter() - started
                rows.append(
                    _copy_row("slot_pinned", size_mb, torch.from_numpy(slot), device)
                    | {"register_ms": 1000 * register_s}
                )
            del slot
        pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
        rows.append(_copy_row("torch_pinned", size_mb, pinned, device))
        del device, pinned
    return {"rows": rows, "repeats": _COPY_REPEATS}


def _copy_row(source: str, size_mb: int, host: Any, device: Any) -> dict[str, Any]:
    """Median GB/s of ``device.copy_(host, non_blocking=True)`` by CUDA events, and the host's blocked time."""
    import torch

    gbps, blocked_ms = [], []
    for _ in range(_COPY_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        call_started = time.perf_counter()
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        blocked_ms.append(1000 * (time.perf_counter() - call_started))
        end.synchronize()
        gbps.append(host.numel() / (start.elapsed_time(end) / 1000) / 1e9)
    return {
        "source": source,
        "size_mb": size_mb,
        "gb_per_s": statistics.median(gbps),
        "host_blocked_ms": statistics.median(blocked_ms),
    }


def _emulation() -> dict[str, Any]:
    from melfeed.consumer.bench.gpu_handoff import emulate

    return {f"{target:.0f}ms": emulate(target, _EMULATED_STEPS, _READ_EVERY, _SLOTS) for target in _STEP_TARGETS_MS}


def _jax_bench(out: Path, target_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    """``jax_bench`` with its MLP sized so the resident step takes about ``target_ms``."""
    from melfeed.consumer.bench.gpu_handoff import jax_step_ms

    by_width: dict[int, float] = {}
    for width in _JAX_WIDTHS:
        by_width[width] = jax_step_ms(width)
        if by_width[width] > target_ms:
            break
    width = pick_width(by_width, target_ms)
    report = out / f"jax-{target_ms:.0f}ms-raw.json"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    argv = [
        sys.executable,
        "-m",
        "melfeed.consumer.clients.jax_bench",
        "--demo",
        "--demo-utterances",
        str(args.demo_utterances),
        "--depths",
        "1,2",
        "--steps",
        str(args.jax_steps),
        "--warmup",
        "20",
        "--hidden",
        str(width),
        "--layers",
        "4",
        "--json",
        str(report),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"jax_bench exited {proc.returncode}: {proc.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(report.read_text(encoding="utf-8"))
    report.unlink()
    return result | {"target_ms": target_ms, "calibration_ms_by_width": by_width, "stdout": proc.stdout}


if __name__ == "__main__":
    sys.exit(main())
