"""shared/service/leftovers.py: config files of dead writers go, everything else stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from melfeed.shared.service.leftovers import is_pid_alive, remove_dead_configs, remove_dead_temp_dirs, temp_dir_prefix


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_our_config_files_of_dead_pids_are_removed(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getpid()
    stale = [tmp_path / f"producers-{dead}.yaml", tmp_path / f"run-{dead}.yaml", tmp_path / f".run-{dead}.yaml.tmp"]
    kept = [
        tmp_path / f"producers-{live}.yaml",
        tmp_path / f"run-{live}.yaml",
        tmp_path / f"other-{dead}.yaml",
        tmp_path / f"producers-{dead}.yml",
        tmp_path / "producers-x.yaml",
    ]
    for p in stale + kept:
        p.write_text("x: 1\n")
    (tmp_path / f"run-{dead + 1_000_000}.yaml").symlink_to(tmp_path / "target")  # a link is never followed
    (tmp_path / "target").write_text("precious\n")
    assert sorted(remove_dead_configs(tmp_path)) == sorted(stale)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in stale)
    assert (tmp_path / "target").read_text() == "precious\n"
    assert remove_dead_configs(tmp_path / "missing") == []


def test_a_zombie_is_dead_and_this_process_is_alive() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30.0  # until it has exited (a zombie: not reaped yet)
        while _state(proc.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(proc.pid) == "Z" and not is_pid_alive(proc.pid)
    finally:
        proc.wait()
    assert is_pid_alive(os.getpid()) and not is_pid_alive(0) and not is_pid_alive(proc.pid)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_temporary_dirs_of_dead_bench_or_doctor_runs_are_removed_live_ones_kept(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getpid()
    stale = tmp_path / f"melfeed-doctor-{dead}-abc_1234"
    kept = [
        tmp_path / f"melfeed-doctor-{live}-abc_1234",
        tmp_path / f"melfeed-bench-{dead}-abc_1234",
        tmp_path / "melfeed-doctor-abc_1234",
        tmp_path / f"melfeed-doctor-{dead}-abc_1234x",
    ]
    for d in [stale, *kept]:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "doctor.yaml").write_text("x: 1\n")
    (tmp_path / "target").mkdir()
    (tmp_path / f"melfeed-doctor-{dead + 1_000_000}-abc_1234").symlink_to(tmp_path / "target")  # never followed
    assert temp_dir_prefix("doctor") == f"melfeed-doctor-{live}-"
    assert remove_dead_temp_dirs("doctor", tmp_path) == [stale]
    assert not stale.exists() and all(d.is_dir() for d in kept) and (tmp_path / "target").is_dir()
