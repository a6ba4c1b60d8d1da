"""The rendered units under a real systemd (PID 1 of private namespaces; tests/systemd_ns.py).

One pipeline lifetime, in order: start ``pipeline.target`` with 2 producers; the consumer goes
active on READY and its STATUS= shows live figures; SIGKILL a producer (systemd restarts it,
training goes on); SIGKILL the consumer (it restarts from its checkpoint, producers are not
restarted); rescale live from 2 to 4 producers; wedge the consumer with SIGSTOP (the watchdog kills
and restarts it); ``systemctl stop pipeline.target`` stops producers first and everything exits
cleanly. Oracle at the end: the audit of the state directory is exact (after kills, a watchdog
restart, a rescale and stops).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import procs
from tests.systemd_ns import INSIDE, SystemdNS

pytestmark = pytest.mark.skipif(SystemdNS.unavailable() is not None, reason=str(SystemdNS.unavailable()))


def _deploy(units: Path, config: Path, producers: int) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "deploy",
            "--producers",
            str(producers),
            "--user",
            "root",
            "--config",
            str(config),
            "--target-dir",
            str(units),
            "--state-dir",
            str(INSIDE / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    # The units read the config at its inside path: point them there.
    for name in ("consumer.service", "producer@.service"):
        path = units / name
        path.write_text(path.read_text().replace(str(config), str(INSIDE / config.name)))


def _test_dropins(units: Path) -> None:
    """Logs to files (no journald inside) and a short watchdog so the wedge test is quick.

    A checkout or venv under /tmp (a CI clone) is invisible behind PrivateTmp=yes (226/NAMESPACE):
    only then the test turns PrivateTmp off; production units keep it.
    """
    under_tmp = any(str(p).startswith("/tmp/") for p in (procs.REPO, Path(sys.prefix)))
    private_tmp = "PrivateTmp=no\nReadWritePaths=/tmp\n" if under_tmp else ""  # TF wants a writable tempdir
    # WatchdogSec: armed once start-up completed (READY), so it bounds only the running loop, which pings every half
    # period as long as a step or a consumer.wait_timeout_s (0.5 s here) passes. TimeoutAbortSec: the watchdog's
    # SIGABRT cannot end a SIGSTOPped process; SIGKILL follows it.
    for unit, log, extra in (
        ("consumer.service", "consumer.log", "WatchdogSec=5\nTimeoutAbortSec=1\n" + private_tmp),
        ("producer@.service", "producers.log", private_tmp),
    ):
        d = units / f"{unit}.d"
        d.mkdir(exist_ok=True)
        (d / "test.conf").write_text(
            f"[Service]\nStandardOutput=append:{INSIDE / log}\nStandardError=append:{INSIDE / log}\n{extra}"
        )


@pytest.mark.timeout(300)
def test_pipeline_target_lifecycle_under_real_systemd(demo_cache: Path, tmp_path: Path) -> None:
    work = tmp_path / "srv"
    units = tmp_path / "units"
    work.mkdir()
    units.mkdir()
    shutil.copytree(demo_cache, work / "cache")
    (work / "state").mkdir()  # ReadWritePaths= needs it to exist (deploy says so)
    config = work / "melfeed.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "cache_dir": str(INSIDE / "cache"),
                "transport": {"heartbeat_interval_s": 0.2, "liveness_intervals": 5},
                "consumer": {
                    "steps": None,
                    "checkpoint_every_steps": 10,
                    "wait_timeout_s": 0.5,
                    "status_interval_s": 1.0,
                },
                # Graph mode and two shapes: each of the three consumer starts compiles in a few CPU-seconds
                # (what is tested is the units' lifecycle, not the compiler).
                "model": {"step": procs.TINY_STEP, "jit_compile": False},
                "buckets": {"max_shapes": 2},
            }
        )
    )
    _deploy(units, config, 2)
    _test_dropins(units)
    ns = SystemdNS(work, units)
    ns.add_stub_units()
    state = work / "state"
    try:
        ns.boot()
        ns.wait_for("consumer.service", "ActiveState", lambda v: v == "active", 90)
        for i in (1, 2):
            ns.wait_for(f"producer@{i}.service", "ActiveState", lambda v: v == "active", 30)
        ns.wait_for("consumer.service", "StatusText", lambda v: "loss" in v and "producers 2" in v, 30)

        # F1: a producer SIGKILLed is restarted by systemd; training goes on.
        ns.systemctl("kill", "-s", "SIGKILL", "producer@1.service")
        ns.wait_for("producer@1.service", "NRestarts", lambda v: v == "1", 20)
        ns.wait_for("producer@1.service", "ActiveState", lambda v: v == "active", 20)
        before = procs.audit_records(state)
        _wait_records(state, before + 30, ns)

        # F3: the consumer SIGKILLed restarts from its checkpoint; producers are not restarted.
        ns.systemctl("kill", "-s", "SIGKILL", "consumer.service")
        ns.wait_for("consumer.service", "NRestarts", lambda v: v == "1", 20)
        ns.wait_for("consumer.service", "ActiveState", lambda v: v == "active", 90)
        _wait_records(state, procs.audit_records(state) + 30, ns)
        assert ns.show("producer@2.service", "NRestarts")["NRestarts"] == "0"
        assert ns.show("producer@1.service", "NRestarts")["NRestarts"] == "1"

        # F14: rescale live 2 -> 4.
        _deploy(units, config, 4)
        ns.systemctl("daemon-reload")
        ns.systemctl("start", "pipeline.target")
        for i in (3, 4):
            ns.wait_for(f"producer@{i}.service", "ActiveState", lambda v: v == "active", 30)
        ns.wait_for("consumer.service", "StatusText", lambda v: "producers 4" in v, 30)

        # F6: a wedged consumer (SIGSTOP) starves the watchdog: killed and restarted.
        ns.systemctl("kill", "-s", "SIGSTOP", "consumer.service")
        ns.wait_for("consumer.service", "Result", lambda v: v == "watchdog", 40)  # during RestartSec
        ns.wait_for("consumer.service", "NRestarts", lambda v: v == "2", 20)
        ns.wait_for("consumer.service", "ActiveState", lambda v: v == "active", 90)
        _wait_records(state, procs.audit_records(state) + 20, ns)

        # F8/F9: stop the target: producers first, all exit 0 within TimeoutStopSec.
        ns.systemctl("stop", "pipeline.target", timeout_s=120)  # returns when the target's own job is done
        names = ["consumer.service"] + [f"producer@{i}.service" for i in range(1, 5)]
        for unit in names:
            ns.wait_for(unit, "ActiveState", lambda v: v in ("inactive", "failed"), 100)
        stopped = {
            u: ns.show(
                u,
                "ActiveState",
                "Result",
                "ExecMainStatus",
                "InactiveEnterTimestampMonotonic",
                "ActiveExitTimestampMonotonic",
            )
            for u in names
        }
    finally:
        ns.close()
    assert ns.exit_refused is None, ns.exit_refused  # an orderly exit, not the 30 s wait and a kill
    for unit, props in stopped.items():
        assert (props["ActiveState"], props["Result"], props["ExecMainStatus"]) == ("inactive", "success", "0"), (
            unit,
            props,
        )
    consumer_stop = int(stopped["consumer.service"]["ActiveExitTimestampMonotonic"])
    for i in range(1, 5):
        assert int(stopped[f"producer@{i}.service"]["InactiveEnterTimestampMonotonic"]) <= consumer_stop
    rc, doc, text = procs.run_audit(state, tmp_path)
    assert rc == 0 and doc["consumer_epochs"] == 3 and doc["after_checkpoint"] == 0, text


def _wait_records(state: Path, n: int, ns: SystemdNS, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while procs.audit_records(state) < n:
        assert time.monotonic() < deadline, f"training stalled at {procs.audit_records(state)} < {n}\n{ns.logs()}"
        time.sleep(0.1)
