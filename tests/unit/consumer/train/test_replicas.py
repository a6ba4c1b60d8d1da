"""Replica settings without starting TensorFlow's devices: the count, the refusals (one line naming the
key), and the logical CPU split that ``configure_memory`` makes before TensorFlow initialises its devices."""

from __future__ import annotations

from typing import Any

import pytest

from melfeed.consumer.placement import configure_memory
from melfeed.consumer.train.replicas import check_rows
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError

pytestmark = pytest.mark.tf


@pytest.mark.parametrize(
    ("consumer", "count"),
    [
        ({}, 1),
        ({"model_gpu": "1,2"}, 2),
        ({"model_gpu": ""}, 1),
        ({"replicas": 4}, 4),
        ({"replicas": 2, "model_gpu": "0,3"}, 2),
        ({"replicas": 2, "model_gpu": ""}, 2),
    ],
)
def test_replica_count_is_the_setting_else_one_per_listed_model_gpu(consumer: dict[str, Any], count: int) -> None:
    assert config_from_mapping({"consumer": consumer}).consumer.replica_count == count


@pytest.mark.parametrize(
    ("data", "line"),
    [
        (
            {"consumer": {"replicas": 3}},
            "buckets.batch_size: must divide by the 3 model replicas (consumer.replicas, consumer.model_gpu): "
            "each replica "
            "takes an equal share of every batch's rows, got 32",
        ),
        (
            {"consumer": {"model_gpu": "0,1,2"}, "buckets": {"batch_size": 16}},
            "buckets.batch_size: must divide by the 3",
        ),
        (
            {"consumer": {"replicas": 3, "model_gpu": "1,2"}},
            "consumer.replicas: must equal the 2 GPUs consumer.model_gpu lists (or leave it null), got 3",
        ),
        ({"consumer": {"replicas": 0}}, "consumer.replicas: must be in 1..64 or null, got 0"),
    ],
)
def test_replica_settings_that_cannot_work_are_refused_naming_the_key(data: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_mapping(data)
    assert str(err.value).startswith(line)


def test_frame_budget_buckets_whose_rows_do_not_divide_are_refused_naming_frame_budget() -> None:
    cfg = config_from_mapping({"consumer": {"replicas": 2}, "buckets": {"batch_size": None, "frame_budget": 4000}})
    check_rows([8, 6, 4], 2, cfg)
    with pytest.raises(ConfigError) as err:
        check_rows([8, 5, 4], 2, cfg)
    assert str(err.value) == (
        "buckets.frame_budget: bucket 1 has 5 rows, which do not divide by the 2 model replicas "
        "(consumer.replicas, consumer.model_gpu), got 4000"
    )


class _Device:
    def __init__(self, name: str) -> None:
        self.name = name


class _FakeConfig:
    def __init__(self) -> None:
        self.logical: list[tuple[str, int]] = []
        self.growth: list[str] = []
        self.experimental = self

    @staticmethod
    def LogicalDeviceConfiguration(memory_limit: int | None = None) -> tuple[str, int | None]:  # noqa: N802
        return ("logical", memory_limit)

    def set_logical_device_configuration(self, device: _Device, configs: list[Any]) -> None:
        self.logical.append((device.name, len(configs)))

    def set_memory_growth(self, device: _Device, on: bool) -> None:
        self.growth.append(device.name)


class _FakeTf:
    def __init__(self, gpus: list[str]) -> None:
        self.config = _FakeConfig()
        self._gpus = gpus
        self.config.list_physical_devices = self._list  # type: ignore[attr-defined]

    def _list(self, kind: str) -> list[_Device]:
        return [_Device(g) for g in self._gpus] if kind == "GPU" else [_Device("CPU:0")]


@pytest.mark.parametrize(
    ("consumer", "gpus", "logical"),
    [({"replicas": 3}, [], [("CPU:0", 3)]), ({}, [], []), ({"replicas": 2}, ["GPU:0", "GPU:1"], [])],
)
def test_configure_memory_splits_the_cpu_into_one_logical_device_per_replica_only_without_gpus(
    consumer: dict[str, Any], gpus: list[str], logical: list[tuple[str, int]]
) -> None:
    tf = _FakeTf(gpus)
    cfg = config_from_mapping({"consumer": {**consumer, "model_gpu": None}, "buckets": {"batch_size": 6}})
    assert configure_memory(cfg, tf) == gpus
    assert tf.config.logical == logical
    assert tf.config.growth == gpus
