"""consumer/transport/endpoint_lock.py: one consumer per ipc endpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from consumer.transport.endpoint_lock import lock_endpoint
from shared.errors import ConfigError


def test_a_second_lock_on_the_same_socket_is_refused_naming_the_holder_until_it_is_released(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/melfeed.sock"
    first = lock_endpoint(endpoint)
    assert first is not None and first.path == tmp_path / "melfeed.sock.lock"
    assert first.path.read_text() == f"{os.getpid()}\n"
    with pytest.raises(ConfigError) as info:
        lock_endpoint(endpoint)
    assert str(info.value).startswith(f"transport.endpoint: another consumer (pid {os.getpid()}) is running on "
                                      f"{endpoint} (lock {first.path})")
    first.release()
    first.release()                                             # idempotent
    again = lock_endpoint(endpoint)
    assert again is not None
    again.release()
    assert first.path.exists()                                  # never unlinked: the next holder locks the same inode


def test_tcp_and_abstract_sockets_need_no_lock_file(tmp_path: Path) -> None:
    assert lock_endpoint("tcp://127.0.0.1:5555") is None
    assert lock_endpoint("ipc://@melfeed-test") is None


def test_a_link_planted_at_the_lock_path_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "melfeed.sock.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=f"cannot open the endpoint lock {tmp_path}/melfeed.sock.lock"):
        lock_endpoint(f"ipc://{tmp_path}/melfeed.sock")
    assert not (tmp_path / "elsewhere").exists()
