"""Tests for the cache commands (index, verify-cache, pack) as run: progress on stderr, results on stdout, and a
bad flag or unusable directory refused with one line and exit 78."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.features import N_MELS_MAX, check_n_mels_flag
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError
from tests.cli_run import refusal, run_cli

REPO = Path(__file__).resolve().parents[4]
N = 12


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "cache"
    write_demo_cache(path, n_utterances=N)
    (path / "manifest.json").unlink()
    return path


def _index(cache: Path, progress_s: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "melfeed", "index", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MELFEED_PROGRESS_S": progress_s},
    )


def _progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("index: ")]  # log lines share stderr


def test_index_prints_progress_lines_to_stderr_when_not_a_terminal(cache: Path) -> None:
    proc = _index(cache, "0")  # every header read is due: one line each, then the final line
    assert proc.returncode == 0, proc.stderr
    lines = _progress_lines(proc.stderr)
    assert [line.split(" ")[1] for line in lines] == [f"{d}/{N}" for d in range(1, N + 1)] + [f"{N}/{N}"]
    assert all(" utterances/s, eta " in line for line in lines), lines
    assert lines[-1].startswith(f"index: {N}/{N} (100%) ")
    assert "\r" not in proc.stderr and "\x1b" not in proc.stderr
    assert proc.stdout.startswith(f"indexed {N} utterances")


def test_index_with_the_default_interval_prints_only_the_final_line(cache: Path) -> None:
    proc = _index(cache, "")
    assert proc.returncode == 0, proc.stderr
    lines = _progress_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"index: {N}/{N} (100%) "), proc.stderr


def test_a_bad_progress_interval_is_one_line_naming_the_variable(cache: Path) -> None:
    proc = _index(cache, "soon")
    assert proc.returncode == 78
    assert proc.stderr.splitlines() == [
        "melfeed index: MELFEED_PROGRESS_S: must be a number of seconds >= 0, got 'soon'"
    ]


def _copy(cache: Path, to: Path) -> Path:
    shutil.copytree(cache, to, symlinks=True)
    return to


@pytest.mark.parametrize("command", ["index", "verify-cache", "pack"])
@pytest.mark.parametrize("n_mels", ["0", "-5", "1025", "99999999999999999999"])
def test_an_n_mels_no_cache_can_have_is_refused_as_the_flag_not_as_every_file(
    cache: Path, command: str, n_mels: str
) -> None:
    line = refusal(run_cli(command, "--cache-dir", str(cache), "--n-mels", n_mels), command)
    assert line == f"--n-mels: must be in 1..1024 (mel bins per frame, as the config's n_mels), got {n_mels}"


def test_the_n_mels_bound_is_the_configs() -> None:
    PipelineConfig(n_mels=N_MELS_MAX)
    with pytest.raises(ConfigError, match="n_mels"):
        PipelineConfig(n_mels=N_MELS_MAX + 1)
    assert check_n_mels_flag(1) == 1 and check_n_mels_flag(N_MELS_MAX) == N_MELS_MAX


def test_index_into_a_directory_it_cannot_create_or_write_is_one_line(cache: Path, tmp_path: Path) -> None:
    line = refusal(
        run_cli(
            "index", "--cache-dir", "/proc/melfeed-c", "--mels", str(cache / "mels"), "--tokens", str(cache / "tokens")
        ),
        "index",
    )
    assert line == "/proc/melfeed-c: cannot create the directory (No such file or directory)"
    in_the_way = _copy(cache, tmp_path / "dir")
    (in_the_way / "manifest.json").unlink(missing_ok=True)
    (in_the_way / "manifest.json").mkdir()
    assert (
        refusal(run_cli("index", "--cache-dir", str(in_the_way)), "index")
        == f"{in_the_way}/manifest.json: cannot write (Is a directory)"
    )
    read_only = _copy(cache, tmp_path / "ro")
    (read_only / "manifest.json").unlink(missing_ok=True)
    read_only.chmod(0o555)
    assert (
        refusal(run_cli("index", "--cache-dir", str(read_only), unprivileged=True), "index")
        == f"{read_only}/manifest.json: cannot write (Permission denied)"
    )
    assert sorted(p.name for p in read_only.iterdir()) == sorted(
        p.name for p in cache.iterdir() if p.name != "manifest.json"
    )


@pytest.mark.parametrize("command", ["index", "verify-cache"])
def test_a_mels_directory_that_cannot_be_read_is_one_line_and_exit_78(
    cache: Path, tmp_path: Path, command: str
) -> None:
    copy = _copy(cache, tmp_path / "c")
    (copy / "mels").chmod(0o000)
    try:
        line = refusal(run_cli(command, "--cache-dir", str(copy), unprivileged=True), command)
    finally:
        (copy / "mels").chmod(0o755)
    assert line == f"{copy}/mels: cannot read the directory (Permission denied)"


def test_a_manifest_nested_too_deeply_is_a_malformed_manifest(cache: Path, tmp_path: Path) -> None:
    copy = _copy(cache, tmp_path / "c")
    (copy / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    verify = run_cli("verify-cache", "--cache-dir", str(copy))
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, verify.stderr
    assert f"bad: {copy}/manifest.json: malformed manifest: nested too deeply" in verify.stdout.splitlines()
    assert (
        refusal(run_cli("pack", "--cache-dir", str(copy)), "pack")
        == f"{copy}/manifest.json: malformed manifest: nested too deeply"
    )
