"""Two consumers as the ranks of one MultiWorkerMirroredStrategy job on this machine (loopback, CPU): each
rank's `melfeed consumer` and `melfeed producer` (as its units run them, on the rank's default socket) with its
own TF_CONFIG task index and state dir applies its share of the plan to one model kept in step by the strategy,
and `audit A B` is exact. `melfeed run` ranks: a TF_CONFIG that is not a usable cluster is one line and exit
78, a rank whose peers never join ends by itself, ranks whose plans differ all stop before touching their state.
A rank killed mid-run: tests/integration/train/test_ranks_restart.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests import job_procs, procs
from tests.conftest import REPO

_STEPS = 50  # the loss of the last 10 is ~0.43 of the first 10's (a fixed plan): far below the 0.8 bound
_TIMEOUT_S = 300.0  # two TensorFlow processes on a loaded 2-core machine; a real hang only
_DELAY_MS = "100"  # per batch: a rank trains >= 5 s, long enough to ask both ranks' `status` (~0.5 s) meanwhile


def _tf_config(index: int) -> str:
    return json.dumps(
        {"cluster": {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]}, "task": {"type": "worker", "index": index}}
    )


def _cli(*args: str, tmp_path: Path, tf_config: str | None = None) -> list[str]:
    return [sys.executable, "-m", "melfeed", *args]


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"{p.name}:\n{procs.tail(p)}" for p in sorted(tmp_path.glob("*.log")))


def _env(tmp_path: Path, tf_config: str | None) -> dict[str, str]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    return env | ({"TF_CONFIG": tf_config} if tf_config is not None else {})


def _job_config(job: job_procs.Job) -> Path:
    """One config for both ranks, as a host's units share it: no endpoint and no state dir (the flags give them)."""
    cfg = yaml.safe_load(job.config(0).read_text())
    del cfg["transport"]["endpoint"], cfg["consumer"]["state_dir"]
    cfg["transport"]["liveness_intervals"] = 5
    cfg["consumer"].update(wait_timeout_s=0.5, status_interval_s=1.0)
    path = job.tmp / "melfeed.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def test_two_ranks_on_per_rank_default_sockets_train_one_model_in_step_and_the_audit_of_both_is_exact(
    demo_cache: Path, tmp_path: Path
) -> None:
    """Two ranks of one MultiWorkerMirroredStrategy job on one host, each run as its units run it (``consumer``
    and ``producer`` processes with ``--tf-config FILE --rank R``) with no endpoint configured, in one runtime
    directory: each rank's consumer and producer meet on the rank's default socket (``melfeed-rankR.sock``;
    without the per-rank names the second consumer would find the first one's taken, shared/service/rank_defaults.py)
    and ``status --tf-config`` finds each rank while it trains. Both ranks apply every step and report the same
    job loss, it falls, the final variables are the same bytes on both ranks, and the union of the two audit logs
    is the whole plan exactly once."""
    job = job_procs.Job(tmp_path, demo_cache, _STEPS)
    config = _job_config(job)
    consumers, producers = [], []
    for rank in (0, 1):
        flags = ("--tf-config", str(job.tf_config(rank)), "--rank", str(rank))
        consumers.append(
            procs.start(
                "consumer",
                config,
                job.log(rank),
                *flags,
                "--state-dir",
                str(job.state(rank)),
                "--summary-json",
                str(job.summary(rank)),
                "--log-level",
                "DEBUG",
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
        assert procs.wait_for_records(job.state(rank), 1, consumers[rank], _TIMEOUT_S), _logs(tmp_path)
        assert (tmp_path / "melfeed" / f"melfeed-rank{rank}.sock").exists()
    asks = [
        subprocess.Popen(
            _cli(
                "status",
                "--config",
                str(config),
                "--tf-config",
                str(job.tf_config(rank)),
                "--timeout-s",
                "20",
                tmp_path=tmp_path,
            ),
            cwd=REPO,
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
    codes = [p.wait(_TIMEOUT_S) for p in consumers]
    assert codes == [0, 0], _logs(tmp_path)
    assert [procs.stop(proc) for proc in producers] == [0, 0], _logs(tmp_path)
    assert [job.applied(rank) for rank in (0, 1)] == [list(range(_STEPS))] * 2, job.tails()
    summaries = [json.loads(job.summary(rank).read_text()) for rank in (0, 1)]
    # one job loss on both ranks, bit for bit (the loss is read from the device once per interval, not per step)
    assert [(s["first_loss"], s["final_loss"]) for s in summaries] == [
        (summaries[0]["first_loss"], summaries[0]["final_loss"])
    ] * 2
    assert summaries[0]["final_loss"] < 0.8 * summaries[0]["first_loss"], summaries[0]
    assert job.variables_bytes(0) == job.variables_bytes(1)  # model + optimizer identical on both ranks
    for rank, summary in enumerate(summaries):
        assert (summary["rank"], summary["world"], summary["batches_applied"]) == (rank, 2, _STEPS)
        assert summary["jit_compile"] == "graph" and summary["devices"] == [
            f"/job:worker/replica:0/task:{rank}/device:CPU:0"
        ]
    assert "variables are not kept in step" not in job.log(0).read_text()
    code, doc, text = job.audit()
    assert code == 0, text
    assert doc["total"]["expected"] == doc["total"]["applied"] == 2 * _STEPS
    assert all(r["content_checked"] and r["applied"] == _STEPS for r in doc["ranks"])
    alone = subprocess.run(
        _cli("audit", str(job.state(0)), str(job.state(0)), tmp_path=tmp_path),
        cwd=REPO,
        env=_env(tmp_path, None),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert alone.returncode == 1 and f"duplicated {_STEPS}" in alone.stdout  # rank 0 twice, rank 1 missing


def test_a_tf_config_that_is_no_usable_cluster_is_one_line_and_exit_78(demo_cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "tf_config.json"
    bad.write_text(_tf_config(2), encoding="utf-8")
    for args, tf_config, says in (
        (("consumer", "--tf-config", str(bad)), None, f"--tf-config {bad}: task.index 2 is out of range"),
        (("run", "--demo"), '{"cluster": ', "TF_CONFIG: invalid JSON"),
    ):
        proc = subprocess.run(
            _cli(*args, "--cache-dir", str(demo_cache), tmp_path=tmp_path),
            cwd=REPO,
            env=_env(tmp_path, tf_config),
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
        assert proc.returncode == 78, proc.stderr[-2000:]
        assert proc.stderr.strip().count("\n") == 0 and says in proc.stderr, proc.stderr


def test_a_rank_whose_peers_never_join_ends_after_the_bound(demo_cache: Path, tmp_path: Path) -> None:
    """TensorFlow's own join timeout leaves the constructor blocked; the process must still end by itself."""
    import yaml

    job = job_procs.Job(tmp_path, demo_cache, _STEPS)
    cfg = yaml.safe_load(job.config(0).read_text())
    cfg["consumer"].update(peer_timeout_s=1.0, collective_timeout_s=1.0)  # the least; then a 10 s grace
    job.config(0).write_text(yaml.safe_dump(cfg))
    alone = job.start(0)  # rank 1 never starts
    assert alone.wait(_TIMEOUT_S) == 1, job.tails()
    text = job.log(0).read_text(errors="replace")
    assert "waiting at most 11 s for every rank (consumer.collective_timeout_s), then this process ends" in text
    assert not (job.state(0) / "run.json").exists()  # it ended before opening the state directory


def test_ranks_whose_plans_differ_all_stop_before_touching_their_state_naming_the_key(
    demo_cache: Path, tmp_path: Path
) -> None:
    """Ranks with different seeds would apply overlapping shares of different plans (samples lost and repeated,
    every rank exiting 0): the ranks compare their settings in one collective and all stop with the same verdict."""
    import yaml

    job = job_procs.Job(tmp_path, demo_cache, _STEPS)
    cfg = yaml.safe_load(job.config(1).read_text())
    cfg["seed"] = 7
    job.config(1).write_text(yaml.safe_dump(cfg))
    ranks = job.start_all()
    for rank, proc in enumerate(ranks):
        assert proc.wait(_TIMEOUT_S) == 78, job.tails()
        line = [x for x in job.log(rank).read_text(errors="replace").splitlines() if "differ in" in x]
        here = 7 if rank else 0
        assert line == [
            f"melfeed run: the ranks of this job differ in seed (rank 1 differs from rank 0; "
            f"here: {here}): every rank must train the same plan and model with the same cache, seed, "
            "n_mels, buckets, model, consumer.steps, checkpoint_every_steps and feed_efficiency_steps"
        ], job.tails()
        assert not (job.state(rank) / "run.json").exists()  # stopped before opening its state directory
