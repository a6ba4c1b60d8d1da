"""Live figures of a real run: `status` over the control socket, the Prometheus endpoint, the JSONL file.

One `melfeed run` (consumer + 2 producer processes, the tiny TensorFlow step in graph mode on one bucket shape,
the small demo cache, status every 0.3 s) runs until every check has seen what it needs, then gets SIGTERM.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from melfeed.consumer.observe.snapshot import field_names, snapshot_problem
from tests.conftest import REPO
from tests.procs import TINY_STEP, stop, tail

_DEADLINE_S = 90.0


def _cli(args: list[str], tmp: Path, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp), "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(
        [sys.executable, "-m", "melfeed", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _until(check: Any, proc: subprocess.Popen[bytes], log: Path) -> Any:
    """Poll ``check()`` until it returns something truthy; fail if the run ends or the deadline passes."""
    deadline = time.monotonic() + _DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run exited early with {proc.returncode}:\n{tail(log)}"
        result = check()
        if result:
            return result
        time.sleep(0.3)
    raise AssertionError(f"not seen within {_DEADLINE_S} s:\n{tail(log)}")


def test_status_prometheus_and_metrics_file_of_a_live_run(demo_cache: Path, tmp_path: Path) -> None:
    cfg_path = tmp_path / "live.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(demo_cache),
                "buckets": {"num_buckets": 1, "batch_size": 16},
                "transport": {"endpoint": f"ipc://{tmp_path}/melfeed.sock", "heartbeat_interval_s": 0.2},
                "consumer": {"steps": None, "status_interval_s": 0.3, "warmup_steps": 2, "metrics_window_s": 5.0},
                "producer": {"count": 2},
                "model": {"step": TINY_STEP, "jit_compile": False},  # live figures, not the compile, are the subject
            }
        )
    )
    port, jsonl, log = _free_port(), tmp_path / "metrics.jsonl", tmp_path / "run.log"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "melfeed",
                "run",
                "--config",
                str(cfg_path),
                "--metrics-file",
                str(jsonl),
                "--metrics-port",
                str(port),
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def status_json() -> dict[str, Any] | None:
            r = _cli(["status", "--config", str(cfg_path), "--json"], tmp_path)
            if r.returncode != 0:
                return None
            snap: dict[str, Any] = json.loads(r.stdout)
            rated = [p for p in snap["producers"] if p["batches_per_s"] is not None and p["read_ms"] is not None]
            measured = snap.get("feed_efficiency") is not None  # null until FEED_EFFICIENCY_MIN_STEPS steps
            return (
                snap
                if snap["step"] > 0 and len(rated) == 2 and snap["outputs"] and snap["batches_per_s"] and measured
                else None
            )

        snap = _until(status_json, proc, log)
        assert tuple(snap) == field_names() and snapshot_problem(snap) is None
        assert list(snap["outputs"]) == ["loss"] and snap["jit_compile"] in ("xla", "graph")
        assert snap["phase"] in ("training", "waiting") and snap["producers_alive"] == 2
        assert snap["feed_efficiency"] is not None and snap["feed_efficiency"] > 0  # the limit was measured
        assert sorted(p["id"] for p in snap["producers"]) == ["producer-1", "producer-2"]

        def status_table() -> subprocess.CompletedProcess[str] | None:
            r = _cli(["status", "--config", str(cfg_path)], tmp_path)
            return r if r.returncode == 0 and "feed efficiency -" not in r.stdout else None

        table = _until(status_table, proc, log)
        step = int(table.stdout.split("step ", 1)[1].split(",")[0])
        rows = [line.split() for line in table.stdout.splitlines() if line.startswith("producer-")]
        assert step > 0 and sorted(r[0] for r in rows) == ["producer-1", "producer-2"]
        assert "step outputs (mean over the status interval): loss " in table.stdout
        assert "feed efficiency " in table.stdout

        def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            m = _scrape(port)
            built = [k for k in m if k[0] == "melfeed_producer_batches_total"]
            has_loss = ("melfeed_step_output", (("name", "loss"),)) in m
            fed = ("melfeed_feed_efficiency_ratio", ()) in m  # absent until it is measured
            return (
                m
                if m.get(("melfeed_batches_applied_total", ()), 0) > 0 and len(built) == 2 and has_loss and fed
                else None
            )

        metrics = _until(scraped, proc, log)
        assert metrics[("melfeed_producers_alive", ())] == 2
        for pid in ("producer-1", "producer-2"):
            assert metrics[("melfeed_producer_batches_total", (("producer", pid),))] > 0
        assert 0.0 <= metrics[("melfeed_stall_ratio", ())] <= 1.0
        assert metrics[("melfeed_feed_efficiency_ratio", ())] > 0
        assert sum(v for k, v in metrics.items() if k[0] == "melfeed_phase") == 1.0
    finally:
        code = stop(proc, timeout_s=60)
    assert code == 0, tail(log)
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert len(lines) >= 2 and all(tuple(x) == field_names() and snapshot_problem(x) is None for x in lines)
    assert lines[-1]["phase"] == "done" and lines[-1]["step"] >= step
    assert any(x["feed_efficiency"] for x in lines)  # the metrics file carries it too
    assert "| gpu " in log.read_text()  # the status line names the GPUs (or says n/a)
    _check_report_of(jsonl, tmp_path)


def _check_report_of(jsonl: Path, tmp: Path) -> None:
    """`report` draws the real run's metrics file: a 1600x1400 PNG with drawn panels, not a blank page."""
    import matplotlib.image

    png = tmp / "run.png"
    r = _cli(["report", str(jsonl), "-o", str(png)], tmp, timeout_s=120)
    assert r.returncode == 0, r.stderr
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    assert (int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")) == (1600, 1400)
    rgb = matplotlib.image.imread(str(png))[:, :, :3]
    colored = (rgb.max(axis=2) - rgb.min(axis=2)) > 0.2  # line and legend colours, not grey or white
    assert colored[:700].sum() > 2000 and colored[700:].sum() > 2000  # upper and lower panels both drawn


def test_status_with_nothing_listening_is_one_line_and_exit_1(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.control.sock"
    r = _cli(["status", "--endpoint", endpoint, "--timeout-s", "0.5"], tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"melfeed status: no consumer answered at {endpoint} within 0.5 s"]


def test_unwritable_metrics_file_exits_78_naming_the_key(demo_cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "no-such-dir" / "m.jsonl"
    r = _cli(
        [
            "consumer",
            "--cache-dir",
            str(demo_cache),
            "--endpoint",
            f"ipc://{tmp_path}/c.sock",
            "--metrics-file",
            str(bad),
        ],
        tmp_path,
        timeout_s=120,
    )
    assert r.returncode == 78
    assert r.stderr.strip().splitlines()[-1] == (
        f"melfeed consumer: consumer.metrics_file: directory {bad.parent} does not exist"
    )  # before training
