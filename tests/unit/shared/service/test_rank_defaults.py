"""Per-rank defaults (shared/service/rank_defaults.py): two ranks on one host never share an endpoint, a
world of 1 keeps today's names, a value set in the config wins, ``--rank`` refuses another rank's TF_CONFIG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from melfeed.consumer.observe.status import _control_endpoint
from melfeed.shared.config import PipelineConfig, TransportConfig
from melfeed.shared.config.loader import with_overrides
from melfeed.shared.errors import ConfigError
from melfeed.shared.service.cli import build_parser, config_from_args
from melfeed.shared.service.lifecycle import resolve_control_endpoint, resolve_endpoint
from melfeed.shared.service.rank_defaults import check_expected_rank, rank_suffix, with_rank_defaults
from melfeed.shared.service.tf_config import SINGLE_WORKER, WorkerPlace, parse_tf_config

_CLUSTER = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}


def _place(task_type: str, index: int) -> WorkerPlace:
    return parse_tf_config(json.dumps({"cluster": _CLUSTER, "task": {"type": task_type, "index": index}}), "test")


def _write_tf_config(tmp_path: Path, index: int) -> Path:
    path = tmp_path / f"tf{index}.json"
    path.write_text(
        json.dumps(
            {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, "task": {"type": "worker", "index": index}}
        ),
        encoding="utf-8",
    )
    return path


def test_a_world_of_one_keeps_the_config_and_todays_names(tmp_path: Path) -> None:
    cfg = PipelineConfig()
    environ = {"RUNTIME_DIRECTORY": str(tmp_path / "run")}
    assert rank_suffix(SINGLE_WORKER) == ""
    assert with_rank_defaults(cfg, SINGLE_WORKER, environ) is cfg
    assert resolve_endpoint(cfg, environ) == f"ipc://{tmp_path}/run/melfeed.sock"


def test_every_rank_of_a_world_gets_its_own_endpoint_and_status_socket(tmp_path: Path) -> None:
    environ = {"RUNTIME_DIRECTORY": str(tmp_path)}
    places = [_place("chief", 0), _place("worker", 0), _place("worker", 1)]
    configs = [with_rank_defaults(PipelineConfig(), place, environ) for place in places]
    endpoints = [resolve_endpoint(cfg, environ) for cfg in configs]
    controls = [resolve_control_endpoint(cfg, environ, create_dir=False) for cfg in configs]
    assert endpoints == [f"ipc://{tmp_path}/melfeed-rank{r}.sock" for r in (0, 1, 2)]
    assert controls == [f"ipc://{tmp_path}/melfeed-rank{r}.control.sock" for r in (0, 1, 2)]
    assert len(set(endpoints) | set(controls)) == 6


def test_a_configured_endpoint_wins_and_a_tcp_one_gets_a_per_rank_status_socket(tmp_path: Path) -> None:
    environ = {"RUNTIME_DIRECTORY": str(tmp_path)}
    place = _place("worker", 1)
    ipc = with_overrides(PipelineConfig(), {"transport.endpoint": f"ipc://{tmp_path}/mine.sock"})
    assert with_rank_defaults(ipc, place, environ) == ipc
    tcp = PipelineConfig(transport=TransportConfig(endpoint="tcp://0.0.0.0:5555"))
    ranked = with_rank_defaults(tcp, place, environ)
    assert ranked.transport.endpoint == "tcp://0.0.0.0:5555"
    assert ranked.consumer.control_endpoint == f"ipc://{tmp_path}/melfeed-rank2-control.sock"
    own = with_overrides(tcp, {"consumer.control_endpoint": f"ipc://{tmp_path}/status.sock"})
    assert with_rank_defaults(own, place, environ) == own


def test_the_runtime_directory_is_made_only_when_asked(tmp_path: Path) -> None:
    place = _place("worker", 0)
    with_rank_defaults(PipelineConfig(), place, {"RUNTIME_DIRECTORY": str(tmp_path / "a")}, create_dir=False)
    assert not (tmp_path / "a").exists()
    with_rank_defaults(PipelineConfig(), place, {"RUNTIME_DIRECTORY": str(tmp_path / "b")})
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o700


def test_the_expected_rank_is_checked_against_the_tf_config() -> None:
    check_expected_rank(_place("worker", 1), None)
    check_expected_rank(_place("worker", 1), 2)
    check_expected_rank(SINGLE_WORKER, 0)
    with pytest.raises(ConfigError, match=r"^--rank: 1, but test names task worker:1, which is rank 2 of 3"):
        check_expected_rank(_place("worker", 1), 1)
    with pytest.raises(ConfigError, match=r"^--rank: 3 is not a rank of the cluster in test: ranks are 0\.\.2"):
        check_expected_rank(_place("worker", 1), 3)
    with pytest.raises(ConfigError, match=r"^--rank: 1 is not a rank of a world of 1"):
        check_expected_rank(SINGLE_WORKER, 1)


def test_consumer_producer_and_status_of_one_rank_agree_and_differ_from_the_other_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    parser = build_parser()
    seen = {}
    for rank in (0, 1):
        tf = str(_write_tf_config(tmp_path, rank))
        consumer = config_from_args(parser.parse_args(["consumer", "--tf-config", tf, "--rank", str(rank)]))
        producer = config_from_args(parser.parse_args(["producer", "--tf-config", tf]))
        assert consumer.transport.endpoint == producer.transport.endpoint == f"ipc://{tmp_path}/melfeed-rank{rank}.sock"
        status = _control_endpoint(parser.parse_args(["status", "--tf-config", tf]))
        assert status == resolve_control_endpoint(consumer, {"RUNTIME_DIRECTORY": str(tmp_path)}, create_dir=False)
        seen[rank] = (consumer.transport.endpoint, status)
    assert not set(seen[0]) & set(seen[1])
    explicit = config_from_args(parser.parse_args(["run", "--tf-config", tf, "--endpoint", "ipc:///x/y.sock"]))
    assert explicit.transport.endpoint == "ipc:///x/y.sock"
    monkeypatch.setenv("TF_CONFIG", _write_tf_config(tmp_path, 1).read_text())  # the variable works the same
    assert config_from_args(parser.parse_args(["producer"])).transport.endpoint == seen[1][0]


def test_a_start_with_another_ranks_tf_config_is_refused_in_one_line(tmp_path: Path) -> None:
    tf = str(_write_tf_config(tmp_path, 1))
    with pytest.raises(ConfigError) as err:
        config_from_args(build_parser().parse_args(["producer", "--tf-config", tf, "--rank", "0"]))
    assert str(err.value).startswith(f"--rank: 0, but --tf-config {tf} names task worker:1, which is rank 1 of 2")
    assert "\n" not in str(err.value)
