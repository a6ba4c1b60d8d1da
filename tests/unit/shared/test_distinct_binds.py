"""One consumer never binds one address twice (shared/config/checks.py ``check_distinct_binds``): the
data endpoint, the status socket and the metrics port. Unchecked, such a config starts and then stops with
"another consumer (pid N) is running on ..." naming its own pid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from melfeed.shared.config.checks import endpoints_collide
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError
from tests.cli_run import refusal, run_cli


def _refused(doc: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(doc)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_status_socket_equal_to_the_data_endpoint_is_refused_naming_both_keys(tmp_path: Path) -> None:
    sock = f"ipc://{tmp_path}/melfeed.sock"
    assert _refused({"transport": {"endpoint": sock}, "consumer": {"control_endpoint": sock}}) == (
        f"consumer.control_endpoint: must differ from transport.endpoint ({sock}): the consumer binds both, "
        f"got '{sock}'"
    )
    config_from_mapping({"transport": {"endpoint": sock}, "consumer": {"control_endpoint": f"ipc://{tmp_path}/c.sock"}})


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("ipc:///run/m/a.sock", "ipc:///run/m//./a.sock", True),
        ("ipc:///run/m/a.sock", "ipc:///run/m/x/../a.sock", True),
        ("ipc:///run/m/a.sock", "ipc:///run/m/a.control.sock", False),
        ("tcp://127.0.0.1:5555", "tcp://localhost:5555", True),
        ("tcp://0.0.0.0:5555", "tcp://127.0.0.1:5555", True),  # a wildcard takes every address
        ("tcp://*:5555", "tcp://[::1]:5555", True),
        ("tcp://10.0.0.7:5555", "tcp://127.0.0.1:5555", False),
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", False),
        ("tcp://127.0.0.1:5555", "ipc:///tmp/127.0.0.1:5555", False),
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:05555", True),  # one port, however written
        ("tcp://[::ffff:127.0.0.1]:5555", "tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.1:5555", "tcp://[::1]:5555", False),  # two loopback addresses: both bind
    ],
)
def test_which_endpoints_are_one_address(a: str, b: str, same: bool) -> None:
    assert endpoints_collide(a, b) is same and endpoints_collide(b, a) is same


def test_a_tcp_status_socket_on_the_data_port_and_a_metrics_port_on_either_are_refused() -> None:
    text = _refused(
        {
            "transport": {"endpoint": "tcp://0.0.0.0:5555", "insecure": True},
            "consumer": {"control_endpoint": "tcp://127.0.0.1:5555"},
        }
    )
    assert text.startswith("consumer.control_endpoint: must differ from transport.endpoint (tcp://0.0.0.0:5555)")
    assert _refused(
        {"transport": {"endpoint": "tcp://0.0.0.0:9100", "insecure": True}, "consumer": {"metrics_port": 9100}}
    ) == (
        "consumer.metrics_port: 127.0.0.1:9100 is also where transport.endpoint (tcp://0.0.0.0:9100) listens; "
        "choose another port"
    )
    assert _refused(
        {
            "transport": {"insecure": True},
            "consumer": {"control_endpoint": "tcp://127.0.0.1:9100", "metrics_port": 9100},
        }
    ).startswith("consumer.metrics_port: 127.0.0.1:9100 is also where consumer.control_endpoint")
    config_from_mapping(
        {"transport": {"endpoint": "tcp://10.0.0.7:9100", "insecure": True}, "consumer": {"metrics_port": 9100}}
    )  # another address: both bind


def test_a_metrics_host_spelled_without_brackets_or_a_port_with_a_zero_still_meets_the_data_endpoint() -> None:
    """metrics_host is an HTTP host (``::1``), ZeroMQ brackets it (``[::1]``); ZeroMQ reads ``09100`` as 9100."""
    for endpoint, host in (("tcp://[::1]:9100", "::1"), ("tcp://127.0.0.1:09100", "127.0.0.1")):
        assert _refused(
            {
                "transport": {"endpoint": endpoint, "insecure": True},
                "consumer": {"metrics_host": host, "metrics_port": 9100},
            }
        ).startswith(f"consumer.metrics_port: {host}:9100 is also where transport.endpoint ({endpoint}) listens")


def test_the_consumer_refuses_a_status_socket_equal_to_its_default_endpoint_before_starting(tmp_path: Path) -> None:
    """Unset, transport.endpoint is the runtime directory's melfeed.sock: known only where the consumer runs."""
    default = f"ipc://{tmp_path}/melfeed/melfeed.sock"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"consumer": {"control_endpoint": default}}))
    proc = run_cli(
        "consumer", "--config", str(cfg), "--cache-dir", str(tmp_path), env={"XDG_RUNTIME_DIR": str(tmp_path)}
    )
    assert refusal(proc, "consumer") == (
        f"consumer.control_endpoint: must differ from transport.endpoint ({default}): "
        f"the consumer binds both, got '{default}'"
    )
    assert "another consumer" not in proc.stderr


def test_a_rank_whose_status_socket_is_its_per_rank_default_endpoint_is_refused(tmp_path: Path) -> None:
    """In a world of 2, rank 1's unset endpoint is melfeed-rank1.sock (shared/service/rank_defaults.py)."""
    tf_config = tmp_path / "tf.json"
    tf_config.write_text(
        json.dumps({"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, "task": {"type": "worker", "index": 1}})
    )
    rank_sock = f"ipc://{tmp_path}/melfeed-rank1.sock"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"consumer": {"control_endpoint": rank_sock}}))
    proc = run_cli(
        "consumer",
        "--config",
        str(cfg),
        "--cache-dir",
        str(tmp_path),
        "--tf-config",
        str(tf_config),
        env={"RUNTIME_DIRECTORY": str(tmp_path)},
    )
    assert refusal(proc, "consumer").startswith(
        f"consumer.control_endpoint: must differ from transport.endpoint ({rank_sock})"
    )
