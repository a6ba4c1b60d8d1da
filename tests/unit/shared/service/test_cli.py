"""``--demo`` on ``producer`` and ``run``: the demo cache's directory becomes ``cache_dir``, written if missing;
a bad flag is a configuration error like any other (one line, exit 78): also ``--log-level`` or
``MELFEED_LOG_LEVEL`` that is no level, ``--debug-delay-ms`` no sleep can take, ``producer --instance`` out of range."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from melfeed.shared.cache.demo_data import DEMO_MARKER
from melfeed.shared.errors import ConfigError
from melfeed.shared.service.cli import build_parser, config_from_args, with_demo_cache
from melfeed.shared.service.lifecycle import LOG_LEVEL_ENV, log_level


@pytest.mark.parametrize("command", ["producer", "run"])
def test_demo_uses_the_default_demo_dir_and_writes_it_once(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = build_parser().parse_args([command, "--demo", "--demo-utterances", "40"])
    cfg = with_demo_cache(args, config_from_args(args))
    expected = tmp_path / "melfeed" / "demo" / "40"
    assert cfg.cache_dir is not None and Path(cfg.cache_dir) == expected
    assert (expected / DEMO_MARKER).exists() and len(list((expected / "mels").glob("*.npy"))) == 40


def test_demo_with_a_cache_dir_writes_the_demo_cache_there(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["producer", "--demo", "--demo-utterances", "30", "--cache-dir", str(tmp_path / "here")]
    )
    cfg = with_demo_cache(args, config_from_args(args))
    assert cfg.cache_dir is not None and Path(cfg.cache_dir) == tmp_path / "here"
    assert (tmp_path / "here" / DEMO_MARKER).exists()


def test_without_demo_the_config_is_left_as_it_is(tmp_path: Path) -> None:
    args = build_parser().parse_args(["producer", "--cache-dir", str(tmp_path)])
    cfg = config_from_args(args)
    assert with_demo_cache(args, cfg) is cfg
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--steps", "x"], "melfeed run: argument --steps: invalid int value: 'x'"),
        (["deploy", "--producers", "two"], "melfeed deploy: argument --producers: invalid int value: 'two'"),
        (["bench", "--no-such-flag"], "melfeed: unrecognized arguments: --no-such-flag"),
        (["launch"], "melfeed: unknown command 'launch': the commands are run, consumer, producer, doctor"),
        (["rnu"], "melfeed: unknown command 'rnu': did you mean 'run'?"),
        (["verify-cahce"], "melfeed: unknown command 'verify-cahce': did you mean 'verify-cache'?"),
        (
            ["run", "--set", "consumer.steps"],
            "melfeed run: argument --set: must be KEY=VALUE (e.g. consumer.steps=100), got 'consumer.steps'",
        ),
        (["doctor", "--set", "seed=[1"], "melfeed doctor: argument --set: seed: invalid YAML"),
        (["config"], "melfeed config: the following arguments are required: ACTION"),
        (["run", "--demo-utterances", "300"], "melfeed run: argument --demo-utterances: needs --demo"),
        (["bench", "--smoke", "--demo-utterances", "5"], "melfeed bench: argument --demo-utterances: needs --demo"),
        (
            ["producer", "--instance", "1", "--producers", "3"],
            "melfeed producer: argument --instance: runs one producer, --producers N starts N under one parent",
        ),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_and_exit_78(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 78 and err.startswith(needle) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv",
    [
        ["keys", ""],
        ["demo-data", "--cache-dir", " "],
        ["index", "--cache-dir", ""],
        ["verify-cache", "--cache-dir", ""],
        ["pack", "--cache-dir", ""],
        ["audit", "/s", ""],
        ["index", "--cache-dir", "/c", "--mels", ""],
        ["prepare", "--ljspeech", "/l", "--cache-dir", ""],
        ["report", "m.jsonl", "-o", ""],
        ["audit", "/s", "-o", ""],
        ["deploy", "--producers", "1", "--user", "u", "--target-dir", ""],
        ["deploy", "--producers", "1", "--user", "u", "--prefix", ""],
        ["run", "--cache-dir", ""],
        ["consumer", "--config", ""],
        ["producer", "--tf-config", ""],
        ["doctor", "--output", ""],
        ["bench", "-o", ""],
        ["bench", "--cache-dir", ""],
        ["status", "--config", ""],
        ["status", "-o", ""],
    ],
)
def test_an_empty_path_argument_is_refused_before_it_can_mean_the_current_directory(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``keys ""`` wrote the key pairs into the current directory and ``demo-data ""`` a whole cache, exit 0."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 78 and err.count("\n") == 1, err
    assert "must be a path (an empty one would mean the current directory)" in err


def test_the_jax_client_refuses_a_bad_flag_the_same_way() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed.consumer.clients.jax_bench", "--depths"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[4],
    )
    assert proc.returncode == 78
    assert (
        proc.stderr
        == "python -m melfeed.consumer.clients.jax_bench: argument --depths: expected one argument (see --help)\n"
    )


REPO = Path(__file__).resolve().parents[4]


def _main(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV} | env
    return subprocess.run(
        [sys.executable, "-m", "melfeed", *argv], capture_output=True, text=True, timeout=60, cwd=REPO, env=environ
    )


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (
            ["status", "--log-level", "basic_format"],
            {},
            "melfeed status: --log-level: must be one of DEBUG, INFO, "
            "WARNING, ERROR, CRITICAL (any case), got 'basic_format'",
        ),
        (
            ["audit", "/nonexistent"],
            {LOG_LEVEL_ENV: "BOGUS"},
            "melfeed audit: MELFEED_LOG_LEVEL: must be one of "
            "DEBUG, INFO, WARNING, ERROR, CRITICAL (any case), got 'BOGUS'",
        ),
        (["bench", "--log-level", "BOGUS"], {}, "melfeed bench: --log-level: must be one of"),
        (["bench", "--log-level", "INFO"], {LOG_LEVEL_ENV: "root"}, "melfeed bench: MELFEED_LOG_LEVEL: must be"),
    ],
)
def test_a_log_level_that_is_no_level_is_one_line_naming_its_source(
    argv: list[str], env: dict[str, str], needle: str
) -> None:
    proc = _main(argv, **env)
    assert proc.returncode == 78 and proc.stderr.startswith(needle) and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("env", [{LOG_LEVEL_ENV: "debug"}, {LOG_LEVEL_ENV: " Warning "}, {LOG_LEVEL_ENV: ""}, {}])
def test_a_level_name_in_any_case_or_none_is_accepted(env: dict[str, str]) -> None:
    proc = _main(["audit", "/nonexistent"], **env)  # gets past logging to the command's own refusal
    assert proc.returncode == 78 and proc.stderr == (
        "melfeed audit: /nonexistent: no run.json: not a melfeed state directory (consumer.state_dir)\n"
    ), proc.stderr
    assert [log_level(name) for name in ("debug", "Info", "WARNING", "error", "critical")] == [10, 20, 30, 40, 50]
    with pytest.raises(ConfigError, match="^MELFEED_LOG_LEVEL: must be one of"):
        log_level("NOTSET", LOG_LEVEL_ENV)  # logging has it, but it would log nothing useful


@pytest.mark.parametrize("command", ["run", "producer", "doctor", "prepare"])
@pytest.mark.parametrize(
    ("delay", "reason"),
    [
        ("-100", "must be a finite number >= 0"),
        ("nan", "must be a finite number >= 0"),
        ("inf", "must be a finite number >= 0"),
        ("1e300", "must be <= 3600000"),
    ],
)
def test_a_debug_delay_that_no_sleep_can_take_is_refused_before_anything_starts(
    command: str, delay: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--ljspeech", "/x", "--cache-dir", "/y"] if command == "prepare" else []
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([command, *extra, "--debug-delay-ms", delay])
    assert stop.value.code == 78
    assert capsys.readouterr().err == (
        f"melfeed {command}: argument --debug-delay-ms: {reason}, got {delay!r} (see --help)\n"
    )
    assert build_parser().parse_args([command, *extra, "--debug-delay-ms", "2.5"]).debug_delay_ms == 2.5


@pytest.mark.parametrize(
    ("instance", "needle"),
    [
        (-1, "must be >= 1 (systemd's producer@N numbers instances from 1)"),
        (0, "must be >= 1 (systemd's producer@N numbers instances from 1)"),
        (65, "must be in 1..64 (the bound on producer.count)"),
    ],
)
def test_a_producer_instance_outside_1_to_the_count_cap_is_refused(instance: int, needle: str, tmp_path: Path) -> None:
    from melfeed.producer.app import main_producer

    args = build_parser().parse_args(["producer", "--instance", str(instance), "--cache-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=f"^--instance: {re.escape(needle)}, got {instance}$"):
        main_producer(args)
    assert not list(tmp_path.iterdir())  # refused before anything was read or written


def test_an_instance_above_the_configs_count_is_accepted_as_systemd_rescaling_needs() -> None:
    from melfeed.producer.app import _check_instance
    from melfeed.shared.config import PipelineConfig

    cfg = PipelineConfig()
    for instance in (1, cfg.producer.count + 2, 64):  # deploy --producers 4 with count 2; producer@7 by hand
        _check_instance(cfg, instance)


def test_every_log_level_flag_defaults_as_its_help_says() -> None:
    """``--log-level`` left out means ``$MELFEED_LOG_LEVEL``, else INFO (docs/reference/commands.md), for every
    command but
    ``status``, whose help says it stays at WARNING; a default the help does not state would ignore the variable."""
    import argparse

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    required = {
        "prepare": ["--ljspeech", "/x", "--cache-dir", "/y"],
        "deploy": ["--producers", "1", "--user", "u"],
        "report": ["m.jsonl", "-o", "m.png"],
        "index": ["--cache-dir", "/c"],
        "pack": ["--cache-dir", "/c"],
        "verify-cache": ["--cache-dir", "/c"],
        "demo-data": ["--cache-dir", "/c"],
        "audit": ["/s"],
        "keys": ["/k"],
    }
    seen = []
    for name, sub in subparsers.choices.items():
        flag = next((a for a in sub._actions if "--log-level" in a.option_strings), None)
        if flag is None:
            continue
        seen.append(name)
        default = parser.parse_args([name, *required.get(name, [])]).log_level
        if name == "status":
            assert default == "WARNING" and "default: WARNING" in (flag.help or "")
        else:
            assert default is None and "$MELFEED_LOG_LEVEL" in (flag.help or ""), name
    assert {"run", "consumer", "producer", "doctor", "prepare", "bench", "status", "index", "audit"} <= set(seen)


def test_every_commands_help_states_its_exit_codes() -> None:
    """docs/reference/exit-codes.md is per command too: each command's own --help opens with its codes (0 and 78 at
    least)."""
    import argparse

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = [
        name
        for name, sub in subparsers.choices.items()
        if not (sub.description and "exit 0" in sub.description and "78" in sub.description)
    ]
    assert silent == []
