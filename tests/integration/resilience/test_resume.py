"""SIGTERM on the consumer: exit 0, a checkpoint at exactly the next batch, and a restart that
ends with the same variables as a run that was never interrupted (nothing lost or repeated).
Producers keep running across the consumer restart. A cache gone bad mid-run stops the run the same
orderly way (exit 65) and it resumes once fixed. (TensorFlow is imported here first, also so that the
in-process runs' placement sets no TF_XLA_FLAGS for later tests.)"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.resume.checkpoint import latest_checkpoint
from melfeed.shared.cache.demo_data import write_demo_cache
from tests import procs
from tests.conftest import ProducerGroup

_STEPS = 90
_SECTIONS: dict[str, dict[str, object]] = {
    "consumer": {"checkpoint_every_steps": 1000, "feed_efficiency_steps": 0},  # feed efficiency is not checked
    "buckets": {"max_shapes": 1},  # one compiled program per run: buckets are not the subject
    "producer": {"count": 1},  # one producer, kept running across the restart: how many is not the subject
}


def _final_variables(state: Path) -> dict[str, np.ndarray]:
    found = latest_checkpoint(state)
    assert found is not None
    reader = tf.train.load_checkpoint(str(found[0] / "vars"))
    return {name: reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE") for name in ("w", "momentum", "iterations")}


def _consumer_run(config: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return procs.start("consumer", config, log, *extra)


def test_sigterm_checkpoints_and_the_restart_ends_bit_identical_to_an_uninterrupted_run(
    demo_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from melfeed import cli as run_pipeline

    monkeypatch.setattr("melfeed.shared.service.lifecycle.setup_logging", lambda *args, **kwargs: None)
    log = tmp_path / "resume.log"
    endpoint = f"ipc://{tmp_path}/r.sock"
    straight = procs.write_config(
        tmp_path / "straight.yaml",
        demo_cache,
        endpoint,
        tmp_path / "a",
        _STEPS,
        **_SECTIONS,
    )
    broken = procs.write_config(
        tmp_path / "broken.yaml",
        demo_cache,
        endpoint,
        tmp_path / "b",
        _STEPS,
        **_SECTIONS,
    )
    producers = procs.start("producer", straight, log, "--debug-delay-ms", "20")
    consumers: list[subprocess.Popen[bytes]] = []

    def consumer(config: Path, *extra: str) -> subprocess.Popen[bytes]:
        consumers.append(_consumer_run(config, log, *extra))
        return consumers[-1]

    try:
        # The uninterrupted reference: the `consumer` command in this process, which imported TensorFlow already.
        assert run_pipeline.main(["consumer", "--config", str(straight)]) == 0, procs.tail(log)
        assert (tmp_path / "a" / "outliers.tsv").read_text() == "id\tframes\ttokens\treason\n"  # none left out

        first = consumer(broken, "--summary-json", str(tmp_path / "first.json"))
        assert procs.wait_for_records(tmp_path / "b", 30, first, 180), procs.tail(log)
        assert procs.stop(first, 20) == 0, procs.tail(log)  # SIGTERM: clean exit 0
        summary = json.loads((tmp_path / "first.json").read_text())
        found = latest_checkpoint(tmp_path / "b")
        assert found is not None and summary["interrupted"]
        # The stop checkpoint covers every applied batch: nothing after it to replay.
        assert found[1].next_batch == found[1].audit_records == procs.audit_records(tmp_path / "b")
        assert summary["next_batch"] == found[1].next_batch < _STEPS

        # The restart: the same command again, in this process (TensorFlow is loaded); same producers, no restart.
        assert run_pipeline.main(["consumer", "--config", str(broken)]) == 0, procs.tail(log)
    finally:
        for proc in consumers:  # a failed assertion must not leave a consumer waiting for producers
            procs.stop(proc)
        procs.stop(producers)
    rc, doc, text = procs.run_audit(tmp_path / "b", tmp_path)
    assert rc == 0 and doc["consumer_epochs"] == 2 and doc["applied"] == _STEPS, text
    a, b = _final_variables(tmp_path / "a"), _final_variables(tmp_path / "b")
    assert int(b["iterations"]) == _STEPS
    for name in a:
        assert np.array_equal(a[name], b[name]), name


# The consumer holding the state directory: its lock and run.json as the consumer CLI takes them (RunState.open,
# before it imports TensorFlow), held until SIGTERM, in a process that never imports TensorFlow (the CLI's would
# go on importing it for seconds after the refusals were checked).
_HOLDER = """\
import sys, threading
from melfeed.consumer.resume.state import RunState
from melfeed.shared.cache.features import load_manifest_for
from melfeed.shared.config.loader import load_config
cfg = load_config(sys.argv[1])
state = RunState.open(cfg, load_manifest_for(cfg).fingerprint)
threading.Event().wait(60)     # stopped long before
"""


def test_a_state_dir_in_use_or_from_another_plan_is_refused_with_one_line(demo_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "refuse.log"
    endpoint = f"ipc://{tmp_path}/x.sock"
    config = procs.write_config(tmp_path / "c.yaml", demo_cache, endpoint, tmp_path / "s", 10_000)
    holder = procs.start_python(_HOLDER, config, log)
    try:
        assert procs.wait_for_file(tmp_path / "s" / "run.json", holder, 60), procs.tail(log)
        other = procs.write_config(tmp_path / "o.yaml", demo_cache, f"ipc://{tmp_path}/y.sock", tmp_path / "s", 5)
        second = subprocess.run(
            procs.command("consumer", other),
            cwd=procs.REPO,
            env=procs.env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        procs.stop(holder)
    assert second.returncode == 78
    assert second.stderr.strip().endswith(f"in use by another consumer (pid {holder.pid})"), second.stderr
    reseeded = procs.write_config(tmp_path / "r.yaml", demo_cache, endpoint, tmp_path / "s", 5)
    text = reseeded.read_text().replace("cache_dir:", "seed: 9\ncache_dir:")
    reseeded.write_text(text)
    third = subprocess.run(
        procs.command("consumer", reseeded),
        cwd=procs.REPO,
        env=procs.env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert third.returncode == 78
    assert "seed=0, the config has 9" in third.stderr and len(third.stderr.strip().splitlines()) == 1, third.stderr


def test_a_cache_gone_after_indexing_stops_the_run_with_65_in_order_and_it_resumes_once_fixed(
    tmp_path: Path,
    endpoint: str,
    producers: ProducerGroup,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # producer.max_quarantined_fraction: the `consumer` command itself, in this process (melfeed.cli.main: the
    # exit code and the one line), fed by a real producer group, on a cache whose mels went after indexing.
    from melfeed import cli as run_pipeline

    monkeypatch.setattr("melfeed.shared.service.lifecycle.setup_logging", lambda *args, **kwargs: None)
    cache, steps, buckets = tmp_path / "cache", 20, {"batch_size": 8, "num_buckets": 2}
    write_demo_cache(cache, n_utterances=48)  # indexed and packed
    (cache / "mels").rename(tmp_path / "mels-saved")  # every mel gone; the pack too, else it serves
    (cache / "mels").mkdir()
    for pack in cache.glob("*.pack"):
        pack.unlink()
    state, summary = tmp_path / "state", tmp_path / "summary.json"
    config = procs.write_config(
        tmp_path / "run.yaml",
        cache,
        endpoint,
        state,
        steps,
        buckets=buckets,
        consumer={"checkpoint_every_steps": 1000, "feed_efficiency_steps": 0},
    )
    producers.start(cache, endpoint, 1, buckets=buckets)
    args = ["consumer", "--config", str(config), "--summary-json", str(summary)]

    assert run_pipeline.main(args) == 65
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("melfeed consumer: ")]
    found = latest_checkpoint(state)
    assert found is not None
    resume_at = found[1].next_batch
    s = json.loads(summary.read_text())
    assert s["error"] == line.removeprefix("melfeed consumer: ") and not s["interrupted"]
    # Judged from one epoch of this 48-utterance cache (48 rows < 1000), every one of them quarantined.
    assert line.startswith(
        f"melfeed consumer: producer.max_quarantined_fraction: {s['samples']} of the "
        f"{s['samples']} rows trained were quarantined (100.00 %, above 1 %), so cache files are "
        "missing or bad; e.g. sample "
    ), line
    assert 48 <= s["samples"] < 48 + 3 * buckets["batch_size"]  # + the steps in flight when it tripped
    assert s["quarantined_samples"] == s["samples"] and s["steps"] == resume_at < steps
    assert re.search(r"e\.g\. sample \d+ \(LJ\d{3}-\d{4}\): \S+/mels/LJ\d{3}-\d{4}\.npy: missing; ", line), line
    assert line.endswith(f"run the same command again: it resumes at batch {resume_at}")
    assert procs.audit_records(state) == resume_at  # stopped in order: every applied batch recorded

    (cache / "mels").rmdir()
    (tmp_path / "mels-saved").rename(cache / "mels")  # the user puts the files back ...
    assert run_pipeline.main(args) == 0  # ... and runs the same command again
    s = json.loads(summary.read_text())
    found = latest_checkpoint(state)
    assert found is not None and found[1].next_batch == procs.audit_records(state) == steps
    assert s["error"] is None and s["steps"] == steps - resume_at and s["quarantined_samples"] == 0


def test_a_plan_shorter_than_the_judging_window_on_a_cache_that_is_gone_ends_with_65_not_0(
    tmp_path: Path,
    endpoint: str,
    producers: ProducerGroup,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3 batches of 8 rows end the plan before one epoch (48 rows) is trained, so the rule is never judged
    # batch by batch; every row being empty is judged once at the end (it exited 0 before).
    from melfeed import cli as run_pipeline

    monkeypatch.setattr("melfeed.shared.service.lifecycle.setup_logging", lambda *args, **kwargs: None)
    cache, steps, buckets = tmp_path / "cache", 3, {"batch_size": 8, "num_buckets": 2}
    write_demo_cache(cache, n_utterances=48)
    for gone in [*cache.glob("*.pack"), *(cache / "mels").glob("*.npy")]:
        gone.unlink()
    summary = tmp_path / "summary.json"
    config = procs.write_config(
        tmp_path / "run.yaml",
        cache,
        endpoint,
        tmp_path / "state",
        steps,
        buckets=buckets,
        consumer={"feed_efficiency_steps": 0},
    )
    producers.start(cache, endpoint, 1, buckets=buckets)

    assert run_pipeline.main(["consumer", "--config", str(config), "--summary-json", str(summary)]) == 65
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("melfeed consumer: ")]
    s = json.loads(summary.read_text())
    assert s["steps"] == steps and 0 < s["quarantined_samples"] == s["samples"] <= steps * buckets["batch_size"]
    assert line == "melfeed consumer: " + s["error"] and not s["interrupted"]
    assert line.startswith(
        f"melfeed consumer: producer.max_quarantined_fraction: {s['samples']} of the "
        f"{s['samples']} rows trained were quarantined (100.00 %, above 1 %)"
    ), line
    assert line.endswith("the run reached the end of its plan on empty rows: fix the cache and train again"), line
