"""Leftovers of killed processes are removed at the next start; live ones are never touched.

A producer group whose supervisor is SIGKILLed leaves ``producers-<pid>.yaml`` in the runtime
directory, and a SIGKILLed consumer leaves its socket files (data endpoint, control socket, their
locks): the next start of the same kind removes them, a live consumer's socket beside them stays, and
a clean stop leaves nothing (the next consumer runs in this process: the receiver and control socket of
the command, without the wait for TensorFlow).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import zmq

from melfeed.consumer.feed import Consumer
from melfeed.consumer.observe.control import ControlServer
from melfeed.consumer.transport.endpoint_lock import lock_endpoint
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.service.leftovers import is_pid_alive
from tests import procs

_WAIT_S = 90.0  # a consumer start on a loaded machine imports TensorFlow; only a hang gets near it


def _wait(condition: object, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():  # type: ignore[operator]
        assert proc.poll() is None, procs.tail(log)
        assert time.monotonic() < deadline, procs.tail(log)
        time.sleep(0.05)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(_WAIT_S)


def test_a_killed_producer_groups_config_is_removed_by_the_next_group(demo_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    runtime = tmp_path / "melfeed"  # XDG_RUNTIME_DIR/melfeed (procs.env)
    config = procs.write_config(
        tmp_path / "p.yaml", demo_cache, f"ipc://{tmp_path}/none.sock", tmp_path / "s", 10, producer={"count": 1}
    )
    first = procs.start("producer", config, log)
    mine = runtime / f"producers-{first.pid}.yaml"
    try:
        _wait(lambda: mine.exists() and procs.child_pids(first.pid), first, log)
        children = procs.child_pids(first.pid)
    finally:
        _kill(first)
    assert mine.exists()  # SIGKILL: nothing could remove it
    deadline = time.monotonic() + _WAIT_S  # its producers die with it, however early it died
    while any(is_pid_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(is_pid_alive(pid) for pid in children), procs.tail(log)
    live = runtime / f"producers-{os.getpid()}.yaml"  # a live writer's file (this test process)
    live.write_text("x: 1\n")
    second = procs.start("producer", config, log)
    theirs = runtime / f"producers-{second.pid}.yaml"
    try:
        _wait(theirs.exists, second, log)
        assert not mine.exists() and live.exists()
    finally:
        assert procs.stop(second) == 0, procs.tail(log)
    assert not theirs.exists()  # a clean stop removes its own


def test_a_killed_consumers_sockets_are_removed_at_the_next_start_and_a_live_one_stays(
    demo_cache: Path, tmp_path: Path
) -> None:
    log = tmp_path / "c.log"
    files = ["a.sock", "a.sock.lock", "a.control.sock", "a.control.sock.lock"]
    killed_cfg = procs.write_config(tmp_path / "a.yaml", demo_cache, f"ipc://{tmp_path}/a.sock", tmp_path / "sa", 10)
    killed = procs.start("consumer", killed_cfg, log)
    try:
        _wait(lambda: all((tmp_path / f).exists() for f in files), killed, log)
    finally:
        _kill(killed)
    assert all((tmp_path / f).exists() for f in files)  # SIGKILL: left behind

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    live_lock = lock_endpoint(f"ipc://{tmp_path}/live.sock")  # a live consumer beside it: lock, then bind
    live = ctx.socket(zmq.ROUTER)
    live.setsockopt(zmq.LINGER, 0)
    live.bind(f"ipc://{tmp_path}/live.sock")
    # The next consumer, in this process (the same receiver and control socket as the command's,
    # without waiting for TensorFlow): its start sweeps the directory.
    nxt = Consumer(
        config_from_mapping({"cache_dir": str(demo_cache), "transport": {"endpoint": f"ipc://{tmp_path}/b.sock"}})
    )
    control: ControlServer | None = None
    try:
        nxt.start()
        context = nxt._receiver.context
        assert context is not None  # started
        control = ControlServer(context, f"ipc://{tmp_path}/b.control.sock", lambda: b"null")
        control.start()
        assert not any((tmp_path / f).exists() for f in files)
        assert (tmp_path / "live.sock").exists() and (tmp_path / "live.sock.lock").exists()
        assert (tmp_path / "b.sock").exists() and (tmp_path / "b.control.sock").exists()
    finally:
        if control is not None:
            control.close()
        nxt.close()
        live.close(0)
        ctx.term()
        assert live_lock is not None
        live_lock.release(remove_files=True)
    assert not list(tmp_path.glob("b.*sock*"))  # a clean stop removes its own files
