"""``buckets.batch_size: auto`` in a real run (`melfeed run`, a real producer): the consumer measures the rows,
keeps them in the state directory, its producer builds the same bucket set (else the handshake refuses it with
exit 78), and the batches trained have the measured rows."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests import procs


def test_a_run_trains_on_the_rows_it_measured_and_keeps_them(demo_cache: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(demo_cache),
                "buckets": {"num_buckets": 2, "batch_size": "auto", "max_batch_size": 4},
                "consumer": {"warmup_steps": 1, "state_dir": str(tmp_path / "state"), "feed_efficiency_steps": 0},
                "model": {"step": "tests.steps:rows_step", "jit_compile": False},
            }
        )
    )
    summary = tmp_path / "summary.json"
    proc = procs.run("run", cfg, "--producers", "1", "--steps", "6", "--summary-json", str(summary), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (entry,) = json.loads((tmp_path / "state" / "batch_sizes.json").read_text())["entries"].values()
    rows = entry["rows"]
    assert len(rows) == 2 and all(1 <= r <= 4 for r in rows)
    assert f"rows by bucket {rows}" in proc.stderr and json.loads(summary.read_text())["steps"] == 6
    bound = next(line for line in proc.stderr.splitlines() if "consumer bound" in line)
    assert all(f"[{k}, {r}, " in bound for k, r in enumerate(rows)), bound  # the plan's and the ring's rows
