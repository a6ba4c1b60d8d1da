"""A user's step that cannot be built, or fails while training, through the built-in loop in this process.

Either way the run ends with one ``PipelineError`` line (``ConfigError`` for the factory, exit 78; ``StepError``
while training, exit 1) and the summary (``--summary-json``) is written with that line in ``error``: a stale
summary of an earlier run is never left in its place. No producer is needed: the factory fails before the
consumer binds, and the training failure is the stager's (``consumer/train/handoff.py`` turns a failing
step into ``StepError``, tests/unit/consumer/train/test_handoff.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from melfeed.consumer.feed import Consumer
from melfeed.consumer.staging import Stager
from melfeed.consumer.train.loop import train
from melfeed.shared.config_loader import config_from_mapping
from melfeed.shared.errors import ConfigError, StepError


def broken_factory(spec: Any) -> Any:
    return {}["hidden"]   # a user's bug


def _config(cache: Path, tmp: Path, step: str) -> Any:
    return config_from_mapping({"cache_dir": str(cache), "transport": {"endpoint": f"ipc://{tmp}/f.sock"},
                                "consumer": {"steps": 4, "feed_efficiency_steps": 0},
                                "model": {"step": step, "jit_compile": False}})


def test_a_factory_that_raises_leaves_its_summary_with_the_one_line_error(demo_cache: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text('{"steps": 300, "error": null}')          # an earlier run's
    cfg = _config(demo_cache, tmp_path, "tests.integration.train.test_step_failures:broken_factory")
    with pytest.raises(ConfigError) as info:
        train(cfg, Consumer(cfg), threading.Event(), process_start_s=time.time(), summary_path=str(summary))
    assert str(info.value).startswith("model.step: the factory raised KeyError: 'hidden' (")
    written = json.loads(summary.read_text())
    assert written["error"] == str(info.value) and written["steps"] == 0


def test_a_step_that_fails_while_training_leaves_its_summary(demo_cache: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_run(self: Stager[Any, Any, Any], *args: Any) -> Iterator[Any]:
        raise StepError("tests.steps:tiny_step", "the step failed on batch 0: op Gather: indices[0] = 50")
        yield   # a generator, like Stager.run

    monkeypatch.setattr(Stager, "run", failing_run)
    summary = tmp_path / "summary.json"
    cfg = _config(demo_cache, tmp_path, "tests.steps:tiny_step")
    with Consumer(cfg) as consumer, pytest.raises(StepError):
        train(cfg, consumer, threading.Event(), process_start_s=time.time(), summary_path=str(summary))
    written = json.loads(summary.read_text())
    assert written["error"] == "model.step tests.steps:tiny_step: the step failed on batch 0: op Gather: indices[0] = 50"
    assert written["jit_compile"] == "graph"                     # the warm-up's figures are kept
