"""run_pipeline.main: what a command raises becomes one line and an exit code."""

from __future__ import annotations

import argparse

import pytest

from melfeed.producer.reader import TransientReadError
from melfeed.shared.errors import (
    EXIT_CONFIG,
    EXIT_DATA,
    EXIT_JOB_LOST,
    CacheError,
    ClosedError,
    ConfigError,
    DataError,
    JobLostError,
    PipelineError,
    ProtocolError,
    StateError,
    StepError,
)
from melfeed.shared.wire.messages import RejectCode


def test_ctrl_c_before_a_commands_own_handler_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """e.g. doctor interrupted while it loads the manifest or writes its demo cache: no traceback."""
    import melfeed.shared.cache.commands as commands
    from melfeed import cli as run_pipeline

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "main_index", interrupted)
    try:
        code = run_pipeline.main(["index", "--cache-dir", "/nonexistent"])
    except KeyboardInterrupt:  # escaping, it would end the whole pytest session
        pytest.fail("KeyboardInterrupt escaped main (a traceback for the user)")
    assert code == 130
    assert capsys.readouterr().err == "melfeed index: stopped by SIGINT\n"


# Each error a command can end on, and the code ``melfeed`` exits with (README "Exit codes").
_EXIT_CODES = [
    (ConfigError("must be >= 1", path=("credit", "initial_credits"), got=0), 78),
    (CacheError("/cache/manifest.json", "missing"), 78),
    (TransientReadError("/cache/mels.npy", "cannot open (Too many open files)"), 78),
    (StateError("/state", "another dataset's checkpoint"), 78),
    (StateError("/state/audit.log", "fsync failed: No space left on device", fatal=False), 1),
    (DataError("producer.max_quarantined_fraction: 0.5 of the rows quarantined"), 65),
    (JobLostError(1, "peer gone"), 75),
    (StepError("my.step:make", "XLA cannot compile it"), 1),
    (ProtocolError(RejectCode.TYPE, "unknown message kind 9"), 1),
    (ClosedError("ring closed"), 1),
    (PipelineError("something failed"), 1),
]


@pytest.mark.parametrize(
    ("error", "code"), _EXIT_CODES, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v)
)
def test_each_error_a_command_ends_on_is_one_line_and_its_exit_code(
    error: PipelineError, code: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import melfeed.shared.cache.commands as commands
    from melfeed import cli as run_pipeline

    def failing(args: argparse.Namespace) -> int:
        raise error

    monkeypatch.setattr(commands, "main_index", failing)
    assert run_pipeline.main(["index", "--cache-dir", "/nonexistent"]) == code
    assert capsys.readouterr().err == f"melfeed index: {error}\n"


def _error_classes(root: type[PipelineError]) -> list[type[PipelineError]]:
    """``root`` and every class below it that is imported (TransientReadError: producer/reader.py, above)."""
    return [root, *(c for sub in root.__subclasses__() for c in _error_classes(sub))]


def test_every_error_class_says_what_it_means_and_carries_a_documented_exit_code() -> None:
    codes = {1, EXIT_CONFIG, EXIT_DATA, EXIT_JOB_LOST}
    for cls in _error_classes(PipelineError):
        assert cls.__doc__ and cls.__doc__.strip(), cls
        assert cls.exit_code in codes, cls


@pytest.mark.parametrize(
    "argv",
    [
        ["deploy", "--producers", "1", "--user", "root", "--prefix", "{loop}"],
        ["deploy", "--producers", "1", "--user", "root", "--config", "{loop}"],
        ["deploy", "--producers", "1", "--user", "root", "--tf-config", "{loop}", "--rank", "0"],
        ["index", "--cache-dir", "{tmp}/new", "--mels", "{loop}"],
        ["index", "--cache-dir", "{loop}", "--tokens", "{tmp}"],
        ["producer", "--cache-dir", "{loop}"],
        ["doctor", "--cache-dir", "{loop}"],
    ],
    ids=[
        "deploy-prefix",
        "deploy-config",
        "deploy-tf-config",
        "index-mels",
        "index-cache-dir",
        "producer-cache-dir",
        "doctor-cache-dir",
    ],
)
def test_a_symlink_loop_in_a_path_flag_is_one_line_and_exit_78(
    argv: list[str], tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """Path.resolve() raises RuntimeError on a loop (Python < 3.13): it must be named, not a traceback."""
    import os

    from melfeed import cli as run_pipeline

    loop = os.path.join(str(tmp_path), "loop")
    os.symlink(loop + "-b", loop)
    os.symlink(loop, loop + "-b")
    code = run_pipeline.main([a.format(loop=loop, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 78, err
    assert err.count("\n") == 1 and f"cannot resolve {loop}: a loop of symbolic links" in err


def test_a_state_dir_in_a_symlink_loop_names_the_key(tmp_path: object) -> None:
    """consumer --state-dir LOOP: the XLA cache under it is resolved before TensorFlow loads."""
    import os

    from melfeed.consumer.placement import xla_cache_dir
    from melfeed.shared.config.loader import config_from_mapping
    from melfeed.shared.errors import ConfigError

    loop = os.path.join(str(tmp_path), "loop")
    os.symlink(loop + "-b", loop)
    os.symlink(loop, loop + "-b")
    with pytest.raises(ConfigError, match=r"^consumer\.state_dir: cannot resolve .*: a loop of symbolic links"):
        xla_cache_dir(config_from_mapping({"consumer": {"state_dir": loop}}))


def test_a_bad_manifest_is_one_line_from_the_producer_group_not_one_per_child(
    tmp_path: object, capfd: pytest.CaptureFixture[str]
) -> None:
    """``producer --producers 3`` on a cache whose manifest is not JSON: the parent refuses it before any child
    starts (otherwise each child prints the same line, then the supervisor a fourth)."""
    import os

    from melfeed import cli as run_pipeline

    cache = os.path.join(str(tmp_path), "cache")
    os.makedirs(cache)
    with open(os.path.join(cache, "manifest.json"), "w", encoding="utf-8") as out:
        out.write("garbage{")
    code = run_pipeline.main(["producer", "--cache-dir", cache, "--producers", "3", "--log-level", "ERROR"])
    err = capfd.readouterr().err
    assert code == 78
    assert (
        err == f"melfeed producer: {cache}/manifest.json: malformed manifest: Expecting value: line 1 "
        "column 1 (char 0)\n"
    )
