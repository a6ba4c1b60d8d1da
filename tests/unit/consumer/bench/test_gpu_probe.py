"""The GPU probe's pure parts, and its refusal on a machine without a CUDA GPU (this one, and CI's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from melfeed.consumer.bench.gpu_probe import EXIT_NO_GPU, efficiency, judge, pick_width, sysfs_numa_path


def test_the_numa_node_of_an_nvml_bus_id_is_read_from_its_sysfs_device() -> None:
    assert sysfs_numa_path("00000000:19:00.0") == Path("/sys/bus/pci/devices/0000:19:00.0/numa_node")
    assert sysfs_numa_path("0000000A:C1:00.0\n") == Path("/sys/bus/pci/devices/000a:c1:00.0/numa_node")


def test_feed_efficiency_is_the_resident_step_over_the_fed_period() -> None:
    assert efficiency(0.005, 0.0050505) == 0.005 / 0.0050505
    assert efficiency(0.005, 0.0) == 0.0


def test_the_width_is_interpolated_between_the_measured_steps_around_the_target() -> None:
    measured = {256: 1.0, 512: 2.5, 1024: 9.0, 2048: 40.0}
    assert pick_width(measured, 5.0) == 768  # 512 * sqrt(5 / 2.5) = 724, a multiple of 128 above
    assert pick_width(measured, 20.0) == 1536  # 1024 * sqrt(20 / 9) = 1526
    assert pick_width(measured, 0.5) == 256  # below every measurement: the smallest
    assert pick_width(measured, 100.0) == 2048  # above every measurement: the largest


def test_the_goals_pass_fail_or_stay_unmeasured_from_the_runs() -> None:
    jax = {
        "5ms": {
            "runs": [{"feed_efficiency": 0.95, "gpu_util_pct": 97.0}, {"feed_efficiency": 0.985, "gpu_util_pct": None}]
        }
    }
    emulation = {"5ms": {"tf_ahead": {"feed_efficiency": 0.97}, "overlapped": {"feed_efficiency": 0.5}}}
    goals = judge(jax, emulation)
    assert goals["jax_feed_efficiency_5ms"] == {"value": 0.985, "goal": 0.98, "verdict": "PASS"}
    assert goals["jax_gpu_util_pct_5ms"]["verdict"] == "PASS"
    assert goals["emulation_vs_jax"]["verdict"] == "PASS" and abs(goals["emulation_vs_jax"]["value"] - 0.015) < 1e-12
    slow = judge(jax, {"5ms": {"tf_ahead": {"feed_efficiency": 0.90}, "overlapped": {"feed_efficiency": 0.99}}})
    assert slow["emulation_vs_jax"]["verdict"] == "FAIL"
    unmeasured = judge({"5ms": {"error": "jax_bench exited 1"}}, {})
    assert {g["verdict"] for g in unmeasured.values()} == {None}


def test_without_a_cuda_gpu_the_probe_says_so_in_one_line_and_records_why(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed.consumer.bench.gpu_probe", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_NO_GPU, proc.stderr
    assert proc.stderr.strip().startswith("gpu_probe: no CUDA GPU visible to torch (")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    env = json.loads((tmp_path / "out" / "env.json").read_text())
    assert env["cuda_available"] is False and env["why"]
    assert not (tmp_path / "out" / "h2d.json").exists()  # nothing was measured on a machine without one
