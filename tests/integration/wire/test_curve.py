"""CURVE over tcp: an allowed key streams; an unknown key, a plaintext peer and a key claiming
another producer's id never get a frame through."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import msgpack
import zmq

from melfeed.consumer.feed import Consumer
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.wire.curve import generate_keys
from melfeed.shared.wire.protocol import PROTOCOL_VERSION, Hello, RejectCode, encode
from tests import procs
from tests.conftest import ProducerGroup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, keys: Path | None, server_key: Path | None
) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None and server_key is not None:
        public, secret = zmq.auth.load_certificate(str(keys))
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = zmq.auth.load_certificate(str(server_key))[0]
    sock.connect(endpoint)
    return sock


def test_only_allow_listed_keys_speaking_for_their_own_name_get_through(
    demo_cache: Path, tmp_path: Path, producers: ProducerGroup
) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, ["hostA", "hostB"])
    (keys / "producers" / "hostB.key").unlink()  # hostB is not allowed any more
    stranger = tmp_path / "stranger"
    generate_keys(stranger, [])
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    cfg = config_from_mapping(
        {
            "cache_dir": str(demo_cache),
            "consumer": {"steps": 12, "wait_timeout_s": 0.5},
            "transport": {
                "endpoint": endpoint,
                "heartbeat_interval_s": 0.2,
                "curve_secret_key": str(keys / "consumer.key_secret"),
                "curve_allowed_dir": str(keys / "producers"),
            },
        }
    )
    ctx = zmq.Context()
    bad = {
        "plaintext": _dealer(ctx, endpoint, None, None),
        "unknown key": _dealer(ctx, endpoint, stranger / "consumer.key_secret", keys / "consumer.key"),
        "removed key": _dealer(ctx, endpoint, keys / "producers" / "hostB.key_secret", keys / "consumer.key"),
    }
    impostor = _dealer(ctx, endpoint, keys / "producers" / "hostA.key_secret", keys / "consumer.key")
    try:
        with Consumer(cfg) as consumer:
            good = producers.start(
                demo_cache,
                endpoint,
                1,
                transport={
                    "endpoint": endpoint,
                    "heartbeat_interval_s": 0.2,
                    "curve_secret_key": str(keys / "producers" / "hostA.key_secret"),
                    "curve_server_key": str(keys / "consumer.key"),
                },
            )
            for sock in bad.values():
                sock.send(msgpack.packb({"t": 1, "bogus": True}))  # any frame at all
            hello = Hello(
                PROTOCOL_VERSION,
                "hostB-1",
                consumer.manifest.fingerprint,  # valid, but not hostA's
                consumer._bucket_set.as_wire(),
                cfg.n_mels,
                cfg.seed,
                1,
            )
            impostor.send(encode(hello))
            assert impostor.poll(5000), "the impostor got no answer"
            reply = msgpack.unpackb(impostor.recv())
            ids = [b.batch_id for b in consumer.batches()]
            stats = consumer._receiver.stats()
            time.sleep(0.3)
            leaked = {name: sock.poll(0) for name, sock in bad.items()}
            good.terminate()
            assert good.wait(procs.WAIT_S) == 0
    finally:
        for sock in [*bad.values(), impostor]:
            sock.close()
        ctx.term()
    assert ids == list(range(12)) and stats.producers_seen == 1
    assert reply["code"] == RejectCode.CONTRACT and "hostA" in reply["why"]
    assert stats.rejects == {RejectCode.CONTRACT: 1}  # nothing from the three others reached the app
    assert leaked == {"plaintext": False, "unknown key": False, "removed key": False}
