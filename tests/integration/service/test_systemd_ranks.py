"""Two ranks' units (``deploy --rank 0`` and ``--rank 1`` into one unit directory) under a real systemd
(PID 1 of private namespaces; tests/systemd_ns.py): both pipelines start side by side on one host, each
consumer meets its own producers in its own ``/run/melfeed-rankR`` with no endpoint configured, both
finish their plan (exit 0, not restarted), and ``audit A B`` is exact."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import procs
from tests.job_procs import free_ports
from tests.systemd_ns import INSIDE, SystemdNS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SystemdNS.unavailable() is not None, reason=str(SystemdNS.unavailable())),
]

_STEPS = 30


def _deploy_rank(units: Path, work: Path, rank: int) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "deploy",
            "--producers",
            "1",
            "--user",
            "root",
            "--config",
            str(work / "melfeed.yaml"),
            "--target-dir",
            str(units),
            "--state-dir",
            str(INSIDE / f"state{rank}"),
            "--rank",
            str(rank),
            "--tf-config",
            str(work / f"tf_config-{rank}.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    under_tmp = any(str(p).startswith("/tmp/") for p in (procs.REPO, Path(sys.prefix)))
    private_tmp = "PrivateTmp=no\nReadWritePaths=/tmp\n" if under_tmp else ""  # as in test_systemd.py
    for name in (f"consumer-rank{rank}.service", f"producer-rank{rank}@.service"):
        path = units / name  # the units read the config and TF_CONFIG at their inside paths
        path.write_text(path.read_text().replace(str(work), str(INSIDE)))
        dropin = units / f"{name}.d"
        dropin.mkdir(exist_ok=True)
        log = INSIDE / f"{name.split('@')[0].removesuffix('.service')}.log"
        (dropin / "test.conf").write_text(
            f"[Service]\nStandardOutput=append:{log}\nStandardError=append:{log}\n{private_tmp}"
        )


@pytest.mark.timeout(400)
def test_two_ranks_units_run_side_by_side_under_real_systemd(demo_cache: Path, tmp_path: Path) -> None:
    work, units = tmp_path / "srv", tmp_path / "units"
    work.mkdir()
    units.mkdir()
    shutil.copytree(demo_cache, work / "cache")
    (work / "melfeed.yaml").write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(INSIDE / "cache"),
                "buckets": {"num_buckets": 2, "batch_size": 16},
                "transport": {"heartbeat_interval_s": 0.2, "liveness_intervals": 5},
                "consumer": {
                    "steps": _STEPS,
                    "checkpoint_every_steps": 10,
                    "wait_timeout_s": 0.5,
                    "status_interval_s": 1.0,
                },
                "model": {"step": procs.TINY_STEP, "jit_compile": False},
            }
        )
    )
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    for rank in (0, 1):
        (work / f"state{rank}").mkdir()
        (work / f"tf_config-{rank}.json").write_text(
            json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})
        )
        _deploy_rank(units, work, rank)
    (units / "job.target").write_text("[Unit]\nWants=pipeline-rank0.target pipeline-rank1.target\n")
    ns = SystemdNS(work, units, boot_unit="job.target")
    ns.add_stub_units()
    try:
        ns.boot()
        for rank in (0, 1):
            ns.wait_for(f"producer-rank{rank}@1.service", "ActiveState", lambda v: v == "active", 90)
        for rank in (0, 1):  # each consumer finishes its plan: exit 0, no restart
            props = ns.wait_for(f"consumer-rank{rank}.service", "ActiveState", lambda v: v == "inactive", 240)
            assert (props["Result"], props["NRestarts"]) == ("success", "0"), (props, ns.logs())
        sockets = subprocess.run(
            ["nsenter", "-t", str(ns.pid), "-m", "--", "ls", "/run/melfeed-rank0", "/run/melfeed-rank1"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        ns.systemctl("stop", "pipeline-rank0.target", "pipeline-rank1.target", timeout_s=120)
    finally:
        ns.close()
    assert ns.exit_refused is None, ns.exit_refused  # an orderly exit, not the 30 s wait and a kill
    assert "/run/melfeed-rank0:" in sockets and "/run/melfeed-rank1:" in sockets, sockets
    audit = subprocess.run(
        [sys.executable, "-m", "melfeed", "audit", str(work / "state0"), str(work / "state1")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert audit.returncode == 0 and f"{2 * _STEPS} batches applied" in audit.stdout, audit.stdout + audit.stderr
