"""``buckets.batch_size: auto`` on a real compiled TensorFlow step on the CPU, and the out-of-memory pre-flight."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from melfeed.consumer.train import auto_rows, rows_probe
from melfeed.consumer.train.auto_rows import CACHE_NAME, resolve_rows
from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.preflight import out_of_memory_is_config
from melfeed.consumer.train.step import CompiledStep, build_step
from melfeed.consumer.train.warm_batches import sample_batch
from melfeed.shared.cache.features import load_manifest_for
from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import build_buckets

pytestmark = pytest.mark.tf


def _cfg(cache: Path, **model: Any) -> PipelineConfig:
    return config_from_mapping(
        {
            "cache_dir": str(cache),
            "buckets": {"batch_size": "auto", "max_batch_size": 8, "num_buckets": 2},
            "model": {"step": "tests.steps:tiny_step", "jit_compile": False, **model},
        }
    )


def test_auto_rows_are_searched_once_then_read_from_the_state_directory(
    demo_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(demo_cache)
    manifest = load_manifest_for(cfg, feeds_model=False)
    state: Any = SimpleNamespace(root=tmp_path, next_batch=0)
    with caplog.at_level(logging.INFO, logger="melfeed.consumer.train.auto_rows"):
        resolved = resolve_rows(cfg, manifest, state)
    rows = resolved.buckets.rows
    assert rows is not None and len(rows) == 2 and all(1 <= r <= 8 for r in rows)
    assert (
        build_buckets(manifest.frames, manifest.token_counts, cfg.n_mels, resolved.buckets).as_wire()[0][1] == rows[0]
    )
    (entry,) = json.loads((tmp_path / CACHE_NAME).read_text())["entries"].values()
    assert entry["rows"] == list(rows) and entry["fingerprint"] == manifest.fingerprint
    assert "trials" in caplog.text

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("searched although the state directory holds the rows")

    monkeypatch.setattr(rows_probe, "StepTrials", no_search)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="melfeed.consumer.train.auto_rows"):
        assert resolve_rows(cfg, manifest, state).buckets.rows == rows
    assert "no search" in caplog.text
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, learning_rate=0.5))  # another identity
    assert auto_rows.rows_identity(other, manifest.fingerprint, "x") != auto_rows.rows_identity(
        cfg, manifest.fingerprint, "x"
    )
    resumed: Any = SimpleNamespace(root=tmp_path, next_batch=5)  # a checkpoint to resume: the plan keeps its rows
    assert resolve_rows(other, manifest, resumed).buckets.rows == rows
    assert json.loads((tmp_path / CACHE_NAME).read_text())["plan_rows"] == list(rows)


def test_auto_rows_stop_below_the_rows_that_run_out_of_memory(demo_cache: Path) -> None:
    cfg = _cfg(demo_cache, step="tests.steps:memory_bound_step", params={"max_rows": 2})
    resolved = resolve_rows(cfg, load_manifest_for(cfg, feeds_model=False), None)  # no state dir: searches
    assert resolved.buckets.rows is not None and all(1 <= r <= 2 for r in resolved.buckets.rows)


def test_a_bucket_out_of_memory_at_warm_up_is_one_config_line(demo_cache: Path) -> None:
    cfg = config_from_mapping(
        {
            "cache_dir": str(demo_cache),
            "buckets": {"batch_size": 4, "num_buckets": 2},
            "model": {"step": "tests.steps:memory_bound_step", "jit_compile": False, "params": {"max_rows": 3}},
        }
    )
    manifest = load_manifest_for(cfg, feeds_model=False)
    buckets = build_buckets(manifest.frames, manifest.token_counts, cfg.n_mels, cfg.buckets)
    shapes = [b.shapes() for b in buckets.buckets]
    step = build_step(cfg.model.step, StepSpec.from_config(cfg, shapes, None))
    compiled = CompiledStep(step, shapes, jit_compile=False, factory=cfg.model.step)
    with pytest.raises(ConfigError) as err, out_of_memory_is_config(buckets, largest_fitting=[3, 3]):
        compiled.warm_up([sample_batch(buckets, manifest, b) for b in buckets.buckets])
    line = str(err.value)
    assert "\n" not in line and line.startswith("buckets.batch_size: bucket 0 ")
    assert "at 4 rows" in line and "the largest that fits is 3 rows" in line
