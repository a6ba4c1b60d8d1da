"""Idle connections cannot take the consumer's descriptors (docs/security.md "Hostile peers").

A real consumer process whose descriptor limit is lowered (so a few hundred connections would exhaust
it), a real producer streaming to its tcp endpoint, and a local user holding hundreds of idle tcp
connections open on that endpoint: the run finishes, every checkpoint is written and the audit is exact.
The same run has one periodic checkpoint fail (a file where its temporary directory goes): it is
logged with its path and errno and retried an interval later, and training goes on.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from melfeed.consumer.feed import Consumer
from melfeed.consumer.resume.checkpoint import latest_checkpoint
from melfeed.shared.config.loader import config_from_mapping
from tests import procs

_FD_LIMIT = 320  # the consumer's soft and hard limit: ~100 used by TensorFlow, libzmq and the state
_IDLE = 400  # connections held open: more than the limit allows
_STEPS = 40
_WAIT_S = 120.0  # the whole run on a loaded machine; only a hang gets near it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _lower_fd_limit() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (_FD_LIMIT, _FD_LIMIT))


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, procs.tail(log)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the consumer never listened")


@pytest.fixture()
def idle() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * _IDLE)), hard))
    yield held
    for s in held:
        s.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_hundreds_of_idle_tcp_connections_leave_the_run_and_its_checkpoints_intact(
    demo_cache: Path, tmp_path: Path, idle: list[socket.socket]
) -> None:
    port = _free_port()
    log = tmp_path / "fd.log"
    state = tmp_path / "state"
    # handshake_timeout_s is long here so that the connection bound alone has to hold the line.
    config = procs.write_config(
        tmp_path / "fd.yaml",
        demo_cache,
        f"tcp://127.0.0.1:{port}",
        state,
        _STEPS,
        transport={"insecure": True, "mode": "zmq", "max_connections": 16, "handshake_timeout_s": 60.0},
        consumer={"checkpoint_every_steps": 5, "feed_efficiency_steps": 0},  # feed efficiency is not checked
        producer={"count": 1},
        buckets={"max_shapes": 1},  # one compiled program: buckets are not the subject
    )
    state.mkdir(mode=0o750)
    with open(log, "ab") as out:
        consumer = subprocess.Popen(
            procs.command("consumer", config),
            cwd=procs.REPO,
            env=procs.env(tmp_path),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_lower_fd_limit,
        )
    # A periodic checkpoint that cannot be written (a file where its temporary directory goes) is
    # retried an interval later while training goes on (consumer/resume/state.py).
    (state / f"ckpt-{10:012d}.tmp-{consumer.pid}").write_text("in the way\n")
    producers = None
    peak_fds = 0
    try:
        _wait_listening(port, consumer, log)
        producers = procs.start("producer", config, log, "--debug-delay-ms", "40")
        assert procs.wait_for_records(state, 3, consumer, _WAIT_S), procs.tail(log)
        for _ in range(_IDLE):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=_WAIT_S))
            peak_fds = max(peak_fds, _open_fds(consumer.pid))
        assert consumer.wait(_WAIT_S) == 0, procs.tail(log)
    finally:
        procs.stop(consumer)
        if producers is not None:
            procs.stop(producers)
    text = log.read_text(errors="replace")
    assert "Too many open files" not in text
    assert "transport.max_connections" in text  # the bound was reached and said so
    assert peak_fds < _FD_LIMIT - 64, peak_fds  # the bound leaves room for checkpoint writes
    assert f"periodic checkpoint failed: {state}/ckpt-{10:012d}.tmp-{consumer.pid} (errno EEXIST)" in text
    found = latest_checkpoint(state)
    assert found is not None and found[1].next_batch == _STEPS
    rc, doc, report = procs.run_audit(state, tmp_path)
    assert rc == 0 and doc["applied"] == _STEPS, report


def test_a_connection_that_never_handshakes_is_dropped_after_handshake_timeout_s(
    demo_cache: Path, tmp_path: Path
) -> None:
    port = _free_port()
    cfg = config_from_mapping(
        {
            "cache_dir": str(demo_cache),
            "buckets": {"batch_size": 4},
            "transport": {
                "endpoint": f"tcp://127.0.0.1:{port}",
                "insecure": True,
                "mode": "zmq",
                "handshake_timeout_s": 0.5,
            },
        }
    )
    with Consumer(cfg) as consumer:
        consumer.start()
        conns = [socket.create_connection(("127.0.0.1", port), timeout=_WAIT_S) for _ in range(5)]
        try:
            t0 = time.monotonic()
            for c in conns:
                _read_until_closed(c)  # the greeting, then the consumer hangs up
            assert time.monotonic() - t0 < _WAIT_S / 4
        finally:
            for c in conns:
                c.close()


def _read_until_closed(conn: socket.socket) -> None:
    """Read what the consumer sends (its ZMTP greeting) until it closes the connection (bounded by the
    socket's timeout: a connection kept open fails the test with ``TimeoutError``)."""
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass
