"""A real systemd booted as PID 1 of private namespaces, for tests of ``deploy/`` (no container daemon).

How: a unit directory with the rendered units, stub targets and
``exit.target``; the launching shell in its own cgroup; ``unshare`` of pid/mount/cgroup/uts/ipc;
private ``/proc``, ``/run``, ``/var/tmp``, cgroup mounts and ``/dev/console``; then systemd with
``SYSTEMD_UNIT_PATH`` pointing at the unit directory only (never the host's units: their tmpfiles
service would clean the real /tmp). Test data is bind-mounted at ``/srv/melfeed`` inside, because
units with ``PrivateTmp=yes`` cannot run code or read data under ``/tmp``.
``SystemdNS.unavailable()`` names why it cannot run here (not root, no systemd, unshare refused).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

__all__ = ["SystemdNS", "INSIDE"]

INSIDE = Path("/srv/melfeed")  # where the test's directory appears inside the namespaces
_STUBS = (
    "sysinit.target",
    "basic.target",
    "shutdown.target",
    "umount.target",
    "final.target",
    "local-fs.target",
    "network.target",
    "multi-user.target",
    "system.slice",
)
# The targets systemd-exit.service requires: with the default dependencies a stub would conflict with
# shutdown.target, `systemctl exit` would fail its transaction and close() would wait out its bound.
_EXIT_STUBS = ("shutdown.target", "umount.target", "final.target")
_SYSTEMD = "/lib/systemd/systemd"


class SystemdNS:
    def __init__(self, workdir: Path, units: Path, boot_unit: str = "pipeline.target") -> None:
        self.workdir = workdir
        self.units = units
        self.boot_unit = boot_unit
        self.console = workdir / "systemd.log"  # systemd's own log (/dev/console inside)
        self.launcher_log = workdir / "launcher.log"
        self.name = f"melfeed-test-{os.getpid()}-{time.monotonic_ns()}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None  # systemd's pid as seen from outside
        self.exit_refused: str | None = None  # set by close(): why systemd did not exit when asked

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "needs root (unshare of pid/mount/cgroup namespaces)"
        for tool in (_SYSTEMD, shutil.which("unshare"), shutil.which("nsenter"), shutil.which("systemctl")):
            if not tool or not os.path.exists(tool):
                return f"systemd tooling missing ({tool})"
        if not Path("/sys/fs/cgroup/systemd").is_dir() or not INSIDE.parent.is_dir():
            return "no hybrid cgroup layout or no /srv mount point on this machine"
        probe = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount", "--cgroup", "true"], capture_output=True, timeout=30
        )
        if probe.returncode != 0:
            return f"unshare refused: {probe.stderr.decode(errors='replace').strip()}"
        return None

    def add_stub_units(self) -> None:
        for name in _STUBS:
            no_defaults = "DefaultDependencies=no\n" if name in _EXIT_STUBS else ""
            (self.units / name).write_text(f"[Unit]\nDescription=stub\n{no_defaults}")
        for name in ("exit.target", "systemd-exit.service"):
            shutil.copy(f"/lib/systemd/system/{name}", self.units / name)

    def boot(self, timeout_s: float = 120.0) -> None:
        empty = self.workdir / "empty"
        empty.mkdir(exist_ok=True)
        script = textwrap.dedent(f"""\
            set -e
            for h in systemd unified; do
              mkdir -p /sys/fs/cgroup/$h/{self.name}; echo $$ > /sys/fs/cgroup/$h/{self.name}/cgroup.procs
            done
            exec unshare --pid --fork --mount --cgroup --uts --ipc --propagation private bash -c '
              set -e
              mount -t proc proc /proc
              mount -t tmpfs tmpfs /run
              mount -t tmpfs tmpfs /var/tmp
              mount -t tmpfs tmpfs {INSIDE.parent}
              mkdir -p {INSIDE}
              mount --bind {self.workdir} {INSIDE}
              mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup
              mkdir /sys/fs/cgroup/systemd /sys/fs/cgroup/unified
              mount -t cgroup -o none,name=systemd,xattr cgroup /sys/fs/cgroup/systemd
              mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified
              touch {INSIDE}/systemd.log; mount --bind {INSIDE}/systemd.log /dev/console
              export container=test SYSTEMD_UNIT_PATH={self.units} SYSTEMD_GENERATOR_PATH={empty} \\
                     SYSTEMD_ENVIRONMENT_GENERATOR_PATH={empty}
              exec {_SYSTEMD} --system --unit={self.boot_unit} --log-target=console --show-status=no
            '
            """)
        with open(self.launcher_log, "ab") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", script], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout_s
        state = "no systemd process yet"
        while time.monotonic() < deadline:
            self.pid = self._systemd_pid()
            if self.pid:
                state = self.systemctl("is-system-running", check=False).stdout.strip() or "no answer"
                if state in ("running", "degraded", "starting"):
                    return
            if self.proc.poll() is not None:
                state = f"the launcher exited {self.proc.returncode}"
                break
            time.sleep(0.2)
        raise RuntimeError(f"systemd did not come up within {timeout_s:.0f} s ({state})\n{self.logs()}")

    def _systemd_pid(self) -> int | None:
        """The pid (outside view) of the systemd our unshare started: the child of unshare."""
        if self.proc is None:
            return None
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def systemctl(self, *args: str, check: bool = True, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        assert self.pid is not None
        run = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", "--", "systemctl", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if check and run.returncode != 0:
            raise RuntimeError(f"systemctl {' '.join(args)}: {run.returncode} {run.stderr.strip()}")
        return run

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, "-p", ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, unit: str, prop: str, predicate, timeout_s: float) -> dict[str, str]:  # type: ignore[no-untyped-def]
        """Poll ``systemctl show`` until ``predicate(value)``; returns the last properties seen."""
        deadline = time.monotonic() + timeout_s
        props: dict[str, str] = {}
        while time.monotonic() < deadline:
            props = self.show(unit, prop, "ActiveState", "SubState", "NRestarts", "Result", "StatusText")
            if predicate(props.get(prop, "")):
                return props
            time.sleep(0.2)
        raise AssertionError(f"{unit}: {prop} never matched; last {props}\n{self.logs()}")

    def logs(self, chars: int = 2500) -> str:
        """The tails of every log in the work directory (units log there through test drop-ins)."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in sorted(self.workdir.glob("*.log"))
        )

    def close(self) -> None:
        """``systemctl exit``, bounded wait, then kill and remove our cgroups. Idempotent.

        ``exit_refused`` keeps why systemd did not exit when asked (None: it did), so that a test can
        assert the orderly exit: a refused one costs the whole 30 s wait before the kill.
        """
        if self.proc is not None and self.proc.poll() is None:
            if self.pid:
                run = subprocess.run(
                    ["nsenter", "-t", str(self.pid), "-m", "-p", "--", "systemctl", "exit", "0"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                if run.returncode != 0:
                    self.exit_refused = f"systemctl exit: {run.returncode} {run.stderr.strip()}"
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.exit_refused = self.exit_refused or "systemd still running 30 s after systemctl exit"
                if self.pid:
                    os.kill(self.pid, 9)
                self.proc.wait(10)
        for h in ("systemd", "unified"):
            path = Path(f"/sys/fs/cgroup/{h}/{self.name}")
            if path.is_dir():
                try:
                    path.rmdir()
                except OSError:
                    pass
