"""consumer/transport/endpoint_lock.py: one consumer per ipc endpoint."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from melfeed.consumer.transport.endpoint_lock import lock_endpoint
from melfeed.shared.errors import ConfigError


def test_a_second_lock_on_the_same_socket_is_refused_naming_the_holder_until_it_is_released(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/melfeed.sock"
    first = lock_endpoint(endpoint)
    assert first is not None and first.path == tmp_path / "melfeed.sock.lock"
    assert first.path.read_text() == f"{os.getpid()}\n"
    with pytest.raises(ConfigError) as info:
        lock_endpoint(endpoint)
    assert str(info.value).startswith(
        f"transport.endpoint: another consumer (pid {os.getpid()}) is running on {endpoint} (lock {first.path})"
    )
    first.release()
    first.release()  # idempotent
    again = lock_endpoint(endpoint)
    assert again is not None
    again.release()
    assert first.path.exists()  # never unlinked: the next holder locks the same inode


def test_tcp_and_abstract_sockets_need_no_lock_file(tmp_path: Path) -> None:
    assert lock_endpoint("tcp://127.0.0.1:5555") is None
    assert lock_endpoint("ipc://@melfeed-test") is None


def test_a_link_planted_at_the_lock_path_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "melfeed.sock.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=f"cannot open the endpoint lock {tmp_path}/melfeed.sock.lock"):
        lock_endpoint(f"ipc://{tmp_path}/melfeed.sock")
    assert not (tmp_path / "elsewhere").exists()


def _socket_file(path: Path) -> None:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # leaves the file behind when closed, as libzmq does
    s.close()


def test_release_with_remove_files_unlinks_the_socket_and_its_lock(tmp_path: Path) -> None:
    lock = lock_endpoint(f"ipc://{tmp_path}/melfeed.sock")
    assert lock is not None
    _socket_file(tmp_path / "melfeed.sock")
    lock.release(remove_files=True)
    assert os.listdir(tmp_path) == []


def test_stale_sockets_of_dead_consumers_are_removed_and_a_live_ones_never(tmp_path: Path) -> None:
    from melfeed.consumer.transport.endpoint_lock import remove_stale_endpoints

    live = lock_endpoint(f"ipc://{tmp_path}/live.sock")
    assert live is not None
    _socket_file(tmp_path / "live.sock")
    for name in ("dead.sock", "dead.control.sock"):
        _socket_file(tmp_path / name)
        (tmp_path / f"{name}.lock").write_text("12345\n")  # nobody holds it: its consumer died
    (tmp_path / "data.sock").write_text("data\n")
    (tmp_path / "data.sock.lock").write_text("1\n")  # a regular file is never unlinked as a socket
    _socket_file(tmp_path / "app")
    (tmp_path / "app.lock").write_text("1\n")  # another program's lock: not a *.sock endpoint
    _socket_file(tmp_path / "other.sock")
    (tmp_path / "other.sock.lock").write_text("not a pid\n")  # not what lock_endpoint writes
    removed = remove_stale_endpoints(tmp_path)
    assert sorted(p.name for p in removed) == [
        "data.sock.lock",
        "dead.control.sock",
        "dead.control.sock.lock",
        "dead.sock",
        "dead.sock.lock",
    ]
    assert sorted(os.listdir(tmp_path)) == [
        "app",
        "app.lock",
        "data.sock",
        "live.sock",
        "live.sock.lock",
        "other.sock",
        "other.sock.lock",
    ]
    live.release()
    again = lock_endpoint(f"ipc://{tmp_path}/live.sock")  # a lock removed under a taker: it locks anew
    assert again is not None
    again.release(remove_files=True)


def test_a_lock_held_without_a_pid_is_waited_for_then_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another consumer's start-up sweep holds our fresh, empty lock for a moment and unlinks it: we lock anew."""
    import fcntl

    endpoint = f"ipc://{tmp_path}/rank0.control.sock"
    lock_path = tmp_path / "rank0.control.sock.lock"
    sweeper = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)  # empty: no pid line yet
    fcntl.flock(sweeper, fcntl.LOCK_EX | fcntl.LOCK_NB)
    polls = []

    def sweep_done(seconds: float) -> None:  # the sweeper finishes during our first wait
        polls.append(seconds)
        if len(polls) == 1:
            lock_path.unlink()
            os.close(sweeper)

    monkeypatch.setattr(time, "sleep", sweep_done)
    taken = lock_endpoint(endpoint)
    assert taken is not None and polls and taken.path.read_text() == f"{os.getpid()}\n"
    taken.release()


def test_a_lock_held_without_a_pid_for_too_long_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    import melfeed.consumer.transport.endpoint_lock as endpoint_lock

    endpoint = f"ipc://{tmp_path}/melfeed.sock"
    holder = os.open(tmp_path / "melfeed.sock.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    try:
        with pytest.raises(ConfigError, match=r"another consumer \(pid \?\) is running"):
            lock_endpoint(endpoint)
        assert clock[0] >= endpoint_lock._NO_PID_WAIT_S  # it waited the bound, then gave up
    finally:
        os.close(holder)


@pytest.mark.parametrize("kind", ["file", "directory", "link"])
def test_an_endpoint_naming_something_that_is_not_a_socket_is_refused_and_left_alone(tmp_path: Path, kind: str) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    target = {"file": victim, "directory": tmp_path / "d", "link": tmp_path / "l"}[kind]
    if kind == "directory":
        target.mkdir()
    elif kind == "link":
        target.symlink_to(victim)
    with pytest.raises(ConfigError, match=f"consumer.control_endpoint: {target} is a"):
        lock_endpoint(f"ipc://{target}", ("consumer", "control_endpoint"))
    assert victim.read_text() == "keep me" and os.path.lexists(target)
    assert not (tmp_path / f"{target.name}.lock").exists()  # refused before any lock file is made
