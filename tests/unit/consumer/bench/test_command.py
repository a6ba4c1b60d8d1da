"""bench's plan of trials (pure parts of ``consumer/bench/command.py``): which systems run at which step costs;
flags refused before any trial; SIGTERM stopping real child processes
(``melfeed.shared.service.children.CommandChildren``, as bench uses it)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from melfeed.consumer.bench import command
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.service.children import CommandChildren, Interrupted

REPO = Path(__file__).resolve().parents[4]


def _settings(**over: Any) -> dict[str, Any]:
    return {
        "rounds": 2,
        "step_ms": [5, 20],
        "producers": [1, 2],
        "transports": ["zmq", "tcp"],
        "tfdata_parallel": [8],
        "batches": 10,
        "warmup": 2,
        "demo_utterances": 200,
        "service_workers": 0,
        "has_mode": True,
        "efficiency_batches": 0,
    } | over


def test_tcp_is_one_system_with_the_first_producer_count_at_the_zero_cost_step_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
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
    assert sorted(r for r in ran if r[0] == "melfeed-tcp-p1") == [("melfeed-tcp-p1", 0, True)] * 2  # once a round
    assert {step for system, step, _ in ran if system == "melfeed-zmq-p1"} == {0, 5, 20}
    assert not any(is_tcp for system, _, is_tcp in ran if system != "melfeed-tcp-p1")


def test_the_tcp_trial_config_asks_for_payload_frames() -> None:
    spec = command._spec(PipelineConfig(), command._systems(_settings(transports=["tcp"]))[0], _settings(), 0, 0)
    assert spec["tcp"] is True and spec["config"]["transport"]["mode"] == "zmq"


def test_an_unknown_transport_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--transports"):
        command._settings(_flags(transports="zmq,udp"))


def _flags(**over: Any) -> argparse.Namespace:
    return argparse.Namespace(
        **(
            {
                "smoke": False,
                "rounds": 1,
                "step_ms": "5",
                "producer_counts": "1",
                "tfdata_parallel": "8",
                "batches": 5,
                "warmup": 1,
                "demo_utterances": 200,
                "transports": "zmq",
                "service_workers": 0,
                "efficiency_batches": 0,
                "efficiency_only": False,
                "transport_only": False,
                "no_transport": False,
                "mel_dtypes": "float32",
                "trial_timeout_s": 300.0,
                "output": None,
            }
            | over
        )
    )


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"trial_timeout_s": math.nan}, "--trial-timeout-s: must be a finite number > 0, got nan"),
        ({"trial_timeout_s": 0.0}, "--trial-timeout-s: must be a finite number > 0, got 0.0"),
        ({"trial_timeout_s": 1e300}, "--trial-timeout-s: must be <= 86400, got 1e+300"),
        ({"service_workers": -1}, "--service-workers: must be in 0..64 (0 = skip the service), got -1"),
        ({"transport_only": True, "no_transport": True}, "--transport-only: contradicts --no-transport: pick one"),
        (
            {"transport_only": True, "efficiency_only": True, "efficiency_batches": 5},
            "--transport-only: contradicts --efficiency-only: pick one",
        ),
        (
            {"efficiency_batches": 60},
            "--efficiency-batches: must be >= 100 (feed efficiency is reported after 100 fed steps), or 0",
        ),
        ({"efficiency_only": True, "efficiency_batches": 0}, "--efficiency-batches: must be >= 100"),
        ({"output": "{tmp}"}, "--output: is a directory; name a file to write, got '{tmp}'"),
        ({"output": "{tmp}/missing/b.json"}, "--output: directory {tmp}/missing does not exist"),
    ],
)
def test_run_flags_are_refused_before_any_trial(tmp_path: Path, over: dict[str, Any], needle: str) -> None:
    over = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in over.items()}
    with pytest.raises(ConfigError) as info:
        command._settings(_flags(**over))
    assert str(info.value).startswith(needle.format(tmp=tmp_path)), str(info.value)
    assert command._settings(_flags(output=str(tmp_path / "b.json"), service_workers=2))["service_workers"] == 2


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


# A "trial": prints its pid and its helper's (same process group, as the tf.data servers are), then waits.
_TRIAL = (
    "import subprocess, sys, time; h = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
    "print(h.pid, flush=True); time.sleep(300)"
)


def test_sigterm_stops_the_running_trial_with_its_group_and_no_other_starts(tmp_path: Path) -> None:
    children = CommandChildren("bench children")
    pids: list[int] = []
    try:
        with pytest.raises(Interrupted) as info, children:
            proc = children.spawn([sys.executable, "-c", _TRIAL], stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            pids = [proc.pid, int(proc.stdout.readline())]
            assert all(_alive(p) for p in pids)
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` on bench: only the handler runs
            assert proc.wait(60) == -signal.SIGTERM  # the trial's whole group got SIGTERM at once
            children.spawn([sys.executable, "-c", "pass"])  # no new child after the signal
        assert info.value.signum == signal.SIGTERM
        assert _wait_gone(pids) == []
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the old handler is back
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_server_started_by_a_trial_dies_with_it_even_after_sigkill(tmp_path: Path) -> None:
    from melfeed.consumer.bench.baselines import _ORPHAN_GUARD

    server = _ORPHAN_GUARD + "import time; print(flush=True); time.sleep(300)"  # the servers' first statement
    trial = (
        "import os, subprocess, sys; s = subprocess.Popen([sys.executable, '-c', sys.argv[1], '0', "
        "str(os.getpid())], stdout=subprocess.PIPE); s.stdout.readline(); print(s.pid, flush=True); "
        "import time; time.sleep(300)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", trial, server],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    server_pid = 0
    try:
        assert proc.stdout is not None
        server_pid = int(proc.stdout.readline())  # printed once its guard is armed
        proc.kill()
        proc.wait(60)
        assert _wait_gone([server_pid]) == [], "a tf.data service server outlived its trial"
    finally:
        if proc.poll() is None:
            proc.kill()
        if server_pid and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_smoke_runs_every_trial_of_a_section_in_one_process_in_the_usual_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    s = _settings(rounds=1, step_ms=[5], producers=[1], one_trial_process=True)
    systems = command._systems(s)
    calls: list[tuple[list[tuple[str, int]], float]] = []

    def fake_trials(specs: list[dict[str, Any]], timeout_s: float, runtime: Path) -> list[dict[str, Any]]:
        calls.append(([(spec["system"], spec["step_ms"]) for spec in specs], timeout_s))
        return [{"system": spec["system"], "ok": True, "batches_per_s": 1.0, "stall_pct": 0.0} for spec in specs]

    monkeypatch.setattr(command, "_run_trials", fake_trials)
    trials = command._rounds(PipelineConfig(), systems, s, [0, 5], 10.0, tmp_path)
    ipc = ["melfeed-zmq-p1", "tfdata-npc8", "naive"]
    expected = [(x, 0) for x in ["melfeed-zmq-p1", "melfeed-tcp-p1", "tfdata-npc8", "naive"]] + [(x, 5) for x in ipc]
    assert calls == [(expected, 10.0 * len(expected))]  # one process; its timeout: one trial's per trial
    assert [t["system"] for t in trials] == [system for system, _ in expected]
