from __future__ import annotations

from types import SimpleNamespace

import pynvml  # type: ignore[import-untyped]  # no stubs shipped
import pytest

from melfeed.consumer.observe.gpu import GpuSampler, format_gpus


def test_absent_nvml_gives_empty_snapshot_and_no_crash() -> None:
    s = GpuSampler(interval_s=0.01, use_env=False)
    s.start()
    s.start()
    assert s.snapshot() == []
    s.stop()
    s.stop()


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates",
                        lambda h: SimpleNamespace(gpu=40 + h, memory=0))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda h: SimpleNamespace(used=2**30, total=2**32, free=0))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", lambda h: 150_000)


def test_present_nvml_samples_visible_gpus(fake_nvml: None) -> None:
    s = GpuSampler(interval_s=60.0, visible="1")
    s.start()
    try:
        assert s.snapshot() == [{"index": 1, "util_pct": 41.0, "mem_used_mib": 1024.0,
                                 "mem_total_mib": 4096.0, "power_w": 150.0}]
    finally:
        s.stop()


def test_present_nvml_all_gpus_when_unset(fake_nvml: None) -> None:
    s = GpuSampler(interval_s=60.0, use_env=False)
    s.start()
    try:
        assert [d["index"] for d in s.snapshot()] == [0, 1]
    finally:
        s.stop()


def test_power_unsupported_keeps_the_other_figures(fake_nvml: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_power(h: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", no_power)
    s = GpuSampler(interval_s=60.0, visible="0")
    s.start()
    try:
        assert s.snapshot() == [{"index": 0, "util_pct": 40.0, "mem_used_mib": 1024.0,
                                 "mem_total_mib": 4096.0, "power_w": None}]
    finally:
        s.stop()


def test_status_text_without_gpus_says_n_a_and_is_empty_when_off() -> None:
    assert format_gpus([]) == "gpu n/a"
    assert format_gpus(None) == ""


def test_status_text_from_sampled_gpus(fake_nvml: None) -> None:
    model, data = GpuSampler(interval_s=60.0, visible="0"), GpuSampler(interval_s=60.0, visible="1")
    model.start()
    data.start()
    try:
        samples = ([{"role": "model", **g} for g in model.snapshot()]
                   + [{"role": "data", **g} for g in data.snapshot()])
    finally:
        model.stop()
        data.stop()
    assert format_gpus(samples) == "gpu model:0 40% 1.0/4.0 GiB 150 W data:1 41%"
