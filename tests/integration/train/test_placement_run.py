"""`melfeed run` applies consumer.model_gpu before TensorFlow loads, names the device the step ran on,
and fills the persistent XLA compilation cache that a second run (another state dir, same cache) finds warm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests import procs
from tests.conftest import REPO


def _run(cfg: dict[str, object], tmp_path: Path, name: str, demo_cache: Path) -> dict[str, object]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    summary = tmp_path / f"{name}.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-m", "melfeed", "run", "--config", str(path),
                           "--cache-dir", str(demo_cache), "--producers", "1", "--steps", "6",
                           "--state-dir", str(tmp_path / name), "--summary-json", str(summary)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "placement: CUDA_VISIBLE_DEVICES=, 0 GPU(s) visible, memory growth" in proc.stderr   # applied, logged
    return dict(json.loads(summary.read_text()))


def test_the_summary_names_the_device_and_a_restart_finds_the_xla_cache_warm(demo_cache: Path,
                                                                            tmp_path: Path) -> None:
    cache = tmp_path / "xla-shared"
    cfg = {"buckets": {"num_buckets": 1, "batch_size": 16}, "model": {"step": procs.TINY_STEP, "jit_compile": True},
           "consumer": {"model_gpu": "", "xla_cache_dir": str(cache), "warmup_steps": 1}}
    cold = _run(cfg, tmp_path, "cold", demo_cache)
    assert cold["jit_compile"] == "xla"
    assert cold["devices"] == ["/job:localhost/replica:0/task:0/device:CPU:0"]   # model_gpu "" hides every GPU
    assert isinstance(cold["time_to_first_step_s"], float) and cold["time_to_first_step_s"] > 0
    assert cold["xla_cache_dir"] == str(cache.resolve()) and cold["xla_cache_warm"] is False
    assert list(cache.glob("*.pb")), "no compiled program in the XLA cache"
    warm = _run(cfg, tmp_path, "warm", demo_cache)                    # a fresh state dir sharing the cache
    assert warm["xla_cache_warm"] is True and warm["steps"] == 6


def test_a_bad_model_gpu_is_one_line_and_exit_78(demo_cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"consumer": {"model_gpu": "gpu1"}}))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "melfeed", "run", "--config", str(path),
                           "--cache-dir", str(demo_cache)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 78
    assert proc.stderr.strip().splitlines()[-1].startswith("melfeed run: consumer.model_gpu: entry 'gpu1'")
