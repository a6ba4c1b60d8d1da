"""``prepare``'s flags and cache directory: refused with one line before any worker starts (no TensorFlow here)."""

from __future__ import annotations

import logging
import math
import os
import threading
from io import StringIO
from pathlib import Path

import pytest

from melfeed.producer.prepare.command import debug_delay_s, run_prepare, worker_count
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import CacheError, ConfigError
from tests.cli_run import refusal, run_cli

CPUS = len(os.sched_getaffinity(0))


def test_no_workers_flag_means_one_per_available_cpu() -> None:
    assert worker_count(None) == CPUS
    assert worker_count(1) == 1 and worker_count(CPUS) == CPUS


@pytest.mark.parametrize("workers", [0, -1, -100000])
def test_a_worker_count_below_one_is_refused_naming_the_flag(workers: int) -> None:
    with pytest.raises(ConfigError, match=f"^--workers: must be >= 1 .*, got {workers}$"):
        worker_count(workers)  # 0 silently meant one per CPU, -1 silently one worker


@pytest.mark.parametrize("workers", [CPUS + 1, 100_000])
def test_more_workers_than_cpus_are_lowered_to_the_cpus_with_one_info_line(
    workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="melfeed.producer.prepare.command"):
        assert worker_count(workers) == CPUS  # 100000 would have started 100000 processes
    [line] = [r.getMessage() for r in caplog.records]
    assert line == f"--workers {workers} is above the {CPUS} available CPUs: using {CPUS}"


@pytest.mark.parametrize("delay_ms", [-5.0, -0.001, math.nan, math.inf, 60_001.0])
def test_a_debug_delay_that_is_negative_nan_or_past_a_minute_is_refused(delay_ms: float) -> None:
    with pytest.raises(ConfigError, match="^--debug-delay-ms: must be in 0..60000, got "):
        debug_delay_s(delay_ms)  # -5 was a traceback in every worker


def test_a_debug_delay_in_range_is_seconds() -> None:
    assert debug_delay_s(0.0) == 0.0 and debug_delay_s(80.0) == pytest.approx(0.08) and debug_delay_s(60_000.0) == 60.0


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "wavs").mkdir(parents=True)
    (root / "metadata.csv").write_text("a|hello|hello\n")
    return root


def test_a_cache_directory_that_cannot_be_made_is_one_cache_error(corpus: Path, tmp_path: Path) -> None:
    cfg = config_from_mapping({})
    for cache, reason in (
        (Path("/proc/melfeed-c"), "cannot create the directory (No such file or directory)"),
        (tmp_path / "corpus" / "metadata.csv", "not a directory"),
    ):
        with pytest.raises(CacheError) as info:
            run_prepare(corpus, cache, cfg, 1, threading.Event(), StringIO())
        assert str(info.value) == f"{cache}: {reason}"


def test_the_cli_refuses_bad_flags_and_a_read_only_parent_in_one_line(corpus: Path, tmp_path: Path) -> None:
    base = ("prepare", "--ljspeech", str(corpus), "--cache-dir")
    assert refusal(run_cli(*base, str(tmp_path / "c"), "--workers", "0"), "prepare").startswith(
        "--workers: must be >= 1"
    )
    assert (
        refusal(run_cli(*base, str(tmp_path / "c"), "--debug-delay-ms", "-5"), "prepare")
        == "argument --debug-delay-ms: must be a finite number >= 0, got '-5' (see --help)"
    )  # the parser's check
    assert (
        refusal(run_cli(*base, str(tmp_path / "c"), "--debug-delay-ms", "70000"), "prepare")
        == "--debug-delay-ms: must be in 0..60000, got 70000.0"
    )  # prepare's own bound
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    assert (
        refusal(run_cli(*base, str(parent / "c"), unprivileged=True), "prepare")
        == f"{parent / 'c'}: cannot create the directory (Permission denied)"
    )
    assert not (tmp_path / "c").exists()
