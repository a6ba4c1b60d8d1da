"""``run_pipeline.py deploy``: rendered units, rescaling, bad flags, ``systemd-analyze`` verify/security."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[4]
# Exposure scores from `systemd-analyze security --offline=yes` in tenths (0 = locked down, 100 = exposed),
# measured with --user root (a dedicated user scores lower).
# Ratchet: lower these when the units get tighter; a test fails if a change makes them worse.
SECURITY_THRESHOLD = {"consumer.service": 40, "producer@1.service": 40}   # tenths: 40 = 4.0

needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed on this machine")


def _deploy(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "melfeed.yaml"
    if not config.exists():
        config.write_text(yaml.safe_dump({"cache_dir": "/srv/cache", "producer": {"data_gpu": "1"},
                                          "consumer": {"model_gpu": "0"}}))
    return subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "deploy", "--user", "root",
                           "--config", str(config), "--target-dir", str(tmp_path / "units"), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_units_are_rendered_with_this_venv_config_gpus_and_the_wanted_producers(tmp_path: Path) -> None:
    run = _deploy(tmp_path, "--producers", "3")
    assert run.returncode == 0, run.stderr
    units = tmp_path / "units"
    consumer = (units / "consumer.service").read_text()
    producer = (units / "producer@.service").read_text()
    assert f"ExecStart={sys.prefix}/bin/python {REPO}/run_pipeline.py consumer --config {tmp_path}/melfeed.yaml" \
        in consumer
    assert "CUDA_VISIBLE_DEVICES=0" in consumer and "CUDA_VISIBLE_DEVICES=1" in producer
    assert "--instance %i" in producer and "StateDirectory=melfeed" in consumer
    assert "RestartPreventExitStatus=78" in consumer
    assert not any(line.startswith("PrivateDevices") for line in consumer.splitlines())   # the GPU stays visible
    assert (units / "pipeline.target.d" / "producers.conf").read_text().splitlines()[-1] == \
        "Wants=producer@1.service producer@2.service producer@3.service"
    assert "@" not in consumer.replace("producer@", "").replace("pipeline.target", "")  # no placeholder left


def test_the_producer_unit_sets_nice_to_producer_nice_and_the_consumer_unit_none(tmp_path: Path) -> None:
    (tmp_path / "melfeed.yaml").write_text(yaml.safe_dump({"cache_dir": "/srv/cache", "producer": {"nice": 12}}))
    assert _deploy(tmp_path, "--producers", "1").returncode == 0
    units = tmp_path / "units"
    assert [ln for ln in (units / "producer@.service").read_text().splitlines() if ln.startswith("Nice=")] == \
        ["Nice=12"]
    assert "Nice=" not in (units / "consumer.service").read_text()       # the step keeps its priority


def test_rescaling_rewrites_only_the_drop_in_and_says_which_instances_to_stop(tmp_path: Path) -> None:
    assert _deploy(tmp_path, "--producers", "4").returncode == 0
    down = _deploy(tmp_path, "--producers", "2")
    assert down.returncode == 0
    assert down.stdout.count("wrote ") == 1 and "producers.conf" in down.stdout
    assert "systemctl stop producer@3.service producer@4.service" in down.stdout
    again = _deploy(tmp_path, "--producers", "2")
    assert "units already up to date" in again.stdout and "systemctl stop" not in again.stdout


@pytest.mark.parametrize(("flags", "needle"), [
    (("--producers", "0"), "--producers: must be >= 1, got 0"),
    (("--producers", "2", "--prefix", "/nonexistent"), "--prefix: has no executable /nonexistent/bin/python"),
])
def test_bad_flags_are_one_line_naming_the_flag_and_exit_78(tmp_path: Path, flags: tuple[str, ...],
                                                              needle: str) -> None:
    run = _deploy(tmp_path, *flags)
    assert run.returncode == 78
    assert needle in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_an_unknown_user_is_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "deploy", "--producers", "1", "--user",
                          "no-such-user-melfeed", "--target-dir", str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 78 and "--user: is not a user on this host" in run.stderr


def _verify(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, paths)], capture_output=True,
                          text=True, timeout=60)


@needs_systemd
def test_systemd_analyze_verify_reports_nothing_on_the_rendered_units(tmp_path: Path) -> None:
    assert _deploy(tmp_path, "--producers", "2").returncode == 0
    units = tmp_path / "units"
    paths = [units / "pipeline.target", units / "consumer.service", units / "producer@1.service"]
    run = _verify(paths)
    assert run.returncode == 0 and run.stderr == "", run.stderr        # unknown keys only warn: any output fails
    broken = units / "consumer.service"
    broken.write_text(broken.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    assert "Unknown key 'WatchdogSecs'" in _verify(paths).stderr        # the check can fail


@needs_systemd
@pytest.mark.parametrize("unit", sorted(SECURITY_THRESHOLD))
def test_hardening_exposure_stays_at_or_below_the_ratchet(tmp_path: Path, unit: str) -> None:
    assert _deploy(tmp_path, "--producers", "1").returncode == 0
    run = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--threshold={SECURITY_THRESHOLD[unit]}",
                          str(tmp_path / "units" / unit)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout[-600:] + run.stderr
