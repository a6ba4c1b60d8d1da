"""Environment checks of the doctor with injected facts (no NVML, /proc or /dev/shm needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from melfeed.consumer.doctor.env import EnvFacts, check_environment, gather_facts, mem_available_bytes

GOOD = EnvFacts(
    consumer_gpus=["0"],
    producer_gpus=["1"],
    model_gpu="0",
    data_gpu="1",
    mem_available_bytes=16_000_000_000,
    shm_free_bytes=8_000_000_000,
    ring_bytes=27_000_000,
    in_flight_bytes=63_000_000,
    runtime_dir="/run/melfeed",
    runtime_exists=True,
    runtime_mode=0o700,
    runtime_writable=True,
)


def _by_name(facts: EnvFacts) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.reason) for c in check_environment(facts)}


def test_good_machine_is_all_ok() -> None:
    assert {status for status, _ in _by_name(GOOD).values()} == {"ok"}


def test_same_gpu_for_model_and_data_is_a_warn_line_naming_both_keys() -> None:
    status, reason = _by_name(dataclasses.replace(GOOD, data_gpu="0,2"))["model vs data GPU"]
    assert status == "warn" and "do no GPU work" in reason
    assert "consumer.model_gpu=0" in reason and "producer.data_gpu=0,2" in reason


def test_unset_model_gpu_that_sees_the_data_gpu_warns() -> None:
    status, _ = _by_name(dataclasses.replace(GOOD, model_gpu=None, consumer_gpus=["0", "1"]))["model vs data GPU"]
    assert status == "warn"


def test_no_nvml_is_na_not_a_failure() -> None:
    checks = _by_name(dataclasses.replace(GOOD, consumer_gpus=None, producer_gpus=None, data_gpu=""))
    assert checks["GPUs (consumer)"][0] == checks["GPUs (producers)"][0] == "n/a"


def test_runtime_dir_with_bad_mode_warns_and_unwritable_fails() -> None:
    status, reason = _by_name(dataclasses.replace(GOOD, runtime_mode=0o755))["socket directory"]
    assert status == "warn" and "0755" in reason
    assert _by_name(dataclasses.replace(GOOD, runtime_mode=0o770))["socket directory"][0] == "ok"
    assert _by_name(dataclasses.replace(GOOD, runtime_writable=False))["socket directory"][0] == "fail"
    missing = dataclasses.replace(GOOD, runtime_exists=False, runtime_mode=None)
    assert _by_name(missing)["socket directory"][0] == "ok"
    assert _by_name(dataclasses.replace(missing, runtime_writable=False))["socket directory"][0] == "fail"


def test_memory_and_shm_against_the_in_flight_bound() -> None:
    assert _by_name(dataclasses.replace(GOOD, mem_available_bytes=60_000_000))["memory"][0] == "fail"
    assert _by_name(dataclasses.replace(GOOD, mem_available_bytes=100_000_000))["memory"][0] == "warn"
    assert _by_name(dataclasses.replace(GOOD, shm_free_bytes=20_000_000))["/dev/shm"][0] == "fail"
    assert _by_name(dataclasses.replace(GOOD, shm_free_bytes=50_000_000))["/dev/shm"][0] == "warn"
    assert _by_name(dataclasses.replace(GOOD, shm_free_bytes=None))["/dev/shm"][0] == "n/a"


def test_mem_available_parses_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:    1000 kB\n")
    assert mem_available_bytes(str(meminfo)) == 1000 * 1024
    assert mem_available_bytes(str(tmp_path / "missing")) is None


def test_gather_reads_the_runtime_dir_mode(tmp_path: Path) -> None:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o755)
    rt.chmod(0o755)
    facts = gather_facts(None, "", rt, 1, 2, {})
    assert (facts.runtime_exists, facts.runtime_mode, facts.runtime_writable) == (True, 0o755, True)
    assert gather_facts(None, "", tmp_path / "new" / "rt", 1, 2, {}).runtime_exists is False
