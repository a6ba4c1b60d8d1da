"""Tests for shared.prepare_pool.Progress: a bar on a terminal, plain periodic lines otherwise (time injected)."""

from __future__ import annotations

import io

from shared.prepare_pool import Progress


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
    progress = Progress(100, stream, interval_s=10.0, clock=clock)
    clock.now_s += 5
    progress.update(10, 0)
    assert stream.getvalue() == ""  # not due yet
    clock.now_s += 5
    progress.update(20, 0)
    progress.note("skipped x: /c/wavs/x.wav: missing")
    clock.now_s += 10
    progress.update(39, 1)
    progress.finish()
    assert stream.getvalue().splitlines() == [
        "prepare: 20/100 (20%) 2.0 utterances/s, eta 0m40s, skipped 0",
        "skipped x: /c/wavs/x.wav: missing",
        "prepare: 40/100 (40%) 1.9 utterances/s, eta 0m30s, skipped 1",
        "prepare: 40/100 (40%) 1.9 utterances/s, eta 0m30s, skipped 1",
    ]


def test_bar_redraws_in_place_on_a_terminal_and_notes_do_not_tear_it() -> None:
    stream, clock = _Stream(tty=True), _Clock()
    progress = Progress(10, stream, clock=clock)
    clock.now_s += 1
    progress.update(5, 0)
    progress.note("skipped y: bad")
    clock.now_s += 1
    progress.update(10, 0)
    progress.finish()
    out = stream.getvalue()
    assert out.startswith("\r[" + "#" * 15 + "." * 15 + "] 5/10 (50%) 5.0 utterances/s")
    assert "\r\x1b[Kskipped y: bad\n" in out
    assert out.endswith("] 10/10 (100%) 5.0 utterances/s, eta 0m00s, skipped 0\x1b[K\n")


def test_rate_counts_from_start_not_from_worker_start_up() -> None:
    stream, clock = _Stream(tty=False), _Clock()
    progress = Progress(10, stream, interval_s=1.0, clock=clock)
    clock.now_s += 30  # TensorFlow importing in the workers
    progress.start()
    clock.now_s += 2
    progress.update(4, 0)
    assert stream.getvalue() == "prepare: 4/10 (40%) 2.0 utterances/s, eta 0m03s, skipped 0\n"
