"""Hostile peers on a shared host (docs/security.md "Hostile peers") against a real consumer and real producers.

A peer that claims a live producer's routing id, a second consumer on the same runtime directory,
and peer-supplied text that tries to forge log lines.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
import zmq
from zmq.utils.monitor import recv_monitor_message

from melfeed.consumer.feed import Consumer
from melfeed.consumer.flow.peers import ProducerReport
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.protocol import PROTOCOL_VERSION, Bye, Hello, Welcome, decode_header, encode
from tests.conftest import REPO, ProducerGroup

HB_S = 0.2
_WAIT_S = 20.0  # bound of every wait below; only a hang gets near it


def _cfg(cache: Path, endpoint: str, steps: int | None = None):  # type: ignore[no-untyped-def]
    return config_from_mapping(
        {
            "cache_dir": str(cache),
            "buckets": {"batch_size": 4},
            "consumer": {"steps": steps, "wait_timeout_s": 0.2},
            "transport": {"endpoint": endpoint, "heartbeat_interval_s": HB_S, "mode": "zmq"},
        }
    )


def _ident(label: str) -> bytes:
    """The routing id behind a ``peer_label``."""
    return bytes.fromhex(label[2:]) if label.startswith("0x") else label.encode()


def _one_producer(consumer: Consumer) -> ProducerReport:
    deadline = time.monotonic() + _WAIT_S
    while len(reports := consumer._receiver.stats().producers) != 1:
        assert time.monotonic() < deadline, "the producer never joined"
        time.sleep(0.02)
    return reports[0]


@pytest.fixture()
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.term()


def test_an_impostor_claiming_a_live_producers_routing_id_neither_displaces_nor_disturbs_it(
    demo_cache: Path, endpoint: str, producers: ProducerGroup, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    with Consumer(_cfg(demo_cache, endpoint)) as consumer:
        producers.start(demo_cache, endpoint, 1, transport={"mode": "zmq"}, buckets={"batch_size": 4})
        batches = consumer.batches()
        assert [next(batches).batch_id for _ in range(10)] == list(range(10))
        good = _one_producer(consumer)
        before = consumer._receiver.stats()
        impostor = zctx.socket(zmq.DEALER)
        impostor.setsockopt(zmq.LINGER, 0)
        impostor.setsockopt(zmq.ROUTING_ID, _ident(good.peer))  # the id the consumer's log shows
        monitor = impostor.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            impostor.connect(endpoint)
            assert monitor.poll(int(_WAIT_S * 1000)), "the impostor never connected"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            got_anything = impostor.poll(int(3 * HB_S * 1000))  # heartbeats would reach a usurper
        finally:
            impostor.disable_monitor()
            monitor.close(0)
            impostor.close(0)
        liveness_s = consumer._cfg.transport.liveness_s
        last_s = time.monotonic()
        for expected in range(10, 40):  # the stream never stalls for a liveness period
            assert next(batches).batch_id == expected
            now = time.monotonic()
            assert now - last_s < liveness_s, f"batch {expected} took {now - last_s:.2f} s"
            last_s = now
        after = consumer._receiver.stats()
    assert not got_anything
    assert [p.peer for p in after.producers] == [good.peer]  # the same connection, never re-joined
    assert after.leases_reissued == before.leases_reissued and after.producers_seen == 1


def test_a_second_consumer_on_the_same_runtime_directory_refuses_with_78_and_leaves_the_socket(
    demo_cache: Path, tmp_path: Path, producers: ProducerGroup
) -> None:
    runtime = tmp_path / "run"
    environ = {"XDG_RUNTIME_DIR": str(runtime)}
    cfg = config_from_mapping(
        {
            "cache_dir": str(demo_cache),
            "buckets": {"batch_size": 4},
            "consumer": {"steps": 30, "wait_timeout_s": 0.2},
            "transport": {"heartbeat_interval_s": HB_S, "mode": "zmq"},
        }
    )
    with Consumer(cfg, environ=environ) as first:
        sock_path = Path(first._endpoint.removeprefix("ipc://"))
        inode = sock_path.stat().st_ino
        with pytest.raises(ConfigError, match=rf"another consumer \(pid {os.getpid()}\) is running on"):
            Consumer(cfg, environ=environ).start()
        config = tmp_path / "second.yaml"
        config.write_text(
            yaml.safe_dump({"cache_dir": str(demo_cache), "buckets": {"batch_size": 4}, "transport": {"mode": "zmq"}})
        )
        second = subprocess.run(
            [sys.executable, "-m", "melfeed", "consumer", "--config", str(config)],
            cwd=REPO,
            env={**os.environ, **environ},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert sock_path.stat().st_ino == inode  # the live socket was never unlinked
        producers.start(demo_cache, first._endpoint, 1, transport={"mode": "zmq"}, buckets={"batch_size": 4})
        assert [b.batch_id for b in first.batches()] == list(range(30))  # ... and still serves
    assert second.returncode == 78, second.stderr
    [line] = [x for x in second.stderr.splitlines() if "another consumer" in x]
    assert line.startswith("melfeed consumer: transport.endpoint: ") and f"pid {os.getpid()}" in line
    assert "Traceback" not in second.stderr


def test_a_hello_whose_id_holds_a_newline_never_forges_a_log_line(
    demo_cache: Path, endpoint: str, zctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    evil = "evil\nINFO forged\x1b[2J"
    peer = zctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        with caplog.at_level(logging.INFO), Consumer(_cfg(demo_cache, endpoint)) as consumer:
            peer.connect(endpoint)
            peer.send(
                encode(
                    Hello(
                        PROTOCOL_VERSION,
                        evil,
                        consumer.manifest.fingerprint,
                        consumer._bucket_set.as_wire(),
                        consumer._cfg.n_mels,
                        consumer._cfg.seed,
                        1,
                    )
                )
            )
            assert peer.poll(int(_WAIT_S * 1000)), "no answer to HELLO"
            welcome = decode_header(peer.recv())
            assert isinstance(welcome, Welcome)
            peer.send(encode(Bye(welcome.epoch, exit_code=3, reason="boom\nERROR forged too")))
            deadline = time.monotonic() + _WAIT_S
            while consumer._receiver.stats().producer_failures < 1:
                assert time.monotonic() < deadline, "the BYE never arrived"
                time.sleep(0.02)
            shown = consumer._receiver.stats()
    finally:
        peer.close(0)
    lines = [
        line for r in caplog.records for line in logging.Formatter("%(levelname)s %(message)s").format(r).splitlines()
    ]
    assert not any(line.startswith(("INFO forged", "ERROR forged")) or "\x1b" in line for line in lines), lines
    assert any("producer joined id=evil\\nINFO forged\\x1b[2J" in line for line in lines), lines
    assert any(
        "producer failed id=evil\\nINFO forged\\x1b[2J exit=3: boom\\nERROR forged too" in line for line in lines
    ), lines
    assert shown.producers_alive == 0


def test_a_consumer_refuses_a_runtime_directory_others_can_write_with_78(demo_cache: Path, tmp_path: Path) -> None:
    runtime = tmp_path / "melfeed"
    runtime.mkdir()
    runtime.chmod(0o777)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"cache_dir": str(demo_cache)}))
    run = subprocess.run(
        [sys.executable, "-m", "melfeed", "consumer", "--config", str(config)],
        cwd=REPO,
        env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 78, run.stderr
    [line] = [x for x in run.stderr.splitlines() if "runtime directory" in x]
    assert line == (
        f"melfeed consumer: runtime_dir: runtime directory {runtime} is mode 0777: every user "
        "can write to it (and replace its socket); make it 0700 or 0770 for the service group"
    )
    assert "Traceback" not in run.stderr and not list(runtime.iterdir())
