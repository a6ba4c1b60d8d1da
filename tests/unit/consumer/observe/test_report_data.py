"""Tests for melfeed.consumer.observe.report_data: metrics JSONL -> columns, nulls as gaps, and one-line errors with
FILE:LINE."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from melfeed.consumer.observe import report_data
from melfeed.consumer.observe.report_data import SCALAR_KEYS, parse_lines, read_metrics
from melfeed.shared.errors import ConfigError
from tests.fakes import metrics_snapshot, realistic_run


def _write(path: Path, lines: list[dict[str, object]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + tail)
    return path


def _producer(pid: str, rate: float | None) -> dict[str, object]:
    return {"id": pid, "batches": 10, "batches_per_s": rate, "read_ms": 1.0, "assemble_ms": 0.2, "send_ms": 0.3}


def test_columns_are_aligned_on_seconds_since_the_first_snapshot_and_nulls_are_gaps(tmp_path: Path) -> None:
    lines = [
        metrics_snapshot(1000.0, phase="compiling", step=0, stall_pct=None, step_p50_ms=None, producers=[]),
        metrics_snapshot(1002.5, step=10, stall_pct=1.5, step_p50_ms=80.0),
        metrics_snapshot(1005.0, step=25, stall_pct=0.5, step_p50_ms=None),
    ]
    series = read_metrics(_write(tmp_path / "m.jsonl", lines))
    assert len(series) == 3 and series.t_s.tolist() == [0.0, 2.5, 5.0]
    assert series.phase == ["compiling", "training", "training"]
    assert set(series.scalars) == set(SCALAR_KEYS)
    np.testing.assert_array_equal(series.scalars["stall_pct"], [np.nan, 1.5, 0.5])
    np.testing.assert_array_equal(series.scalars["step_p50_ms"], [np.nan, 80.0, np.nan])
    np.testing.assert_array_equal(series.scalars["step"], [0, 10, 25])
    totals = series.totals()  # means over the training snapshots only
    assert (totals.steps, totals.stall_pct_mean, totals.duration_s) == (25, 1.0, 5.0)


def test_a_late_joining_or_departed_producer_is_a_gap_not_a_zero() -> None:
    lines = [
        metrics_snapshot(0.0, producers=[_producer("producer-1", 5.0)]),
        metrics_snapshot(1.0, producers=[_producer("producer-1", 4.0), _producer("producer-2", 3.0)]),
        metrics_snapshot(2.0, producers=[_producer("producer-2", None)]),
        metrics_snapshot(3.0, producers=[_producer("producer-2", 2.0)]),
    ]
    series = parse_lines([json.dumps(line) for line in lines], "m.jsonl")
    assert list(series.producers) == ["producer-1", "producer-2"]
    np.testing.assert_array_equal(series.producers["producer-1"], [5.0, 4.0, np.nan, np.nan])
    np.testing.assert_array_equal(series.producers["producer-2"], [np.nan, 3.0, np.nan, 2.0])


def test_gpus_are_keyed_role_colon_index_and_absent_gpus_are_empty() -> None:
    series = parse_lines([json.dumps(line) for line in realistic_run(n_lines=40)], "m.jsonl")
    assert list(series.gpus) == ["model:0", "data:1"]
    assert np.isnan(series.gpus["model:0"][:20]).all() and not np.isnan(series.gpus["model:0"][20:]).any()
    assert parse_lines([json.dumps(metrics_snapshot(0.0))], "m").gpus == {}


def test_a_truncated_last_line_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = realistic_run(n_lines=12)
    path = _write(tmp_path / "m.jsonl", lines, tail=json.dumps(metrics_snapshot(99.0))[:37])
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.observe.report_data"):
        series = read_metrics(path)
    assert len(series) == 12
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == [f"{path}:13"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"t_unix_s": 1\n{}\n', "m.jsonl:1: not JSON"),  # truncated, but not the last line
        ("\n\n[1, 2]\n", "m.jsonl:3: not a JSON object"),  # line numbers count blank lines
        ("{GOOD}\n{}\n{GOOD}\n", "m.jsonl:2: missing keys t_unix_s, uptime_s, phase and "),
        ('{GOOD}\n{"t_unix_s": 1, "phase": "training"}\n', "m.jsonl:2: missing keys uptime_s, step"),
        ("{GOOD}\n{STALL}\n", "m.jsonl:2: stall_pct must be a finite number or null, got 'high'"),
        ("{GOOD}\n<t_unix_s=NaN>\n{GOOD}\n", "m.jsonl:2: t_unix_s must be a finite number, got nan"),
        ("{GOOD}\n<t_unix_s=-Infinity>\n{GOOD}\n", "m.jsonl:2: t_unix_s must be a finite number, got -inf"),
        ('{GOOD}\n<t_unix_s="1">\n{GOOD}\n', "m.jsonl:2: t_unix_s must be a finite number, got '1'"),
        ("{GOOD}\n<stall_pct=Infinity>\n{GOOD}\n", "m.jsonl:2: stall_pct must be a finite number or null, got inf"),
        ("{GOOD}\n<step=1" + "0" * 400 + ">\n{GOOD}\n", "m.jsonl:2: step must be a finite number or null"),
        ("<t_unix_s=-1e308>\n<t_unix_s=1e308>\n{GOOD}\n", "m.jsonl:2: t_unix_s is too far from the first"),
        ("[" * 100_000 + "]" * 100_000 + "\n{GOOD}\n", "m.jsonl:1: not JSON (nested too deeply)"),
        ("{GOOD}\n{GPU}\n", "m.jsonl:2: gpus[] needs a string role and an integer index"),
        ("{GOOD}\n{PRODUCERS}\n", "m.jsonl:2: producers must be a list of objects"),
        ("", "m.jsonl: empty: no metrics snapshots"),
        ("\n \n", "m.jsonl: empty: no metrics snapshots"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    good = json.dumps(metrics_snapshot(0.0))
    for override in re.findall(r"<\w+=[^>]+>", text):  # <KEY=VALUE>: a good snapshot with KEY's value set
        key, value = override[1:-1].split("=", 1)  # (written as JSON text: NaN, Infinity are Python's)
        text = text.replace(override, good.replace(f'"{key}": ', f'"{key}": {value}, "_was": ', 1))
    text = (
        text.replace("{GOOD}", good)
        .replace("{STALL}", json.dumps(metrics_snapshot(1.0, stall_pct="high")))
        .replace("{GPU}", json.dumps(metrics_snapshot(1.0, gpus=[{"role": "model", "util_pct": 3.0}])))
        .replace("{PRODUCERS}", json.dumps(metrics_snapshot(1.0, producers={"id": "p"})))
    )
    path = tmp_path / "m.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_metrics(path)
    assert str(info.value).startswith(f"{tmp_path / message}"), str(info.value)
    assert "\n" not in str(info.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'nope.jsonl'}: cannot read metrics file: No such file"):
        read_metrics(tmp_path / "nope.jsonl")


def test_totals_are_nan_when_no_snapshot_has_the_figure() -> None:
    series = parse_lines([json.dumps(metrics_snapshot(0.0, phase="compiling", step=None, batches_per_s=None))], "m")
    totals = series.totals()
    assert totals.steps == 0 and math.isnan(totals.batches_per_s_mean) and totals.duration_s == 0.0


@pytest.mark.parametrize("kind", ["directory", "fifo", "device"])
def test_a_metrics_path_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    path = {"directory": tmp_path, "fifo": tmp_path / "m.jsonl", "device": Path("/dev/zero")}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # an open for reading would wait for a writer for ever
    with pytest.raises(ConfigError) as info:
        read_metrics(path)
    kind_text = {"directory": "directory", "fifo": "fifo", "device": "character device"}[kind]
    assert str(info.value) == f"{path}: cannot read metrics file: not a regular file ({kind_text})"


def test_a_metrics_file_over_the_bound_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "m.jsonl", realistic_run(n_lines=12))
    monkeypatch.setattr(report_data, "MAX_METRICS_BYTES", path.stat().st_size - 1)
    with pytest.raises(
        ConfigError,
        match=f"^{path}: cannot read metrics file: {path.stat().st_size} bytes, more "
        f"than the {path.stat().st_size - 1} allowed$",
    ):
        read_metrics(path)
    monkeypatch.setattr(report_data, "MAX_METRICS_BYTES", path.stat().st_size)
    assert len(read_metrics(path)) == 12  # at the bound: read
