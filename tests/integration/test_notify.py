"""The consumer and a producer instance talk sd_notify to a real datagram socket (no systemd):
EXTEND_TIMEOUT_USEC while compiling, READY=1, STATUS= with live figures, WATCHDOG=1, STOPPING=1."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from tests import procs


def _listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.2)
    return sock


def _collect_until(sock: socket.socket, want: str, timeout_s: float, into: list[dict[str, str]]) -> bool:
    """Read datagrams into ``into`` until one has key ``want`` (True) or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            msg = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
        except socket.timeout:
            continue
        into.append(msg)
        if want in msg:
            return True
    return False


def test_consumer_and_producer_instance_notify_readiness_status_watchdog_and_stop(
        demo_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "notify.log"
    config = procs.write_config(tmp_path / "n.yaml", demo_cache, f"ipc://{tmp_path}/n.sock", tmp_path / "state",
                                100_000, consumer={"status_interval_s": 0.5})
    c_sock, p_sock = _listen(tmp_path / "c.notify"), _listen(tmp_path / "p.notify")
    watchdog = {"WATCHDOG_USEC": "1000000"}
    producer = procs.start("producer", config, log, "--instance", "4", "--debug-delay-ms", "5",
                           extra_env={"NOTIFY_SOCKET": str(tmp_path / "p.notify")} | watchdog)
    consumer = procs.start("consumer", config, log, extra_env={"NOTIFY_SOCKET": str(tmp_path / "c.notify")} | watchdog)
    c_msgs: list[dict[str, str]] = []
    p_msgs: list[dict[str, str]] = []
    try:
        assert _collect_until(c_sock, "READY", 60, c_msgs), procs.tail(log)
        assert "EXTEND_TIMEOUT_USEC" in c_msgs[0]                 # sent before READY, while compiling
        deadline = time.monotonic() + 30
        while not any("loss" in m.get("STATUS", "") for m in c_msgs) and time.monotonic() < deadline:
            _collect_until(c_sock, "STATUS", 1, c_msgs)
        assert _collect_until(p_sock, "READY", 10, p_msgs), procs.tail(log)
        deadline = time.monotonic() + 10
        while not any("joined consumer epoch" in m.get("STATUS", "") for m in p_msgs) and time.monotonic() < deadline:
            _collect_until(p_sock, "STATUS", 1, p_msgs)
        _collect_until(p_sock, "WATCHDOG", 3, p_msgs)
        assert procs.stop(consumer, 30) == 0
        assert _collect_until(c_sock, "STOPPING", 5, c_msgs)
        assert procs.stop(producer, 30) == 0
        assert _collect_until(p_sock, "STOPPING", 5, p_msgs)
    finally:
        procs.stop(consumer)
        procs.stop(producer)
        c_sock.close()
        p_sock.close()
    status = next(m["STATUS"] for m in c_msgs if "loss" in m.get("STATUS", ""))
    for figure in ("batches/s", "stall", "producers 1", "rejects 0"):
        assert figure in status, status
    assert any("WATCHDOG" in m for m in c_msgs) and any("WATCHDOG" in m for m in p_msgs)
    assert any("joined consumer epoch" in m.get("STATUS", "") for m in p_msgs), p_msgs
