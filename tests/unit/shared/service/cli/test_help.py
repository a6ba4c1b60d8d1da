"""What ``melfeed --help`` and every command's ``--help`` promise: each default shown (a config-backed flag's read
from the schema, with its key), options in the six groups, test-only flags hidden but accepted; ``--version``,
a bare ``melfeed`` and a mistyped command."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from melfeed.shared.service.cli import build_parser
from melfeed.shared.service.cli.options import GROUPS, HelpFormatter, schema_default, shown
from melfeed.shared.service.cli.settings import OVERRIDES

REPO = Path(__file__).resolve().parents[5]
_CONFIG_KEYS = {**OVERRIDES, "n_mels": "n_mels", "mel_dtype": "transport.mel_dtype"}  # flag dest -> key
_APPLY_OVERRIDES = {"melfeed run", "melfeed consumer", "melfeed producer", "melfeed doctor"}  # config_from_args


def _commands(
    parser: argparse.ArgumentParser, prefix: str = "melfeed"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser, ``config show`` included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _commands(sub, f"{prefix} {name}")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text argparse prints for ``action``, before wrapping (argparse has no public call for it)."""
    return HelpFormatter(parser.prog)._expand_help(action)  # noqa: SLF001


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if action.help != argparse.SUPPRESS and not isinstance(
            action, (argparse._HelpAction, argparse._SubParsersAction)
        ):
            yield action


def test_every_option_with_a_default_or_a_config_key_shows_its_default_in_the_help() -> None:
    """A config-backed flag (``OVERRIDES`` on the commands that apply them, or any help naming a key) shows the
    schema's default; any other option with a default shows it. A switch (``store_true``) is off unless named:
    it has no value to show."""
    missing = []
    for name, parser in _commands(build_parser()):
        for action in _options(parser):
            text = _help(parser, action)
            named = re.search(r"\(([a-z_.]+), default ", text)
            key = named.group(1) if named else _CONFIG_KEYS.get(action.dest) if name in _APPLY_OVERRIDES else None
            if key is not None:
                if f"({key}, default {shown(schema_default(key))}" not in text:
                    missing.append(f"{name} {action.option_strings[0]}: {text}")
            elif action.default not in (None, argparse.SUPPRESS) and action.nargs != 0:
                if "default" not in text or (str(action.default) not in text and "$" not in text):
                    missing.append(f"{name} {action.option_strings or action.dest}: {text}")
    assert missing == []


def test_a_config_backed_default_is_read_from_the_schema_when_the_parser_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not a number copied into the help: change the dataclass default and the help follows."""
    import dataclasses

    from melfeed.shared.config import ConsumerConfig

    field = next(f for f in dataclasses.fields(ConsumerConfig) if f.name == "ring_slots")
    monkeypatch.setattr(field, "default", 7)
    run = dict(_commands(build_parser()))["melfeed run"]
    slots = next(a for a in run._actions if a.dest == "ring_slots")
    assert "(consumer.ring_slots, default 7)" in _help(run, slots)
    assert slots.default is None  # the flag only overrides what --config / --set gave when it is given


def test_options_come_in_the_six_groups_and_run_help_is_grouped() -> None:
    for name, parser in _commands(build_parser()):
        titles = [g.title for g in parser._action_groups if g._group_actions]
        assert set(titles) <= {"positional arguments", "options", "actions", *GROUPS}, name
        loose = [
            a.option_strings
            for g in parser._action_groups
            if g.title == "options"
            for a in g._group_actions
            if not isinstance(a, argparse._HelpAction)
        ]
        assert loose == [], name
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed", "run", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: melfeed run [options]\n")
    heads = [line[:-1] for line in proc.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert heads == ["options", "common", "data", "transport", "training", "observability"], heads


@pytest.mark.parametrize("command", ["run", "producer", "doctor", "prepare"])
def test_the_test_only_delay_flag_is_hidden_from_help_but_accepted(command: str) -> None:
    parsers = dict(_commands(build_parser()))
    assert "--debug-delay-ms" not in parsers[f"melfeed {command}"].format_help()
    extra = ["--ljspeech", "/x", "--cache-dir", "/y"] if command == "prepare" else []
    assert build_parser().parse_args([command, *extra, "--debug-delay-ms", "5"]).debug_delay_ms == 5.0


def _main(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "melfeed", *argv], capture_output=True, text=True, timeout=60, cwd=REPO
    )


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    proc = _main("--version")
    assert (proc.returncode, proc.stdout) == (0, f"melfeed {version('melfeed')}\n") and version("melfeed") == "0.1.0"


def test_a_bare_melfeed_prints_the_command_overview_and_exits_0() -> None:
    proc = _main()
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == build_parser().format_help()
    assert "  run " in proc.stdout and "  config " in proc.stdout


def test_a_mistyped_command_is_one_line_naming_the_nearest_and_exit_78() -> None:
    proc = _main("rnu", "--steps", "3")
    assert (proc.returncode, proc.stdout) == (78, "")
    assert proc.stderr == "melfeed: unknown command 'rnu': did you mean 'run'? (see --help)\n"


def test_no_command_returns_2_and_prepare_exits_128_plus_its_signal() -> None:
    """Exit 2 is argparse's usage error, which is 78 here; nothing else may return 2."""
    import ast

    twos = []
    for package in ("consumer", "producer", "shared"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and node.value.value == 2:
                    twos.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert twos == []
