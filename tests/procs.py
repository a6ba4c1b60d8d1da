"""Real consumer and producer processes for restart, chaos and resume tests (no fakes).

The consumer runs ``melfeed consumer`` and the producers ``melfeed producer``, as
the systemd units do, so killing one side leaves the other running. For tests that a command leaves no
child behind: ``descendants`` of a process, each ``Tracked`` by pid and start time (a pid reused by a later
process is not taken for a survivor), ``wait_gone`` (polled, bounded) and ``describe`` (a survivor's state and
signal masks, for the failure message). For tests that it leaves no file behind either: ``slot_files`` of given
consumer pids and ``temp_dirs`` of a bench or doctor run (only names that carry those pids: tests running beside
this one make their own).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from melfeed.consumer.resume.audit import RECORD_BYTES

REPO = Path(__file__).resolve().parent.parent
TINY_STEP = "tests.steps:tiny_step"
WAIT_S = 60.0  # bound of a wait for a process to start, stop or answer: only a real hang gets near it


def write_config(path: Path, cache: Path, endpoint: str, state_dir: Path, steps: int, **sections: Any) -> Path:
    """A config for both sides: fast heartbeats, frequent checkpoints, the tiny TensorFlow step."""
    cfg: dict[str, Any] = {
        "cache_dir": str(cache),
        "transport": {"endpoint": endpoint, "heartbeat_interval_s": 0.2, "liveness_intervals": 5},
        "consumer": {
            "steps": steps,
            "state_dir": str(state_dir),
            "checkpoint_every_steps": 7,
            "wait_timeout_s": 0.5,
            "status_interval_s": 2.0,
        },
        "producer": {"count": 3, "restart_backoff_s": 0.2},
        # One compile mode for every run: these tests compare separate runs bit for bit, and "auto" may
        # time XLA and graph mode differently in each (a resumed run keeps its own choice, see
        # consumer/train/jit.py, but two separate runs decide separately). Graph mode: these tests are
        # about the data path, and it compiles the tiny step in less CPU than XLA (XLA itself is covered
        # by the run CLI, placement, foreign-step and unit step tests).
        "model": {"step": TINY_STEP, "jit_compile": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "XDG_RUNTIME_DIR": str(tmp), "TF_CPP_MIN_LOG_LEVEL": "2"}


def command(name: str, config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "melfeed", name, "--config", str(config), *extra]


def run(name: str, config: Path, *extra: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``melfeed NAME --config CONFIG EXTRA...`` to its end, stdout and stderr captured as text (the runtime
    directory beside the config, as ``env``)."""
    return subprocess.run(
        command(name, config, *extra),
        cwd=REPO,
        env=env(config.parent),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


_started: list[subprocess.Popen[bytes]] = []  # every process start() made in this test, reaped after it


def start(
    name: str, config: Path, log_path: Path, *extra: str, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``melfeed NAME --config CONFIG`` with stdout+stderr appended to ``log_path``."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            command(name, config, *extra),
            cwd=REPO,
            env=env(config.parent) | (extra_env or {}),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    _started.append(proc)
    return proc


def start_python(code: str, config: Path, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``python -c CODE CONFIG EXTRA...`` as ``start`` runs a command (environment, log, reaped after the test).

    For a stand-in built on the library, which imports no TensorFlow (about 4 s of CPU less than a consumer
    CLI): a process whose only role is to leave the state, or be the peer, that the real CLI under test handles.
    """
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(config), *extra],
            cwd=REPO,
            env=env(config.parent),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    _started.append(proc)
    return proc


def reap_started() -> list[int]:
    """Stop what a test started and left running (a failed assertion skips its own stop); their pids."""
    left = [proc for proc in _started if proc.poll() is None]
    for proc in left:
        stop(proc)
    _started.clear()
    return [proc.pid for proc in left]


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None and not path.exists():
        time.sleep(0.05)
    return path.exists()


def audit_records(state_dir: Path) -> int:
    try:
        return (state_dir / "audit.log").stat().st_size // RECORD_BYTES
    except FileNotFoundError:
        return 0


def wait_for_records(state_dir: Path, n: int, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """True once the audit log holds ``n`` records; False on timeout or if ``proc`` exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if audit_records(state_dir) >= n:
            return True
        time.sleep(0.02)
    return audit_records(state_dir) >= n


def child_pids(parent: int) -> list[int]:
    """Live direct children of ``parent`` (the producer workers of a launcher)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent and fields[0] != "Z":
            out.append(int(entry))
    return sorted(out)


class Tracked(NamedTuple):
    """One process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    start_ticks: int  # /proc/PID/stat field 22: clock ticks after boot


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on; None once the pid is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[Tracked]:
    """Every live descendant of ``pid`` (children before grandchildren), each with its start time."""
    found: list[Tracked] = []
    todo = [pid]
    while todo:
        for kid in child_pids(todo.pop(0)):
            fields = _stat_fields(kid)
            if fields is not None:
                found.append(Tracked(kid, int(fields[19])))
                todo.append(kid)
    return found


def is_running(proc: Tracked) -> bool:
    """The same process (pid and start time) still runs: not gone, not a zombie, not a newcomer with its pid."""
    fields = _stat_fields(proc.pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == proc.start_ticks


def wait_gone(family: list[Tracked], timeout_s: float = WAIT_S) -> list[Tracked]:
    """Those of ``family`` still running after at most ``timeout_s`` (polled, returns as soon as none is)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_running(p) for p in family):
        time.sleep(0.05)
    return [p for p in family if is_running(p)]


def describe(proc: Tracked) -> str:
    """One line for a failure message: command line, state, parent, threads and signal masks of ``proc``."""
    try:
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        status = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if ":\t" in line
        )
    except OSError as err:
        return f"{proc.pid}: gone ({err.strerror})"
    keys = ("State", "PPid", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return f"{proc.pid} [{argv}] " + " ".join(f"{k}={status.get(k, '?').strip()}" for k in keys)


def kill_running(family: list[Tracked]) -> None:
    """SIGKILL whatever of ``family`` still runs (a failed test's leftovers)."""
    for proc in family:
        if is_running(proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)


def run_audit(state_dir: Path, tmp: Path) -> tuple[int, dict[str, Any], str]:
    """``melfeed audit`` as a user runs it: exit code, its JSON, its printed text."""
    out_json = tmp / f"audit-{time.monotonic_ns()}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed", "audit", str(state_dir), "-o", str(out_json)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(out_json.read_text()) if out_json.exists() else {}
    return proc.returncode, doc, proc.stdout + proc.stderr


def stop(proc: subprocess.Popen[bytes], timeout_s: float = WAIT_S) -> int:
    """SIGTERM, bounded wait, SIGKILL if ignored; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(WAIT_S)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def slot_files(pids: list[int], directory: Path = Path("/dev/shm")) -> list[str]:
    """Shared-memory slot files (``melfeed-<pid>-...``) of the consumers ``pids`` in ``directory``."""
    prefixes = tuple(f"melfeed-{pid}-" for pid in pids)
    try:
        return sorted(name for name in os.listdir(directory) if name.startswith(prefixes))
    except OSError:
        return []


def temp_dirs(command: str, pid: int) -> list[str]:
    """The temporary directories of ``melfeed COMMAND`` (bench, doctor) run as process ``pid``."""
    prefix = f"melfeed-{command}-{pid}-"
    return sorted(name for name in os.listdir(tempfile.gettempdir()) if name.startswith(prefix))
