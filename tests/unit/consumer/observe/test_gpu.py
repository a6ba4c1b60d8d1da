"""The NVML sampler against a double of the pynvml module: which GPUs it samples, keyed by UUID, and what it
does with MIG selectors and a GPU NVML cannot open."""

from __future__ import annotations

import logging

import pytest

from melfeed.consumer.observe.gpu import GpuSampler, format_gpus, resolve_gpus
from tests.fakes import FakeNvml
from tests.fakes import NvmlError as _NvmlError

_UUIDS = ["GPU-aaaa-0000", "GPU-bbbb-1111", "GPU-cccc-2222"]


def _sampled(nvml: FakeNvml, visible: str | None) -> list[dict[str, object]]:
    sampler = GpuSampler(interval_s=60.0, visible=visible, use_env=False, nvml=nvml)
    sampler.start()
    try:
        return sampler.snapshot()
    finally:
        sampler.stop()


def test_absent_nvml_gives_empty_snapshot_and_no_crash() -> None:
    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise _NvmlError("Driver Not Loaded")

    s = GpuSampler(interval_s=0.01, use_env=False, nvml=NoDriver([]))
    s.start()
    s.start()
    assert s.snapshot() == []
    s.stop()
    s.stop()


def test_an_index_selects_that_nvml_gpu_and_the_sample_carries_its_uuid() -> None:
    assert _sampled(FakeNvml(_UUIDS), "1") == [
        {
            "index": 1,
            "uuid": "GPU-bbbb-1111",
            "util_pct": 41.0,
            "mem_used_mib": 1024.0,
            "mem_total_mib": 4096.0,
            "power_w": 150.0,
        }
    ]


def test_every_gpu_when_unset_and_none_when_empty() -> None:
    assert [d["index"] for d in _sampled(FakeNvml(_UUIDS), None)] == [0, 1, 2]
    assert _sampled(FakeNvml(_UUIDS), "") == []


def test_a_uuid_or_its_prefix_selects_the_same_gpu_once_whatever_the_numbering() -> None:
    nvml = FakeNvml(_UUIDS)
    nvml.nvmlInit()
    gpus = resolve_gpus(nvml, ["GPU-cccc", "2", "GPU-aaaa-0000"])
    assert [(g.uuid, g.index) for g in gpus] == [("GPU-cccc-2222", 2), ("GPU-aaaa-0000", 0)]


def test_a_mig_selector_is_not_sampled_and_one_info_line_names_dcgm(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="melfeed.consumer.observe.gpu"):
        assert [d["uuid"] for d in _sampled(FakeNvml(_UUIDS), "MIG-1234-5678,0")] == ["GPU-aaaa-0000"]
    mig = [r for r in caplog.records if "MIG-1234-5678" in r.getMessage()]
    assert len(mig) == 1 and mig[0].levelno == logging.INFO and "DCGM" in mig[0].getMessage()


def test_an_inaccessible_gpu_is_skipped_alone_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="melfeed.consumer.observe.gpu"):
        samples = _sampled(FakeNvml(_UUIDS, broken=(1,)), None)
    assert [d["index"] for d in samples] == [0, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["gpu 1 not sampled: NVML cannot open it (Insufficient Permissions)"]


def test_a_uuid_nvml_does_not_list_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.observe.gpu"):
        assert _sampled(FakeNvml(_UUIDS), "GPU-ffff") == []
    assert [r.getMessage() for r in caplog.records] == ["gpu GPU-ffff not sampled: NVML lists no GPU with that UUID"]


def test_power_unsupported_keeps_the_other_figures() -> None:
    assert _sampled(FakeNvml(_UUIDS, power=False), "0")[0]["power_w"] is None


def test_stop_shuts_nvml_down() -> None:
    nvml = FakeNvml(_UUIDS)
    _sampled(nvml, "0")
    assert nvml.shut


def test_status_text_without_gpus_says_n_a_and_is_empty_when_off() -> None:
    assert format_gpus([]) == "gpu n/a"
    assert format_gpus(None) == ""


def test_status_text_from_sampled_gpus() -> None:
    samples = [{"role": "model", **g} for g in _sampled(FakeNvml(_UUIDS), "0")] + [
        {"role": "data", **g} for g in _sampled(FakeNvml(_UUIDS), "1")
    ]
    assert format_gpus(samples) == "gpu model:0 40% 1.0/4.0 GiB 150 W data:1 41%"
