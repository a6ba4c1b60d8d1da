"""`melfeed run` applies consumer.model_gpu before TensorFlow loads (one it cannot see is exit 78), names the device
the step ran on, and fills the persistent XLA compilation cache that a second run (another state dir, same cache)
finds warm; every melfeed process, and a prepare worker, numbers GPUs in PCI bus order."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from melfeed.producer.prepare.worker import WorkerSpec, _open_device
from melfeed.shared.config import FeatureConfig
from tests import procs
from tests.conftest import REPO


def _run(cfg: dict[str, object], tmp_path: Path, name: str, demo_cache: Path) -> dict[str, object]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    summary = tmp_path / f"{name}.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "run",
            "--config",
            str(path),
            "--cache-dir",
            str(demo_cache),
            "--producers",
            "1",
            "--steps",
            "6",
            "--state-dir",
            str(tmp_path / name),
            "--summary-json",
            str(summary),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "placement: CUDA_VISIBLE_DEVICES=, 0 GPU(s) visible, memory growth" in proc.stderr  # applied, logged
    return dict(json.loads(summary.read_text()))


def test_the_summary_names_the_device_and_a_restart_finds_the_xla_cache_warm(demo_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "xla-shared"
    cfg = {
        "buckets": {"num_buckets": 1, "batch_size": 16},
        "model": {"step": procs.TINY_STEP, "jit_compile": True},
        "consumer": {"model_gpu": "", "xla_cache_dir": str(cache), "warmup_steps": 1, "feed_efficiency_steps": 0},
    }
    cold = _run(cfg, tmp_path, "cold", demo_cache)
    assert cold["jit_compile"] == "xla"
    assert cold["devices"] == ["/job:localhost/replica:0/task:0/device:CPU:0"]  # model_gpu "" hides every GPU
    assert isinstance(cold["time_to_first_step_s"], float) and cold["time_to_first_step_s"] > 0
    active = Path(str(cold["xla_cache_dir"]))
    assert active.parent == cache.resolve() and cold["xla_cache_warm"] is False  # a namespace in the cache
    assert list(active.glob("*.pb")), "no compiled program in the XLA cache"
    warm = _run(cfg, tmp_path, "warm", demo_cache)  # a fresh state dir sharing the cache
    assert warm["xla_cache_warm"] is True and warm["steps"] == 6


def test_a_bad_model_gpu_is_one_line_and_exit_78(demo_cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"consumer": {"model_gpu": "gpu1"}}))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed", "run", "--config", str(path), "--cache-dir", str(demo_cache)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 78
    assert proc.stderr.strip().splitlines()[-1].startswith("melfeed run: consumer.model_gpu: entry 'gpu1'")


def test_a_model_gpu_tensorflow_does_not_see_is_one_line_and_exit_78_not_a_run_on_the_cpu(
    demo_cache: Path, tmp_path: Path
) -> None:
    path = tmp_path / "gpu.yaml"  # this machine has no GPU: TensorFlow sees none
    path.write_text(yaml.safe_dump({"model": {"step": procs.TINY_STEP}, "consumer": {"model_gpu": "0"}}))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "run",
            "--config",
            str(path),
            "--cache-dir",
            str(demo_cache),
            "--producers",
            "1",
            "--steps",
            "2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("melfeed run: ")]  # producers log after it
    assert len(said) == 1 and said[0].startswith(
        "melfeed run: consumer.model_gpu: names 1 GPU(s) but TensorFlow sees no GPU"
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "step compiled" not in proc.stderr


def test_every_melfeed_process_and_its_children_number_gpus_in_pci_bus_order() -> None:
    child = "import os; print(os.environ.get('CUDA_DEVICE_ORDER'))"
    code = (
        "import subprocess, sys\n"
        "import melfeed.cli as cli\n"
        f"cli.main = lambda argv=None: subprocess.call([sys.executable, '-c', {child!r}])\n"
        "cli.console_main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"}
    unset = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert unset.stdout.strip() == "PCI_BUS_ID", unset.stderr[-2000:]
    chosen = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**env, "CUDA_DEVICE_ORDER": "FASTEST_FIRST"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert chosen.stdout.strip() == "FASTEST_FIRST"  # the user's own choice stays


def _device_env(spec: WorkerSpec, out: Any) -> None:
    os.environ["CUDA_DEVICE_ORDER"] = "FASTEST_FIRST"  # as a user's shell might have it
    _open_device(spec)
    out.put({k: os.environ.get(k) for k in ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES")})


def test_a_prepare_worker_sets_its_data_gpu_in_pci_bus_order() -> None:
    ctx = multiprocessing.get_context("spawn")  # as the prepare pool starts its workers
    out = ctx.Queue()
    spec = WorkerSpec(cache_dir="", features=FeatureConfig(), n_mels=80, data_gpu="", gpu_memory_limit_mb=None)
    proc = ctx.Process(target=_device_env, args=(spec, out))
    proc.start()
    try:
        assert out.get(timeout=120) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ""}
    finally:
        proc.join(30)
    assert proc.exitcode == 0
