"""A two-rank MultiWorkerMirroredStrategy job on loopback: each rank a real `melfeed run` process.

Each rank has its own TF_CONFIG file (free loopback ports for the cluster), config, state directory,
ipc endpoint and producer group, as two hosts would. The reference model on small buckets in graph
mode (XLA has no CPU collectives), `--log-level DEBUG` so every applied batch is logged.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests import procs

WORLD = 2
CHECKPOINT_EVERY = 20
PEER_TIMEOUT_S = 5.0  # consumer.peer_timeout_s of these jobs: how soon a survivor gives up
_APPLIED = re.compile(r"applied batch (\d+)$", re.M)


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now (held open together so none repeats)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


class Job:
    """Two ranks' files under ``tmp``; ``start(rank)`` runs one rank's `run` (its log appended)."""

    def __init__(self, tmp: Path, cache: Path, steps: int) -> None:
        self.tmp = tmp
        self.steps = steps
        ports = free_ports(WORLD)
        for rank in range(WORLD):
            cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
            self.tf_config(rank).write_text(json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}}))
            self.config(rank).write_text(
                yaml.safe_dump(
                    {
                        "cache_dir": str(cache),
                        "buckets": {"num_buckets": 2, "batch_size": 8},
                        "model": {"jit_compile": False},  # the reference step; graph mode (no XLA collectives on CPU)
                        "transport": {"endpoint": f"ipc://{tmp}/rank{rank}.sock", "heartbeat_interval_s": 0.2},
                        "producer": {"count": 1},
                        "consumer": {
                            "steps": steps,
                            "state_dir": str(self.state(rank)),
                            "checkpoint_every_steps": CHECKPOINT_EVERY,
                            "keep_checkpoints": 2,
                            "feed_efficiency_steps": 0,
                            "peer_timeout_s": PEER_TIMEOUT_S,
                            "collective_timeout_s": 120.0,
                            "status_interval_s": 2.0,
                        },
                    }
                )
            )

    def tf_config(self, rank: int) -> Path:
        return self.tmp / f"tf_config{rank}.json"

    def config(self, rank: int) -> Path:
        return self.tmp / f"rank{rank}.yaml"

    def state(self, rank: int) -> Path:
        return self.tmp / f"state{rank}"

    def log(self, rank: int) -> Path:
        return self.tmp / f"rank{rank}.log"

    def summary(self, rank: int) -> Path:
        return self.tmp / f"summary{rank}.json"

    def start(self, rank: int) -> subprocess.Popen[bytes]:
        return procs.start(
            "run",
            self.config(rank),
            self.log(rank),
            "--tf-config",
            str(self.tf_config(rank)),
            "--summary-json",
            str(self.summary(rank)),
            "--log-level",
            "DEBUG",
        )

    def start_all(self) -> list[subprocess.Popen[bytes]]:
        return [self.start(rank) for rank in range(WORLD)]

    def applied(self, rank: int) -> list[int]:
        """The batch ids rank ``rank`` logged as applied, in order."""
        return [int(b) for b in _APPLIED.findall(self.log(rank).read_text(errors="replace"))]

    def final_checkpoint(self, rank: int) -> Path:
        return self.state(rank) / f"ckpt-{self.steps:012d}"

    def variables_bytes(self, rank: int) -> tuple[bytes, bytes]:
        """The final checkpoint's variable data and index, byte for byte."""
        ckpt = self.final_checkpoint(rank)
        return (ckpt / "vars.data-00000-of-00001").read_bytes(), (ckpt / "vars.index").read_bytes()

    def audit(self) -> tuple[int, dict[str, Any], str]:
        report = self.tmp / f"audit-{time.monotonic_ns()}.json"
        states = [str(self.state(rank)) for rank in range(WORLD)]
        proc = subprocess.run(
            [sys.executable, "-m", "melfeed", "audit", *states, "-o", str(report)],
            cwd=procs.REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        doc = json.loads(report.read_text()) if report.exists() else {}
        return proc.returncode, doc, proc.stdout + proc.stderr

    def tails(self) -> str:
        return "\n".join(f"--- rank {r}\n{procs.tail(self.log(r), 30)}" for r in range(WORLD))
