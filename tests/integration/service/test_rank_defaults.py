"""Two ranks on one host with no endpoint configured, each run as its units run it (``consumer`` and
``producer`` processes with ``--tf-config FILE --rank R``) in one shared runtime directory: each rank's
consumer and producers meet on the rank's default socket (``melfeed-rankR.sock``), ``status --tf-config``
finds each rank, and ``audit A B`` is exact. Without the per-rank names the second consumer would find
the first one's socket taken (shared/service/rank_defaults.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests import procs
from tests.job_procs import free_ports

_STEPS = 20
_DELAY_MS = "250"  # per batch: the run lasts >= 5 s, long enough to ask both ranks' `status` (~0.5 s) while they train


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"{p.name}:\n{procs.tail(p)}" for p in sorted(tmp_path.glob("*.log")))


def test_two_ranks_on_one_host_meet_their_own_producers_on_per_rank_default_sockets(
    demo_cache: Path, tmp_path: Path
) -> None:
    config = tmp_path / "melfeed.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(demo_cache),
                "buckets": {"num_buckets": 1, "batch_size": 16},
                "transport": {"heartbeat_interval_s": 0.2, "liveness_intervals": 5},
                "consumer": {
                    "steps": _STEPS,
                    "wait_timeout_s": 0.5,
                    "status_interval_s": 1.0,
                    "feed_efficiency_steps": 0,
                },
                "model": {"step": procs.TINY_STEP, "jit_compile": False},
            }
        ),
        encoding="utf-8",
    )
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    consumers, producers, tf_configs = [], [], []
    for rank in (0, 1):
        tf_config = tmp_path / f"tf_config-{rank}.json"
        tf_config.write_text(json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}))
        tf_configs.append(tf_config)
        flags = ("--tf-config", str(tf_config), "--rank", str(rank))
        consumers.append(
            procs.start(
                "consumer",
                config,
                tmp_path / f"consumer{rank}.log",
                *flags,
                "--state-dir",
                str(tmp_path / f"state{rank}"),
            )
        )
        producers.append(
            procs.start(
                "producer",
                config,
                tmp_path / f"producer{rank}.log",
                *flags,
                "--producers",
                "1",
                "--debug-delay-ms",
                _DELAY_MS,
            )
        )
    for rank in (0, 1):
        assert procs.wait_for_records(tmp_path / f"state{rank}", 1, consumers[rank], procs.WAIT_S), _logs(tmp_path)
        assert (tmp_path / "melfeed" / f"melfeed-rank{rank}.sock").exists()
    asks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "melfeed",
                "status",
                "--config",
                str(config),
                "--tf-config",
                str(tf_configs[rank]),
                "--timeout-s",
                "20",
            ],
            cwd=procs.REPO,
            env=procs.env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]  # both at once: each rank is asked while it trains
    for rank, ask in enumerate(asks):
        out, err = ask.communicate(timeout=procs.WAIT_S)
        assert ask.returncode == 0, err
        assert f"melfeed-rank{rank}.control.sock, rank {rank} of 2:" in out, out
    codes = [proc.wait(procs.WAIT_S * 3) for proc in consumers]
    assert codes == [0, 0], _logs(tmp_path)
    assert [procs.stop(proc) for proc in producers] == [0, 0], _logs(tmp_path)
    audit = subprocess.run(
        [sys.executable, "-m", "melfeed", "audit", str(tmp_path / "state0"), str(tmp_path / "state1")],
        cwd=procs.REPO,
        capture_output=True,
        text=True,
        timeout=procs.WAIT_S,
    )
    assert audit.returncode == 0 and f"{2 * _STEPS} batches applied" in audit.stdout, audit.stdout + audit.stderr
