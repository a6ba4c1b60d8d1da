"""A user's step that cannot be built, or fails while training, through the built-in loop in this process.

Either way the run ends with one ``PipelineError`` line (``ConfigError`` for the factory, exit 78; ``StepError``
while training, exit 1) and the summary (``--summary-json``) is written with that line in ``error``: a stale
summary of an earlier run is never left in its place. The factory fails before the consumer binds (no
producer); the step that fails on batch k trains over real producers with a state directory, and its summary
counts what the audit log holds (k batches applied) and the producers that joined.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from melfeed.consumer.feed import Consumer
from melfeed.consumer.resume.audit import audit_state_dir
from melfeed.consumer.resume.state import RunState
from melfeed.consumer.train.loop import train
from melfeed.shared.config.loader import config_from_mapping, load_config
from melfeed.shared.errors import ConfigError, StepError
from tests import procs

_FAIL_AT = 5  # the step fails on its 6th batch: 5 applied before it


def broken_factory(spec: Any) -> Any:
    return {}["hidden"]  # type: ignore[index]  # a user's bug, the subject


def _config(cache: Path, tmp: Path, step: str) -> Any:
    return config_from_mapping(
        {
            "cache_dir": str(cache),
            "transport": {"endpoint": f"ipc://{tmp}/f.sock"},
            "consumer": {"steps": 4, "feed_efficiency_steps": 0},
            "model": {"step": step, "jit_compile": False},
        }
    )


def test_a_factory_that_raises_leaves_its_summary_with_the_one_line_error(demo_cache: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text('{"steps": 300, "error": null}')  # an earlier run's
    cfg = _config(demo_cache, tmp_path, "tests.integration.train.test_step_failures:broken_factory")
    with pytest.raises(ConfigError) as info:
        train(cfg, Consumer(cfg), threading.Event(), process_start_s=time.time(), summary_path=str(summary))
    assert str(info.value).startswith("model.step: the factory raised KeyError: 'hidden' (")
    written = json.loads(summary.read_text())
    assert written["error"] == str(info.value) and written["steps"] == 0


def test_a_step_that_fails_while_training_leaves_its_summary_with_the_audits_counts(
    demo_cache: Path, tmp_path: Path
) -> None:
    summary = tmp_path / "summary.json"
    config = procs.write_config(
        tmp_path / "run.yaml",
        demo_cache,
        f"ipc://{tmp_path}/s.sock",
        tmp_path / "state",
        40,
        producer={"count": 1},  # one: a second may join only after the failure
        consumer={"feed_efficiency_steps": 0},
        buckets={"num_buckets": 2},  # warm-up moves `iterations` once per bucket: < fail_at
        model={"step": "tests.steps:fail_at_step", "params": {"fail_at": _FAIL_AT}},
    )
    cfg = load_config(config)
    producers = procs.start("producer", config, tmp_path / "p.log")
    state = RunState.open(cfg, Consumer(cfg).manifest.fingerprint)
    assert state is not None
    try:
        with Consumer(cfg, start_batch=state.next_batch) as consumer, pytest.raises(StepError) as info:
            train(cfg, consumer, threading.Event(), process_start_s=time.time(), summary_path=str(summary), state=state)
    finally:
        state.close()
        procs.stop(producers)
    written = json.loads(summary.read_text())
    assert written["error"] == str(info.value)
    assert str(info.value).startswith(f"model.step tests.steps:fail_at_step: the step failed on batch {_FAIL_AT}: op ")
    assert (
        "the fail_at check failed" in written["error"] and f"{procs.REPO / 'tests' / 'steps.py'}:" in written["error"]
    )
    assert written["jit_compile"] == "graph"  # the warm-up's figures are kept
    audit = audit_state_dir(tmp_path / "state")
    assert written["steps"] == written["batches_applied"] == audit.applied == _FAIL_AT
    assert written["producers_seen"] == 1  # the receiver's count, as at the end
