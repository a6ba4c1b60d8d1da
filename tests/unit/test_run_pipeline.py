"""run_pipeline.main: what a command raises becomes one line and an exit code."""

from __future__ import annotations

import argparse

import pytest


def test_ctrl_c_before_a_commands_own_handler_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """e.g. doctor interrupted while it loads the manifest or writes its demo cache: no traceback."""
    import run_pipeline
    import shared.cache.commands as commands

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "main_index", interrupted)
    try:
        code = run_pipeline.main(["index", "/nonexistent"])
    except KeyboardInterrupt:        # escaping, it would end the whole pytest session
        pytest.fail("KeyboardInterrupt escaped main (a traceback for the user)")
    assert code == 130
    assert capsys.readouterr().err == "run_pipeline.py index: stopped by SIGINT\n"
