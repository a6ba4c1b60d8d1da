"""Config sections: every bad value names its key path and value; the runtime and control paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from melfeed.shared.config import resolve_runtime_dir
from melfeed.shared.config.loader import config_from_mapping, with_overrides
from melfeed.shared.errors import ConfigError


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"buckets": {"batch_size": 0}}, "buckets.batch_size: must be >= 1, got 0"),
        ({"consumer": {"ring_slots": 2}}, "consumer.ring_slots: must be in 3..256, got 2"),
        ({"consumer": {"stage_depth": 3}}, "consumer.stage_depth: must be in 1..2 (below consumer.ring_slots"),
        ({"consumer": {"stage_depth": 0, "ring_slots": 6}}, "consumer.stage_depth: must be in 1..5"),
        ({"transport": {"endpoint": "http://x"}}, "transport.endpoint: must start with ipc:// or tcp://"),
        ({"producer": {"data_gpu": "gpu0"}}, "producer.data_gpu:"),
        ({"producer": {"nice": 20}}, "producer.nice: must be in 0..19 (a niceness; below 0 needs privileges), got 20"),
        ({"producer": {"nice": -5}}, "producer.nice: must be in 0..19"),
        ({"producer": {"nice": "low"}}, "producer.nice: must be an integer, got 'low'"),
        (
            {"producer": {"max_quarantined_fraction": 1.5}},
            "producer.max_quarantined_fraction: must be in 0..1 (1 = no ceiling), got 1.5",
        ),
        ({"producer": {"max_quarantined_fraction": -0.1}}, "producer.max_quarantined_fraction: must be in 0..1"),
        ({"producer": {"max_quarantined_fraction": True}}, "producer.max_quarantined_fraction: must be a number"),
        ({"model": {"step": "nocolon"}}, "model.step: must look like 'module:function'"),
        ({"bukets": {}}, "bukets: unknown key"),
        ({"buckets": {"size": 3}}, "buckets.size: unknown key"),
        ({"buckets": {"batch_size": "big"}}, "buckets.batch_size: must be an integer or auto, got 'big'"),
        ({"buckets": {"batch_size": None, "frame_budget": None}}, "exactly one of batch_size and frame_budget"),
        ({"seed": -1}, "seed: must be an integer in 0..2**63-1, got -1"),
        ({"buckets": {"boundaries": [400, 300]}}, "buckets.boundaries: must be a strictly increasing"),
        ({"consumer": 5}, "consumer: must be a mapping"),
        ({"transport": {"mode": "tcp"}}, "transport.mode: must be 'auto', 'shm' or 'zmq', got 'tcp'"),
        ({"transport": {"mode": "shm", "endpoint": "tcp://127.0.0.1:5555"}}, "transport.mode: 'shm' needs an ipc://"),
        ({"transport": {"shm_dir": "rel/dir"}}, "transport.shm_dir: must be an absolute path"),
        (
            {"transport": {"mel_dtype": "bfloat16"}},
            "transport.mel_dtype: must be 'float32' or 'float16', got 'bfloat16'",
        ),
        ({"consumer": {"metrics_port": 0}}, "consumer.metrics_port: must be in 1..65535 or null, got 0"),
        ({"consumer": {"gpu_sample_interval_s": -1}}, "consumer.gpu_sample_interval_s: must be >= 0"),
        ({"consumer": {"metrics_window_s": 0}}, "consumer.metrics_window_s: must be > 0"),
        ({"consumer": {"control_endpoint": "tcp://0.0.0.0:5600"}}, "consumer.control_endpoint: must be ipc://"),
        (
            {"consumer": {"control_endpoint": "tcp://127.0.0.1:5600"}},
            "consumer.control_endpoint: serves status without authentication over tcp://; use ipc:// or set "
            "transport.insecure: true",
        ),
    ],
)
def test_bad_values_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_runtime_dir_prefers_systemd_then_xdg() -> None:
    assert resolve_runtime_dir({"RUNTIME_DIRECTORY": "/run/melfeed"}) == Path("/run/melfeed")
    assert resolve_runtime_dir({"XDG_RUNTIME_DIR": "/run/user/5"}) == Path("/run/user/5/melfeed")
    assert str(resolve_runtime_dir({})).startswith("/tmp/melfeed-")


def test_a_relative_runtime_dir_in_the_environment_is_ignored() -> None:
    """XDG_RUNTIME_DIR=rel bound ipc://rel/melfeed/melfeed.sock under the consumer's working directory, where a
    producer started elsewhere never looks (the XDG spec: a relative path is invalid, ignore it)."""
    assert str(resolve_runtime_dir({"XDG_RUNTIME_DIR": "rel"})).startswith("/tmp/melfeed-")
    assert str(resolve_runtime_dir({"RUNTIME_DIRECTORY": "rel", "XDG_RUNTIME_DIR": ""})).startswith("/tmp/melfeed-")
    assert resolve_runtime_dir({"RUNTIME_DIRECTORY": "rel", "XDG_RUNTIME_DIR": "/run/user/5"}) == Path(
        "/run/user/5/melfeed"
    )


def test_shm_mode_is_checked_again_once_the_endpoint_is_overridden() -> None:
    cfg = config_from_mapping({"transport": {"mode": "shm"}})
    with pytest.raises(ConfigError, match="transport.mode: 'shm' needs an ipc:// endpoint"):
        with_overrides(cfg, {"transport.endpoint": "tcp://127.0.0.1:5555"})
    auto = config_from_mapping({"transport": {"endpoint": "tcp://127.0.0.1:5555"}})
    assert auto.transport.mode == "auto" and auto.transport.shm_dir is None


def test_control_endpoint_follows_the_data_endpoint_or_the_runtime_dir(tmp_path: Path) -> None:
    from melfeed.shared.service.lifecycle import resolve_control_endpoint

    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    ipc = config_from_mapping({"transport": {"endpoint": "ipc:///run/x/feed.sock"}})
    assert resolve_control_endpoint(ipc, env, create_dir=False) == "ipc:///run/x/feed.control.sock"
    tcp = config_from_mapping({"transport": {"endpoint": "tcp://127.0.0.1:5555", "insecure": True}})
    assert resolve_control_endpoint(tcp, env, create_dir=False) == f"ipc://{tmp_path}/melfeed/melfeed-control.sock"
    assert not (tmp_path / "melfeed").exists()
    own = config_from_mapping(
        {"consumer": {"control_endpoint": "tcp://127.0.0.1:5600"}, "transport": {"insecure": True}}
    )
    assert resolve_control_endpoint(own, env, create_dir=True) == "tcp://127.0.0.1:5600"


@pytest.mark.parametrize(
    "checksum, endpoint, insecure, expected",
    [
        (None, "ipc:///run/melfeed/melfeed.sock", False, False),  # same host: bytes never leave memory
        (None, "tcp://10.0.0.5:5555", False, False),  # CURVE authenticates every message
        (None, "tcp://127.0.0.1:5555", True, True),  # plaintext tcp: nothing else would notice
        (True, "ipc:///run/melfeed/melfeed.sock", False, True),  # an explicit setting always wins
        (False, "tcp://127.0.0.1:5555", True, False),
    ],
)
def test_checksum_defaults_to_on_only_for_tcp_without_curve(
    checksum: bool | None, endpoint: str, insecure: bool, expected: bool
) -> None:
    from melfeed.shared.config import resolve_checksum

    assert resolve_checksum(checksum, endpoint, insecure) is expected
