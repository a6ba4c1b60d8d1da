"""The consumer and a producer instance talk sd_notify to a real datagram socket (no systemd):
EXTEND_TIMEOUT_USEC while compiling, READY=1, STATUS= with live figures, WATCHDOG=1, STOPPING=1.

Each socket is drained by its own thread from start to end, as systemd does: a reader that stops
reading while the other process is stopped lets Linux's 10-datagram queue fill with WATCHDOG pings.
Every wait is event-based with a generous bound that only runs out when something is truly broken.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tests import procs

_WAIT_S = 60.0  # start-up, a join, a stop: seconds on a loaded 2-core machine, never a minute
_Message = dict[str, str]


class _Listener:
    """A bound ``AF_UNIX``/``SOCK_DGRAM`` socket read by a thread into ``messages`` until closed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[_Message] = []
        self._changed = threading.Condition()
        self._closing = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)  # how often the thread re-checks ``_closing``
        self._thread = threading.Thread(target=self._read, name=f"notify-{path.name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closing.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            with self._changed:
                self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))
                self._changed.notify_all()

    def wait_for(self, found: Callable[[_Message], bool], timeout_s: float = _WAIT_S) -> bool:
        """True once a message satisfies ``found`` (checked against every message so far)."""
        with self._changed:
            return self._changed.wait_for(lambda: any(found(m) for m in self.messages), timeout_s)

    def has(self, key: str, text: str = "", timeout_s: float = _WAIT_S) -> bool:
        """A message with ``key`` whose value contains ``text``."""
        return self.wait_for(lambda m: key in m and text in m[key], timeout_s)

    def close(self) -> None:
        self._closing.set()
        self._thread.join(_WAIT_S)
        self._sock.close()

    def __enter__(self) -> _Listener:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def test_consumer_and_producer_instance_notify_readiness_status_watchdog_and_stop(
    demo_cache: Path, tmp_path: Path
) -> None:
    log = tmp_path / "notify.log"
    config = procs.write_config(
        tmp_path / "n.yaml",
        demo_cache,
        f"ipc://{tmp_path}/n.sock",
        tmp_path / "state",
        100_000,
        consumer={"status_interval_s": 0.5, "feed_efficiency_steps": 0},  # feed efficiency is not checked
        buckets={"max_shapes": 1},  # one compiled program: buckets are not the subject
    )
    watchdog = {"WATCHDOG_USEC": "1000000"}
    with _Listener(tmp_path / "c.notify") as c, _Listener(tmp_path / "p.notify") as p:
        producer = procs.start(
            "producer",
            config,
            log,
            "--instance",
            "4",
            "--debug-delay-ms",
            "5",
            extra_env={"NOTIFY_SOCKET": str(p.path)} | watchdog,
        )
        consumer = procs.start("consumer", config, log, extra_env={"NOTIFY_SOCKET": str(c.path)} | watchdog)
        try:
            assert c.has("READY"), procs.tail(log)
            assert "EXTEND_TIMEOUT_USEC" in c.messages[0]  # sent before READY, while compiling
            assert c.has("STATUS", "loss"), procs.tail(log)
            assert p.has("READY"), procs.tail(log)
            assert p.has("STATUS", "joined consumer epoch"), procs.tail(log)
            assert p.has("WATCHDOG") and c.has("WATCHDOG")
            assert procs.stop(consumer, _WAIT_S) == 0
            assert c.has("STOPPING"), procs.tail(log)
            assert procs.stop(producer, _WAIT_S) == 0
            assert p.has("STOPPING"), procs.tail(log)
        finally:
            procs.stop(consumer, _WAIT_S)
            procs.stop(producer, _WAIT_S)
        status = next(m["STATUS"] for m in c.messages if "loss" in m.get("STATUS", ""))
    # The figures are there; their values are the run's own: on a loaded machine the consumer's tracing can hold
    # its heartbeats past this config's 1 s liveness, and the producer's re-join is counted in rejects.
    for figure in ("batches/s", "stall", "producers 1"):
        assert figure in status, status
    assert re.search(r"\| rejects \d+ \|", status), status
