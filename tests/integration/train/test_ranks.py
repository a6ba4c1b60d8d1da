"""Two consumers as ranks of one job on this machine (no strategy): each `run_pipeline.py run` with its own
TF_CONFIG task index, state dir and producers applies its share of the plan, and `audit A B` is exact;
a TF_CONFIG that is not a usable cluster is one line and exit 78."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests import procs
from tests.conftest import REPO

_STEPS = 24
_TIMEOUT_S = 300.0   # two TensorFlow processes on a loaded 2-core machine; a real hang only


def _tf_config(index: int) -> str:
    return json.dumps({"cluster": {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]},
                       "task": {"type": "worker", "index": index}})


def _cli(*args: str, tmp_path: Path, tf_config: str | None = None) -> list[str]:
    return [sys.executable, str(REPO / "run_pipeline.py"), *args]


def _env(tmp_path: Path, tf_config: str | None) -> dict[str, str]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    return env | ({"TF_CONFIG": tf_config} if tf_config is not None else {})


def test_two_ranks_each_apply_their_share_and_the_audit_of_both_is_exact(demo_cache: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"buckets": {"num_buckets": 2, "batch_size": 16},
                                   "model": {"step": procs.TINY_STEP, "jit_compile": False},
                                   "transport": {"heartbeat_interval_s": 0.2}}))
    runs = []
    for rank in (0, 1):
        args = _cli("run", "--config", str(cfg), "--cache-dir", str(demo_cache), "--producers", "1",
                    "--steps", str(_STEPS), "--endpoint", f"ipc://{tmp_path}/rank{rank}.sock",
                    "--state-dir", str(tmp_path / f"state{rank}"), "--summary-json", str(tmp_path / f"s{rank}.json"),
                    tmp_path=tmp_path)
        with open(tmp_path / f"rank{rank}.log", "wb") as out:
            runs.append(subprocess.Popen(args, cwd=REPO, env=_env(tmp_path, _tf_config(rank)),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
    codes = [p.wait(_TIMEOUT_S) for p in runs]
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in (0, 1)]
    assert codes == [0, 0], [log[-3000:] for log in logs]
    assert "rank 1 of 2 (TF_CONFIG, task worker:1)" in logs[1]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"s{rank}.json").read_text())["batches_applied"] == _STEPS
        assert json.loads((tmp_path / f"state{rank}" / "run.json").read_text())["world"] == 2
    report = tmp_path / "audit.json"
    audit = subprocess.run(_cli("audit", str(tmp_path / "state0"), str(tmp_path / "state1"), "--json", str(report),
                                tmp_path=tmp_path), cwd=REPO, env=_env(tmp_path, None), capture_output=True,
                           text=True, timeout=_TIMEOUT_S)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    doc = json.loads(report.read_text())
    assert doc["total"]["expected"] == doc["total"]["applied"] == 2 * _STEPS
    assert all(r["content_checked"] and r["applied"] == _STEPS for r in doc["ranks"])
    alone = subprocess.run(_cli("audit", str(tmp_path / "state0"), str(tmp_path / "state0"), tmp_path=tmp_path),
                           cwd=REPO, env=_env(tmp_path, None), capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert alone.returncode == 1 and f"duplicated {_STEPS}" in alone.stdout   # rank 0 twice, rank 1 missing


def test_a_tf_config_that_is_no_usable_cluster_is_one_line_and_exit_78(demo_cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "tf_config.json"
    bad.write_text(_tf_config(2), encoding="utf-8")
    for args, tf_config, says in (
            (("consumer", "--tf-config", str(bad)), None, f"--tf-config {bad}: task.index 2 is out of range"),
            (("run", "--demo"), '{"cluster": ', "TF_CONFIG: invalid JSON")):
        proc = subprocess.run(_cli(*args, "--cache-dir", str(demo_cache), tmp_path=tmp_path), cwd=REPO,
                              env=_env(tmp_path, tf_config), capture_output=True, text=True, timeout=_TIMEOUT_S)
        assert proc.returncode == 78, proc.stderr[-2000:]
        assert proc.stderr.strip().count("\n") == 0 and says in proc.stderr, proc.stderr
