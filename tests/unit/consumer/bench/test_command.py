"""bench's plan of trials (pure parts of ``consumer/bench/command.py``): which systems run at which step costs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from consumer.bench import command
from shared.config import PipelineConfig
from shared.errors import ConfigError


def _settings(**over: Any) -> dict[str, Any]:
    return {"rounds": 2, "step_ms": [5, 20], "producers": [1, 2], "transports": ["zmq", "tcp"],
            "tfdata_parallel": [8], "batches": 10, "warmup": 2, "demo_utterances": 200, "service_workers": 0,
            "has_mode": True, "efficiency_batches": 0} | over


def test_tcp_is_one_system_with_the_first_producer_count_at_the_zero_cost_step_only(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    s = _settings()
    systems = command._systems(s)
    tcp = [x for x in systems if x.get("tcp")]
    assert [(x["system"], x["producers"], x["steps"]) for x in tcp] == [("melfeed-tcp-p1", 1, [0])]
    ran: list[tuple[str, int, bool]] = []

    def fake_trial(spec: dict[str, Any], timeout_s: float, runtime: Path) -> dict[str, Any]:
        ran.append((spec["system"], spec["step_ms"], spec["tcp"]))
        return {"system": spec["system"], "ok": True, "batches_per_s": 1.0, "stall_pct": 0.0}

    monkeypatch.setattr(command, "_run_trial", fake_trial)
    command._rounds(PipelineConfig(), systems, s, [0, 5, 20], 10.0, tmp_path)
    assert sorted(r for r in ran if r[0] == "melfeed-tcp-p1") == [("melfeed-tcp-p1", 0, True)] * 2   # once a round
    assert {step for system, step, _ in ran if system == "melfeed-zmq-p1"} == {0, 5, 20}
    assert not any(is_tcp for system, _, is_tcp in ran if system != "melfeed-tcp-p1")


def test_the_tcp_trial_config_asks_for_payload_frames() -> None:
    spec = command._spec(PipelineConfig(), command._systems(_settings(transports=["tcp"]))[0], _settings(), 0, 0)
    assert spec["tcp"] is True and spec["config"]["transport"]["mode"] == "zmq"


def test_an_unknown_transport_is_refused_naming_the_flag() -> None:
    args = argparse.Namespace(smoke=False, rounds=1, step_ms="5", producers="1", tfdata_parallel="8", batches=5,
                              warmup=1, demo_utterances=200, transports="zmq,udp", service_workers=0,
                              efficiency_batches=0, efficiency_only=False, mel_dtypes="float32")
    with pytest.raises(ConfigError, match="--transports"):
        command._settings(args)
