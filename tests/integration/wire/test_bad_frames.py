"""Bad input that never reaches a lease (B1-B5, B13-B15) against a real consumer and a real producer.

Each test attacks the module's consumer with raw DEALER sockets under fresh routing ids and checks the
ERR code the bad peer gets, the per-code and per-peer counters (as deltas), and that the good producer's
batches still all arrive once, in plan order, with exactly the content a producer builds for them.
Harness: tests/integration/wire/bad_peer.py.
"""

from __future__ import annotations

import logging
import resource
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from melfeed.consumer.feed import Consumer
from melfeed.shared.wire.protocol import Bye, Err, Heartbeat, LeaseGrant, MsgKind, RejectCode, Welcome, encode
from tests.conftest import ProducerGroup
from tests.integration.wire.bad_peer import (
    WAIT_S,
    BadPeer,
    Stream,
    Wire,
    delta,
    expect_rejected,
    start_producer,
    wire_config,
)

# --- B1-B4: undecodable headers ---------------------------------------------------------------------

_DECODE_CASES = {
    "B1-reserved-byte": [b"\xc1\x00\x01"],
    "B1-random-bytes": [bytes(range(200, 256))],
    "B2-truncated": [encode(Heartbeat(1, 2, 3))[:-1]],
    "B2-truncated-str": [b"\x82\xa1t\x05\xa5epo"],
    "B2-empty-frame": [b""],
    "B3-two-objects": [encode(Heartbeat(1)) + encode(Heartbeat(1))],
    "B3-trailing-byte": [encode(Bye(1)) + b"\x00"],
    "B4-str32-4GB": [b"\xdb\xff\xff\xff\xff"],
    "B4-bin32-4GB": [b"\xc6\xff\xff\xff\xff"],
    "B4-array32-4G-items": [b"\xdd\xff\xff\xff\xff"],
    "B4-map32-4G-items": [b"\xdf\xff\xff\xff\xff"],
    "B4-deep-nesting": [b"\x91" * 100_000 + b"\xc0"],
    "B4-deep-maps": [b"\x81\xa1k" * 50_000 + b"\xc0"],
    "B4-header-over-1MiB": [b"\xc5" + b"\x00" * (1 << 20) + b"\x00"],
    "B4-int-map-keys": [msgpack.packb({1: 2, "t": 5})],
    # Fits the general 1 MiB limit but not a producer header's: refused before it costs decoding.
    "B4-header-beyond-a-producer-header": [
        msgpack.packb({"t": int(MsgKind.HELLO), "buckets": [[1, 2, 3, 4, 5]] * 5000})
    ],
}


@pytest.mark.parametrize("frames", list(_DECODE_CASES.values()), ids=list(_DECODE_CASES))
def test_b1_b4_undecodable_header_gets_err_decode(
    wire: Wire, attack: Callable[..., BadPeer], frames: list[bytes]
) -> None:
    expect_rejected(wire, [frames], attack("decode"), [RejectCode.DECODE])


def test_b4_declared_giant_containers_allocate_nothing_large(wire: Wire, attack: Callable[..., BadPeer]) -> None:
    """4 GB declared lengths and deep nesting are refused from the limits, before any allocation."""
    peer = attack("alloc")
    giants = [v for k, v in _DECODE_CASES.items() if k.startswith("B4") and "over-1MiB" not in k]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(10):
            for frames in giants:
                peer.send(*frames)
        codes = peer.errors(10 * len(giants))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert set(codes) == {RejectCode.DECODE}
    # The frames themselves are <= 400 kB; a declared 4 GB container would show up as GBs.
    assert peak - base < 16 << 20, f"peak Python allocation {peak - base} bytes"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 2 << 20  # KiB: < 2 GiB ever


# --- B5: wrong frame count --------------------------------------------------------------------------


def test_b5_wrong_frame_count_of_single_frame_messages_gets_err_frames(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    peer = attack("frames")
    msgs = [
        [encode(Heartbeat(wire.consumer._run_id)), b"extra"],
        [encode(wire.hello()), b"a", b"b"],
        [encode(Bye(wire.consumer._run_id)), b""],
    ]
    expect_rejected(wire, msgs, peer, [RejectCode.FRAMES] * 3)
    assert wire.stats().producers_alive == 1  # the 3-frame HELLO did not join


# --- B13: kinds -------------------------------------------------------------------------------------


def test_b13_unknown_kinds_and_maps_without_kind_get_err_type_or_schema(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    epoch = wire.consumer._run_id
    msgs = [
        [msgpack.packb({"epoch": epoch})],
        [msgpack.packb({"t": 99})],
        [msgpack.packb({"t": "HB"})],
        [msgpack.packb({"t": True})],
        [msgpack.packb([int(MsgKind.HB), epoch])],
        [encode(Welcome(epoch, 2, 0.2, True, 1))],
        [encode(LeaseGrant(epoch, [], 0))],
        [encode(Err(RejectCode.LEASE, "y"))],
    ]
    codes = [
        RejectCode.SCHEMA,
        RejectCode.TYPE,
        RejectCode.TYPE,
        RejectCode.TYPE,
        RejectCode.SCHEMA,
        RejectCode.TYPE,
        RejectCode.TYPE,
        RejectCode.TYPE,
    ]
    expect_rejected(wire, msgs, attack("kind"), codes)


# --- B14: larger than ZMQ_MAXMSGSIZE -----------------------------------------------------------------------


def test_b14_message_over_maxmsgsize_disconnects_only_the_sender_which_can_reconnect(
    wire: Wire, attack: Callable[..., BadPeer]
) -> None:
    peer = attack("huge", zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert peer.monitor is not None

    def next_event() -> int:
        assert peer.monitor is not None and peer.monitor.poll(int(WAIT_S * 1000)), "no socket event"
        return int(recv_monitor_message(peer.monitor)["event"])

    assert next_event() == zmq.EVENT_HANDSHAKE_SUCCEEDED
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)
    limit = wire.consumer._bucket_set.max_batch_nbytes() + (1 << 20)  # the receiver's MAXMSGSIZE
    peer.send(b"\0" * (limit + 1))
    assert next_event() == zmq.EVENT_DISCONNECTED  # libzmq dropped the connection
    assert next_event() == zmq.EVENT_HANDSHAKE_SUCCEEDED  # the DEALER reconnected ...
    peer.send(b"\xc1")
    assert peer.errors(1) == [RejectCode.DECODE]  # ... and is heard, same routing id
    assert wire.stream.wait()
    after = wire.stats()
    assert delta(before.rejects, after.rejects) == {RejectCode.DECODE: 1}  # the huge one never surfaced
    assert delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: 1}
    wire.check_stream(start)


class _Relay:
    """A TCP relay the test can cut like a network: the producer's side closes, the consumer's
    side stays open (no FIN reaches the consumer, as after a cable pull or a frozen NAT)."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self.port = self._server.getsockname()[1]
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self._upstream_port))
            self._pairs.append((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                t.start()
                self._threads.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass  # never close the other side here: a cut leaves the consumer's side open

    def cut(self) -> None:
        for client, _ in self._pairs:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(5.0)  # the accept loop, before its socket closes
        for client, upstream in self._pairs:
            client.close()
            upstream.close()
        self._server.close()
        for t in self._threads[1:]:
            t.join(5.0)


def test_b14_producer_reconnecting_after_a_cut_is_heard_as_a_new_peer_while_its_old_connection_lingers(
    demo_cache: Path, tmp_path: Path, producers: ProducerGroup
) -> None:
    """After a network cut a producer's DEALER reconnects; the ROUTER gives the new connection a new
    routing id (no handover: a claimed id never displaces a live one), the consumer answers its first
    message UNKNOWN_PEER and it joins again, while the old connection still lingers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with Consumer(wire_config(demo_cache, f"tcp://127.0.0.1:{port}", lease_timeout_s=1.0)) as consumer:
        relay = _Relay(port)
        stream = Stream(consumer)
        try:
            start_producer(producers, demo_cache, f"tcp://127.0.0.1:{relay.port}")
            stream.take_and_wait(20)
            relay.cut()
            stream.take_and_wait(20)  # leases lost in the cut expire and come back
            stats = consumer._receiver.stats()
        finally:
            stream.close()
            relay.close()
    ids = [b for b, _ in stream.applied]
    assert ids == list(range(40)) and stream.error is None
    assert stats.producers_alive == 1 and set(stats.rejects) <= {RejectCode.UNKNOWN_PEER}


# --- B15: flood ------------------------------------------------------------------------------------------------


def test_b15_flooding_peer_is_dropped_and_ignored_with_rate_limited_logs(
    wire: Wire, attack: Callable[..., BadPeer], caplog: pytest.LogCaptureFixture
) -> None:
    flood_limit = 200  # RejectLog's production default
    flooder = attack("flood")
    flooder.join()
    start = len(wire.stream.applied)
    wire.stream.take(40)
    flooder.lease()  # it holds leases the good stream needs
    before = wire.stats()
    n = 300
    with caplog.at_level(logging.WARNING):
        for _ in range(n):
            flooder.send(b"\xc1")
        flooder.until(lambda: len(flooder.errs) >= flood_limit + 1, "flood replies", heartbeat=False)
        deadline = time.monotonic() + WAIT_S
        while sum(delta(before.rejects, wire.stats().rejects).values()) < n:
            assert time.monotonic() < deadline, delta(before.rejects, wire.stats().rejects)
            time.sleep(0.01)
        flooder.send(encode(wire.hello(producer_id=flooder.label)))  # a blocked peer cannot re-join
        while wire.stats().rejects_by_peer.get(flooder.label, 0) < n + 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert wire.stream.wait()  # its leases were revoked and rebuilt by the good one
    after = wire.stats()
    # 200 answered; the 201st trips the limit and is answered FLOOD; the rest (and the HELLO) are ignored.
    assert flooder.codes == [RejectCode.DECODE] * flood_limit + [RejectCode.FLOOD]
    assert delta(before.rejects, after.rejects) == {
        RejectCode.DECODE: flood_limit + 1,
        RejectCode.FLOOD: n - flood_limit,
    }
    assert after.rejects_by_peer[flooder.label] == n + 1
    assert after.producers_alive == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("floods invalid messages" in w for w in warnings), warnings
    assert len(warnings) <= 4, warnings  # not one line per reject
    flooder.pump(200, heartbeat=False)
    assert len(flooder.errs) == flood_limit + 1  # nothing answered after the block
    wire.check_stream(start)
