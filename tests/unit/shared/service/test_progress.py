"""Tests for melfeed.shared.service.progress.Progress: a bar on a terminal, plain periodic lines otherwise (time
injected)."""

from __future__ import annotations

import io

import pytest

from melfeed.shared.errors import ConfigError
from melfeed.shared.service.progress import PROGRESS_ENV, Progress, progress_interval_s


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_plain_lines_every_interval_when_not_a_terminal() -> None:
    stream, clock = _Stream(tty=False), _Clock()
    progress = Progress(
        100, stream, interval_s=10.0, clock=clock, label="prepare", unit="utterances", count_skipped=True
    )
    clock.now_s += 5
    progress.update(10, 0)
    assert stream.getvalue() == ""  # not due yet
    clock.now_s += 5
    progress.update(20, 0)
    progress.note("skipped x: /c/wavs/x.wav: missing")
    clock.now_s += 9
    progress.update(30, 1)
    assert "\r" not in stream.getvalue() and len(stream.getvalue().splitlines()) == 2  # 9 s < interval
    clock.now_s += 1
    progress.update(39, 1)
    progress.finish()
    progress.finish()  # idempotent
    assert stream.getvalue().splitlines() == [
        "prepare: 20/100 (20%) 2.0 utterances/s, eta 0m40s, skipped 0",
        "skipped x: /c/wavs/x.wav: missing",
        "prepare: 40/100 (40%) 1.9 utterances/s, eta 0m30s, skipped 1",
        "prepare: 40/100 (40%) 1.9 utterances/s, eta 0m30s, skipped 1",
    ]


def test_bar_redraws_in_place_on_a_terminal_and_notes_do_not_tear_it() -> None:
    stream, clock = _Stream(tty=True), _Clock()
    progress = Progress(10, stream, label="index", unit="files", clock=clock)
    clock.now_s += 1
    progress.update(5)
    progress.note("skipped y: bad")
    clock.now_s += 0.05
    progress.update(6)  # under the redraw interval: nothing drawn
    clock.now_s += 0.95
    progress.update(10)
    progress.finish()
    out = stream.getvalue()
    assert out.startswith("\rindex [" + "#" * 15 + "." * 15 + "] 5/10 (50%) 5.0 files/s, eta 0m01s\x1b[K")
    assert "6/10" not in out
    assert "\r\x1b[Kskipped y: bad\n" in out
    assert out.count("\n") == 2  # the note and the final line: the bar itself never ends a line early
    assert out.endswith("\rindex [" + "#" * 30 + "] 10/10 (100%) 5.0 files/s, eta 0m00s\x1b[K\n")


def test_rate_counts_from_start_not_from_worker_start_up() -> None:
    stream, clock = _Stream(tty=False), _Clock()
    progress = Progress(10, stream, label="prepare", unit="utterances", interval_s=1.0, clock=clock)
    clock.now_s += 30  # TensorFlow importing in the workers
    progress.start()
    clock.now_s += 2
    progress.update(4, 0)
    assert stream.getvalue() == "prepare: 4/10 (40%) 2.0 utterances/s, eta 0m03s\n"


def test_the_skip_count_appears_once_something_is_skipped() -> None:
    stream, clock = _Stream(tty=False), _Clock()
    progress = Progress(10, stream, 0.0, clock, label="doctor", unit="stages")  # positional interval, clock
    clock.now_s += 1
    progress.update(1)
    clock.now_s += 1
    progress.update(2, 1)
    assert stream.getvalue().splitlines() == [
        "doctor: 1/10 (10%) 1.0 stages/s, eta 0m09s",
        "doctor: 3/10 (30%) 1.0 stages/s, eta 0m04s, skipped 1",
    ]


def test_callback_learns_the_total_and_long_etas_show_hours() -> None:
    stream, clock = _Stream(tty=False), _Clock()
    progress = Progress(0, stream, label="verify-cache", unit="utterances", interval_s=5.0, clock=clock)
    callback = progress.callback()
    clock.now_s += 10
    callback(1, 1000)
    progress.finish()
    assert stream.getvalue().splitlines() == ["verify-cache: 1/1000 (0%) 0.1 utterances/s, eta 2h46m"] * 2


def test_an_empty_job_prints_nothing() -> None:
    stream = _Stream(tty=True)
    progress = Progress(0, stream, clock=_Clock())
    progress.finish()
    assert stream.getvalue() == ""


def test_interval_comes_from_the_environment_and_a_bad_value_names_the_variable() -> None:
    assert progress_interval_s(5.0, {}) == 5.0
    assert progress_interval_s(5.0, {PROGRESS_ENV: ""}) == 5.0
    assert progress_interval_s(5.0, {PROGRESS_ENV: "0.01"}) == 0.01
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ConfigError, match=f"{PROGRESS_ENV}: must be a number of seconds >= 0"):
            progress_interval_s(5.0, {PROGRESS_ENV: bad})
