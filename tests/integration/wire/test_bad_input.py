"""Bad input on the wire (reliability-tests 4.2, B1-B15) against a real consumer and a real producer.

One library ``Consumer`` and one real producer process serve the whole module; a test-owned step
loop (``Stream``) takes batches on demand. Each test attacks it with raw DEALER sockets under fresh
routing ids and checks: the ERR code the bad peer gets, the per-code and per-peer counters (as
deltas), and that the good producer's batches still all arrive once, in plan order, with exactly
the content a producer builds for them (recomputed here with the producer's own assembler).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import resource
import socket
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from consumer.feed import Consumer
from consumer.flow.plan import EpochPlan
from consumer.transport.receiver import ReceiverStats
from producer.batcher import BatchAssembler
from producer.slot_maps import SlotMappings
from producer.reader import CacheReader
from shared.config_loader import config_from_mapping
from shared.errors import ClosedError
from shared.wire.layout import ARRAY_KEYS
from shared.wire.protocol import (PROTOCOL_VERSION, BatchHeader, Bye, Err, Heartbeat, Hello, Lease,
                             LeaseGrant, MsgKind, RejectCode, Welcome, decode_header, encode)
from tests.conftest import ProducerGroup

BATCH_SIZE = 4            # tiny batches: a test moves dozens in well under a second
HB_S = 0.2
_WAIT_S = 20.0            # bound of every wait below; only a hang gets near it
_names = itertools.count()


def wire_config(cache: Path, endpoint: str, lease_timeout_s: float = 5.0) -> Any:
    """Endless consumer, checksums on (B10), short liveness and lease deadlines; loopback tcp without CURVE."""
    return config_from_mapping({
        "cache_dir": str(cache), "buckets": {"batch_size": BATCH_SIZE},
        "consumer": {"steps": None, "wait_timeout_s": 0.2},
        "transport": {"endpoint": endpoint, "heartbeat_interval_s": HB_S, "checksum": True,
                      "lease_timeout_s": lease_timeout_s, "insecure": endpoint.startswith("tcp://")}})


def start_producer(group: ProducerGroup, cache: Path, endpoint: str) -> None:
    group.start(cache, endpoint, 1, buckets={"batch_size": BATCH_SIZE},
                transport={"insecure": endpoint.startswith("tcp://")})


def digest(arrays: dict[str, np.ndarray]) -> int:
    crc = 0
    for key in ARRAY_KEYS:
        crc = zlib.crc32(np.ascontiguousarray(arrays[key]).data.cast("B"), crc)
    return crc


class Stream:
    """The test's step loop: takes batches on demand in a thread, records (id, content digest)."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer
        self.applied: list[tuple[int, int]] = []
        self.error: BaseException | None = None
        self._want = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-step", daemon=True)
        self._thread.start()

    def take(self, n: int) -> None:
        """Let the loop apply ``n`` more batches (returns at once)."""
        with self._cond:
            self._want += n
            self._cond.notify_all()

    def wait(self, timeout_s: float = _WAIT_S) -> bool:
        """True once every batch asked for was applied."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.applied) < self._want and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return self.error is None

    def take_and_wait(self, n: int) -> None:
        self.take(n)
        assert self.wait(), f"stream stalled at {len(self.applied)} of {self._want} (error {self.error})"

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(5.0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    if len(self.applied) >= self._want:
                        self._cond.wait(0.1)
                        continue
                batch = self._consumer.next_batch(0.1)
                if batch is None:
                    continue
                try:
                    entry = (batch.batch_id, digest(batch.arrays))
                finally:
                    self._consumer.release(batch)
                with self._cond:
                    self.applied.append(entry)
                    self._cond.notify_all()
        except ClosedError:
            pass
        except BaseException as err:  # the assertion in wait()/check shows it
            with self._cond:
                self.error = err
                self._cond.notify_all()


class Reference:
    """Builds any planned batch exactly as a producer does (own plan: the consumer's is not shared)."""

    def __init__(self, consumer: Consumer) -> None:
        self._plan = EpochPlan(consumer.bucket_set, consumer.manifest.fingerprint, consumer.cfg.seed)
        self._assembler = BatchAssembler(CacheReader(consumer.manifest), consumer.bucket_set, max_buffers=1)

    def arrays(self, batch_id: int) -> dict[str, np.ndarray]:
        planned = self._plan.batch(batch_id)
        built = self._assembler.build(batch_id, planned.bucket, list(planned.sample_ids))
        return {k: built.arrays[k].copy() for k in ARRAY_KEYS}

    def digest(self, batch_id: int) -> int:
        return digest(self.arrays(batch_id))

    def bucket(self, batch_id: int) -> int:
        return self._plan.batch(batch_id).bucket


@dataclass
class Wire:
    consumer: Consumer
    stream: Stream
    reference: Reference
    endpoint: str
    ctx: zmq.Context  # type: ignore[type-arg]

    def stats(self) -> ReceiverStats:
        return self.consumer.receiver_stats()

    def hello(self, **change: Any) -> Hello:
        c = self.consumer
        good = Hello(PROTOCOL_VERSION, "bad", c.manifest.fingerprint, c.bucket_set.as_wire(), c.cfg.n_mels,
                     c.cfg.seed)
        return dataclasses.replace(good, **change)

    def peer(self, tag: str, monitor_events: int = 0) -> BadPeer:
        return BadPeer(self, f"bad-{tag}-{next(_names)}", monitor_events)

    def check_stream(self, since: int) -> None:
        """Every batch applied so far arrived once in plan order; those from ``since`` on have the
        content a producer builds (a rejected payload was never applied)."""
        s = self.stream
        assert s.error is None, s.error
        ids = [b for b, _ in s.applied]
        assert ids == list(range(len(ids)))
        for batch_id, got in s.applied[since:]:
            assert got == self.reference.digest(batch_id), f"batch {batch_id} has the wrong content"


class BadPeer:
    """A raw DEALER that speaks or breaks the protocol and records everything the consumer answers."""

    def __init__(self, wire: Wire, label: str, monitor_events: int = 0) -> None:
        self.wire = wire
        self.label = label
        self.sock = wire.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, label.encode())   # fixed, so its counters have a known label
        self.monitor = self.sock.get_monitor_socket(monitor_events) if monitor_events else None
        self.sock.connect(wire.endpoint)
        self.errs: list[Err] = []
        self.leases: list[Lease] = []
        self.epoch: int | None = None
        self.shm_dir: str | None = None
        self._next_hb_s = 0.0

    @property
    def codes(self) -> list[str]:
        return [e.code for e in self.errs]

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def pump(self, timeout_ms: int, heartbeat: bool = True) -> None:
        if heartbeat and self.epoch is not None and time.monotonic() >= self._next_hb_s:
            self.send(encode(Heartbeat(self.epoch)))        # valid: keeps our leases; never counted
            self._next_hb_s = time.monotonic() + HB_S
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            msg = decode_header(self.sock.recv_multipart()[0])
            if isinstance(msg, Err):
                self.errs.append(msg)
            elif isinstance(msg, Welcome):
                self.epoch, self.shm_dir = msg.epoch, msg.shm_dir
            elif isinstance(msg, LeaseGrant):
                self.leases.extend(msg.leases)

    def until(self, done: Callable[[], bool], what: str, timeout_s: float = _WAIT_S,
              heartbeat: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"{self.label}: no {what} within {timeout_s} s; errs {self.codes}"
            self.pump(20, heartbeat)

    def errors(self, n: int) -> list[str]:
        """The codes of the first ``n`` ERRs (waits for them)."""
        self.until(lambda: len(self.errs) >= n, f"{n} ERR replies")
        return self.codes[:n]

    def join(self, caps: list[str] | None = None) -> None:
        self.send(encode(self.wire.hello(producer_id=self.label, caps=caps or [])))
        self.until(lambda: self.epoch is not None, "WELCOME")

    def lease(self) -> Lease:
        """Wait for a lease (the stream must be taking batches so that ring slots free up)."""
        self.until(lambda: bool(self.leases), "LEASE")
        return self.leases.pop(0)

    def bye(self) -> None:
        if self.epoch is not None:
            self.send(encode(Bye(self.epoch)))
            self.epoch = None

    def batch(self, lease: Lease, arrays: dict[str, np.ndarray] | None = None) -> tuple[BatchHeader, list[bytes]]:
        """A well-formed BATCH for ``lease`` (real content unless ``arrays`` is given), checksummed."""
        assert self.epoch is not None
        if arrays is None:
            arrays = self.wire.reference.arrays(lease.batch_id)
        header = BatchHeader(self.epoch, lease.batch_id, lease.bucket, [list(arrays[k].shape) for k in ARRAY_KEYS],
                             [arrays[k].dtype.name for k in ARRAY_KEYS], digest(arrays), [])
        return header, [arrays[k].tobytes() for k in ARRAY_KEYS]

    def poisoned(self, lease: Lease) -> tuple[BatchHeader, list[bytes]]:
        """Well-formed, correctly checksummed, but the wrong content: applying it would show."""
        arrays = self.wire.reference.arrays(lease.batch_id)
        arrays["mel"][:] = 7.0
        return self.batch(lease, arrays)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()                 # before close (zmq-systemd E6)
            self.monitor.close(0)
        self.sock.close(0)


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


@pytest.fixture(scope="module")
def wire(demo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    tmp = tmp_path_factory.mktemp("wire")
    endpoint = f"ipc://{tmp}/melfeed.sock"
    group = ProducerGroup(tmp)
    ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
    consumer = Consumer(wire_config(demo_cache, endpoint))
    consumer.start()
    stream = Stream(consumer)
    try:
        start_producer(group, demo_cache, endpoint)
        w = Wire(consumer, stream, Reference(consumer), endpoint, ctx)
        stream.take_and_wait(5)                        # the good producer is streaming
        yield w
        w.check_stream(0)
        assert w.stats().producers_alive == 1
    finally:
        stream.close()
        consumer.close()
        assert group.stop_all() == [0]
        ctx.term()


@pytest.fixture()
def attack(wire: Wire) -> Iterator[Callable[..., BadPeer]]:
    """Makes bad peers (closed afterwards); checks that the good producer never got a reject."""
    made: list[BadPeer] = []

    def make(tag: str, monitor_events: int = 0) -> BadPeer:
        made.append(wire.peer(tag, monitor_events))
        return made[-1]
    yield make
    for p in made:
        p.close()
    assert all(name.startswith("bad-") for name in wire.stats().rejects_by_peer)


def _rejected(wire: Wire, frames_list: list[list[bytes]], peer: BadPeer, codes: list[str]) -> None:
    """Send each message, expect these ERR codes in order, counted per code and for this peer only."""
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(10)                                # the good producer streams meanwhile
    for frames in frames_list:
        peer.send(*frames)
    assert peer.errors(len(codes)) == codes
    after = wire.stats()
    expected: dict[str, int] = {}
    for c in codes:
        expected[c] = expected.get(c, 0) + 1
    assert _delta(before.rejects, after.rejects) == expected
    assert _delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: len(codes)}
    peer.bye()                                          # a joined peer returns its leases
    assert wire.stream.wait()
    wire.check_stream(start)


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
    "B4-header-beyond-a-producer-header": [msgpack.packb({"t": int(MsgKind.HELLO),
                                                          "buckets": [[1, 2, 3, 4, 5]] * 5000})],
}


@pytest.mark.parametrize("frames", list(_DECODE_CASES.values()), ids=list(_DECODE_CASES))
def test_b1_b4_undecodable_header_gets_err_decode(wire: Wire, attack: Callable[..., BadPeer],
                                                  frames: list[bytes]) -> None:
    _rejected(wire, [frames], attack("decode"), [RejectCode.DECODE])


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
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 2 << 20   # KiB: < 2 GiB ever


# --- B5: wrong frame count --------------------------------------------------------------------------

def test_b5_wrong_frame_count_of_single_frame_messages_gets_err_frames(
        wire: Wire, attack: Callable[..., BadPeer]) -> None:
    peer = attack("frames")
    msgs = [[encode(Heartbeat(wire.consumer.epoch)), b"extra"],
            [encode(wire.hello()), b"a", b"b"],
            [encode(Bye(wire.consumer.epoch)), b""]]
    _rejected(wire, msgs, peer, [RejectCode.FRAMES] * 3)
    assert wire.stats().producers_alive == 1             # the 3-frame HELLO did not join


# --- B5/B9/B10: a leased BATCH that is broken --------------------------------------------------------

Mutation = Callable[[BatchHeader, list[bytes]], tuple[BatchHeader, list[bytes]]]


def _relength(h: BatchHeader, p: list[bytes]) -> tuple[BatchHeader, list[bytes]]:
    mel_len = np.frombuffer(p[1], dtype=np.int32).copy()
    mel_len[0] = h.shapes[0][1] + 1                           # longer than the bucket's frames
    p = [p[0], mel_len.tobytes(), *p[2:]]
    crc = 0
    for frame in p:
        crc = zlib.crc32(frame, crc)
    return dataclasses.replace(h, crc32=crc), p


def _grow(shape: list[int]) -> list[int]:
    return [shape[0], shape[1] + 8, *shape[2:]]


_BATCH_CASES: dict[str, tuple[Mutation, str]] = {
    "B5-missing-frame": (lambda h, p: (h, p[:-1]), RejectCode.FRAMES),
    "B5-header-only": (lambda h, p: (h, []), RejectCode.FRAMES),
    "B5-extra-frame": (lambda h, p: (h, [*p, b"x"]), RejectCode.FRAMES),
    "B9-header-shape": (lambda h, p: (dataclasses.replace(h, shapes=[_grow(h.shapes[0]), *h.shapes[1:]]), p),
                        RejectCode.SHAPE),
    "B9-wrong-bucket": (lambda h, p: (dataclasses.replace(h, bucket=h.bucket + 1), p), RejectCode.SHAPE),
    "B9-short-payload": (lambda h, p: (h, [p[0][:-4], *p[1:]]), RejectCode.SHAPE),
    "B9-long-payload": (lambda h, p: (h, [*p[:3], p[3] + b"\0\0\0\0"]), RejectCode.SHAPE),
    "B9-length-beyond-bucket": (_relength, RejectCode.SHAPE),
    "B9-dtype-float64": (lambda h, p: (dataclasses.replace(h, dtypes=["float64", *h.dtypes[1:]]), p),
                         RejectCode.DTYPE),
    "B9-dtype-unknown": (lambda h, p: (dataclasses.replace(h, dtypes=[*h.dtypes[:3], "object"]), p),
                         RejectCode.DTYPE),
    "B10-crc-mismatch": (lambda h, p: (dataclasses.replace(h, crc32=(h.crc32 or 0) ^ 1), p), RejectCode.CRC),
    "B10-crc-missing": (lambda h, p: (dataclasses.replace(h, crc32=None), p), RejectCode.CRC),
    "B10-payload-corrupted": (lambda h, p: (h, [p[0][:-1] + bytes([p[0][-1] ^ 0xFF]), *p[1:]]), RejectCode.CRC),
}


@pytest.mark.parametrize(("mutate", "code"), list(_BATCH_CASES.values()), ids=list(_BATCH_CASES))
def test_b5_b9_b10_broken_batch_for_a_lease_is_rejected_and_the_batch_rebuilt(
        wire: Wire, attack: Callable[..., BadPeer], mutate: Mutation, code: str) -> None:
    peer = attack("batch")
    peer.join()
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)                                 # frees slots: the idle bad peer is leased first
    lease = peer.lease()
    header, payload = mutate(*peer.batch(lease))
    peer.send(encode(header), *payload)
    assert peer.errors(1) == [code]
    peer.bye()                                           # its other leases go back at once
    assert wire.stream.wait()
    after = wire.stats()
    assert _delta(before.rejects, after.rejects) == {code: 1}
    assert _delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: 1}
    assert after.leases_reissued > before.leases_reissued     # the rejected lease went back to the queue
    assert lease.batch_id in dict(wire.stream.applied)       # ... and its batch was built again
    wire.check_stream(start)                             # with the right content, once, in order


# --- B6-B8: handshake ----------------------------------------------------------------------------------

def test_b6_protocol_version_mismatch_gets_err_proto_naming_supported_versions(
        wire: Wire, attack: Callable[..., BadPeer]) -> None:
    peer = attack("proto")
    _rejected(wire, [[encode(wire.hello(proto=PROTOCOL_VERSION + 1))], [encode(wire.hello(proto=0))]], peer,
              [RejectCode.PROTO, RejectCode.PROTO])
    assert all("supported: [1]" in e.why for e in peer.errs)
    assert RejectCode.PROTO in RejectCode.FATAL          # a real producer exits 78 on it


def test_b7_messages_before_hello_or_after_the_session_ended_get_err_unknown_peer(
        wire: Wire, attack: Callable[..., BadPeer]) -> None:
    epoch = wire.consumer.epoch
    stranger = attack("stranger")
    header = BatchHeader(epoch, 0, 0, [[1]] * 4, ["float32"] * 4, None, [])
    _rejected(wire, [[encode(Heartbeat(epoch))], [encode(Bye(epoch))], [encode(header), b"", b"", b"", b""]],
              stranger, [RejectCode.UNKNOWN_PEER] * 3)

    left = attack("left")                                 # said BYE, then talks on
    left.join()
    left.bye()
    _rejected(wire, [[encode(Heartbeat(epoch))]], left, [RejectCode.UNKNOWN_PEER])

    silent = attack("silent")                             # expired: no heartbeat for the liveness period
    silent.join()
    deadline = time.monotonic() + _WAIT_S
    while wire.stats().producers_alive > 1:
        assert time.monotonic() < deadline, "silent peer never expired"
        time.sleep(0.05)
    silent.epoch = None                                   # it does not know; no automatic heartbeats
    _rejected(wire, [[encode(Heartbeat(epoch))]], silent, [RejectCode.UNKNOWN_PEER])


_CONTRACT_CASES = {
    "fingerprint": {"fingerprint": "0" * 16},
    "n_mels": {"n_mels": 64},
    "seed": {"seed": 1},
    "bucket-frames": {"buckets": [[0, BATCH_SIZE, 448, 106, 80]]},
    "batch-size": {"buckets": "batch*2"},
    "no-buckets": {"buckets": []},
}


@pytest.mark.parametrize("change", list(_CONTRACT_CASES.values()), ids=list(_CONTRACT_CASES))
def test_b8_hello_with_another_data_contract_gets_err_contract(
        wire: Wire, attack: Callable[..., BadPeer], change: dict[str, Any]) -> None:
    if change.get("buckets") == "batch*2":
        change = {"buckets": [[b[0], b[1] * 2, *b[2:]] for b in wire.consumer.bucket_set.as_wire()]}
    peer = attack("contract")
    _rejected(wire, [[encode(wire.hello(**change))]], peer, [RejectCode.CONTRACT])
    assert wire.stats().producers_alive == 1


# --- B11, B12: batches that must never be applied --------------------------------------------------------

def test_b11_batch_not_leased_to_the_sender_gets_err_lease_and_is_not_applied(
        wire: Wire, attack: Callable[..., BadPeer]) -> None:
    holder, thief = attack("holder"), attack("thief")
    holder.join()
    thief.join()
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)
    lease = holder.lease()                               # leased to holder, not to thief
    header, payload = thief.poisoned(lease)
    thief.send(encode(header), *payload)
    thief.send(encode(dataclasses.replace(header, batch_id=10**9)), *payload)      # leased to nobody
    assert thief.errors(2) == [RejectCode.LEASE, RejectCode.LEASE]
    holder.bye()
    thief.bye()
    assert wire.stream.wait()
    after = wire.stats()
    assert _delta(before.rejects, after.rejects) == {RejectCode.LEASE: 2}
    assert _delta(before.rejects_by_peer, after.rejects_by_peer) == {thief.label: 2}
    assert lease.batch_id in dict(wire.stream.applied)
    wire.check_stream(start)                             # the poisoned copy was never applied


def test_b12_duplicate_and_stale_batches_are_dropped_counted_and_never_applied(
        wire: Wire, attack: Callable[..., BadPeer]) -> None:
    peer = attack("dup")
    peer.join()
    deadline = time.monotonic() + _WAIT_S
    while not wire.consumer.ring.ready_ids():            # idle stream: the producer fills the ring
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ready = wire.consumer.ring.ready_ids()[0]             # received, not yet applied
    applied = wire.stream.applied[-1][0]                  # applied long ago
    before = wire.stats()
    start = len(wire.stream.applied)
    for batch_id in (applied, ready):
        header, payload = peer.poisoned(Lease(batch_id, wire.reference.bucket(batch_id), [], 1.0))
        peer.send(encode(header), *payload)
    peer.send(b"\xc1")                                    # barrier: replies keep order, so a dup ERR would come first
    header, payload = peer.poisoned(Lease(ready, wire.reference.bucket(ready), [], 1.0))
    peer.send(encode(dataclasses.replace(header, epoch=wire.consumer.epoch + 1)), *payload)      # stale epoch
    peer.send(encode(Heartbeat(wire.consumer.epoch - 1)))                                       # stale epoch
    assert peer.errors(3) == [RejectCode.DECODE, RejectCode.UNKNOWN_PEER, RejectCode.UNKNOWN_PEER]
    peer.bye()
    wire.stream.take_and_wait(10)
    after = wire.stats()
    assert after.duplicates_dropped - before.duplicates_dropped == 2
    assert after.stale_dropped - before.stale_dropped == 2
    assert _delta(before.rejects, after.rejects) == {RejectCode.DECODE: 1, RejectCode.UNKNOWN_PEER: 2}
    assert _delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: 3}
    assert ready in dict(wire.stream.applied)
    wire.check_stream(start)                              # the ready batch kept its real content


def test_b9_b12_negative_ids_and_epochs_are_schema_errors_not_duplicates_or_stale(
        wire: Wire, attack: Callable[..., BadPeer]) -> None:
    peer = attack("negative")
    peer.join()
    header, payload = peer.poisoned(Lease(0, wire.reference.bucket(0), [], 1.0))
    before = wire.stats()
    _rejected(wire, [[encode(dataclasses.replace(header, batch_id=-1)), *payload],
                     [encode(dataclasses.replace(header, epoch=-1)), *payload],
                     [encode(dataclasses.replace(header, bucket=-1)), *payload],
                     [encode(Heartbeat(-1))]], peer, [RejectCode.SCHEMA] * 4)
    after = wire.stats()
    assert (after.duplicates_dropped, after.stale_dropped) == (before.duplicates_dropped, before.stale_dropped)


# --- B13: kinds -------------------------------------------------------------------------------------

def test_b13_unknown_kinds_and_maps_without_kind_get_err_type_or_schema(
        wire: Wire, attack: Callable[..., BadPeer]) -> None:
    epoch = wire.consumer.epoch
    msgs = [[msgpack.packb({"epoch": epoch})], [msgpack.packb({"t": 99})], [msgpack.packb({"t": "HB"})],
            [msgpack.packb({"t": True})], [msgpack.packb([int(MsgKind.HB), epoch])],
            [encode(Welcome(epoch, 2, 0.2, True))], [encode(LeaseGrant(epoch, [], 0))], [encode(Err("X", "y"))]]
    codes = [RejectCode.SCHEMA, RejectCode.TYPE, RejectCode.TYPE, RejectCode.TYPE, RejectCode.SCHEMA,
             RejectCode.TYPE, RejectCode.TYPE, RejectCode.TYPE]
    _rejected(wire, msgs, attack("kind"), codes)


# --- B14: larger than ZMQ_MAXMSGSIZE -----------------------------------------------------------------------

def test_b14_message_over_maxmsgsize_disconnects_only_the_sender_which_can_reconnect(
        wire: Wire, attack: Callable[..., BadPeer]) -> None:
    peer = attack("huge", zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert peer.monitor is not None

    def next_event() -> int:
        assert peer.monitor is not None and peer.monitor.poll(int(_WAIT_S * 1000)), "no socket event"
        return int(recv_monitor_message(peer.monitor)["event"])

    assert next_event() == zmq.EVENT_HANDSHAKE_SUCCEEDED
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)
    limit = wire.consumer.bucket_set.max_batch_nbytes() + (1 << 20)     # the receiver's MAXMSGSIZE
    peer.send(b"\0" * (limit + 1))
    assert next_event() == zmq.EVENT_DISCONNECTED                    # libzmq dropped the connection
    assert next_event() == zmq.EVENT_HANDSHAKE_SUCCEEDED             # the DEALER reconnected ...
    peer.send(b"\xc1")
    assert peer.errors(1) == [RejectCode.DECODE]                     # ... and is heard, same routing id
    assert wire.stream.wait()
    after = wire.stats()
    assert _delta(before.rejects, after.rejects) == {RejectCode.DECODE: 1}   # the huge one never surfaced
    assert _delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: 1}
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
            pass          # never close the other side here: a cut leaves the consumer's side open

    def cut(self) -> None:
        for client, _ in self._pairs:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(5.0)                     # the accept loop, before its socket closes
        for client, upstream in self._pairs:
            client.close()
            upstream.close()
        self._server.close()
        for t in self._threads[1:]:
            t.join(5.0)


def test_b14_producer_reconnecting_after_a_cut_is_heard_as_a_new_peer_while_its_old_connection_lingers(
        demo_cache: Path, tmp_path: Path, producers: ProducerGroup) -> None:
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
            stream.take_and_wait(20)                     # leases lost in the cut expire and come back
            stats = consumer.receiver_stats()
        finally:
            stream.close()
            relay.close()
    ids = [b for b, _ in stream.applied]
    assert ids == list(range(40)) and stream.error is None
    assert stats.producers_alive == 1 and set(stats.rejects) <= {RejectCode.UNKNOWN_PEER}


# --- B15: flood ------------------------------------------------------------------------------------------------

def test_b15_flooding_peer_is_dropped_and_ignored_with_rate_limited_logs(
        wire: Wire, attack: Callable[..., BadPeer], caplog: pytest.LogCaptureFixture) -> None:
    flood_limit = 200                                     # RejectLog's production default
    flooder = attack("flood")
    flooder.join()
    start = len(wire.stream.applied)
    wire.stream.take(40)
    flooder.lease()                                       # it holds leases the good stream needs
    before = wire.stats()
    n = 300
    with caplog.at_level(logging.WARNING):
        for _ in range(n):
            flooder.send(b"\xc1")
        flooder.until(lambda: len(flooder.errs) >= flood_limit + 1, "flood replies", heartbeat=False)
        deadline = time.monotonic() + _WAIT_S
        while sum(_delta(before.rejects, wire.stats().rejects).values()) < n:
            assert time.monotonic() < deadline, _delta(before.rejects, wire.stats().rejects)
            time.sleep(0.01)
        flooder.send(encode(wire.hello(producer_id=flooder.label)))    # a blocked peer cannot re-join
        while wire.stats().rejects_by_peer.get(flooder.label, 0) < n + 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert wire.stream.wait()                          # its leases were revoked and rebuilt by the good one
    after = wire.stats()
    # 200 answered; the 201st trips the limit and is answered FLOOD; the rest (and the HELLO) are ignored.
    assert flooder.codes == [RejectCode.DECODE] * flood_limit + [RejectCode.FLOOD]
    assert _delta(before.rejects, after.rejects) == {RejectCode.DECODE: flood_limit + 1,
                                                     RejectCode.FLOOD: n - flood_limit}
    assert after.rejects_by_peer[flooder.label] == n + 1
    assert after.producers_alive == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("floods invalid messages" in w for w in warnings), warnings
    assert len(warnings) <= 4, warnings                   # not one line per reject
    flooder.pump(200, heartbeat=False)
    assert len(flooder.errs) == flood_limit + 1          # nothing answered after the block
    wire.check_stream(start)


# --- shared-memory path: a lease names a slot file, BATCH is a header naming slot and generation --------------

def _in_slot(peer: BadPeer, lease: Lease, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` into the lease's slot file, as a producer on the shm path does."""
    assert peer.shm_dir is not None and lease.shm is not None
    views = SlotMappings(peer.wire.consumer.bucket_set, 1).views(peer.shm_dir, lease.shm, lease.bucket)
    for key in ARRAY_KEYS:
        views[key][...] = arrays[key]


def _shm_header(peer: BadPeer, lease: Lease, arrays: dict[str, np.ndarray],
                slot_gen: tuple[int, int] | None = None) -> BatchHeader:
    assert lease.shm is not None
    header, _ = peer.batch(lease, arrays)
    return dataclasses.replace(header, shm=slot_gen or (lease.shm.slot, lease.shm.generation))


ShmCase = Callable[[BadPeer, Lease], list[bytes]]


def _poison_then(change: Callable[[BadPeer, Lease, dict[str, np.ndarray]], list[bytes]]) -> ShmCase:
    """Poisoned (but well-formed, checksummed) content in the slot, then the message ``change`` makes."""
    def case(peer: BadPeer, lease: Lease) -> list[bytes]:
        arrays = peer.wire.reference.arrays(lease.batch_id)
        arrays["mel"][:] = 7.0
        _in_slot(peer, lease, arrays)
        return change(peer, lease, arrays)
    return case


def _real_in_slot_but_crc_of_poison(peer: BadPeer, lease: Lease) -> list[bytes]:
    real = peer.wire.reference.arrays(lease.batch_id)
    _in_slot(peer, lease, real)
    poison = {k: v.copy() for k, v in real.items()}
    poison["mel"][:] = 7.0
    return [encode(_shm_header(peer, lease, poison))]


def _length_beyond_bucket(peer: BadPeer, lease: Lease) -> list[bytes]:
    arrays = peer.wire.reference.arrays(lease.batch_id)
    arrays["mel_len"][0] = arrays["mel"].shape[1] + 1
    _in_slot(peer, lease, arrays)
    return [encode(_shm_header(peer, lease, arrays))]


def _n_slots(peer: BadPeer) -> int:
    return peer.wire.consumer.ring.n_slots


_SHM_CASES: dict[str, tuple[ShmCase, str]] = {
    "wrong-generation": (_poison_then(lambda p, x, a: [encode(_shm_header(
        p, x, a, (x.shm.slot, x.shm.generation + 1)))]), RejectCode.LEASE),   # type: ignore[union-attr]
    "wrong-slot": (_poison_then(lambda p, x, a: [encode(_shm_header(
        p, x, a, ((x.shm.slot + 1) % _n_slots(p), x.shm.generation)))]), RejectCode.LEASE),  # type: ignore[union-attr]
    "payload-frames-on-shm-lease": (lambda p, x: [encode(p.poisoned(x)[0]), *p.poisoned(x)[1]], RejectCode.FRAMES),
    "slot-header-with-frames": (_poison_then(lambda p, x, a: [encode(_shm_header(p, x, a)),
                                                              *p.batch(x, a)[1]]), RejectCode.FRAMES),
    "crc-mismatch": (_real_in_slot_but_crc_of_poison, RejectCode.CRC),
    "length-beyond-bucket": (_length_beyond_bucket, RejectCode.SHAPE),
    "header-shape": (_poison_then(lambda p, x, a: [encode(dataclasses.replace(
        _shm_header(p, x, a), shapes=[_grow(a["mel"].shape), *_shm_header(p, x, a).shapes[1:]]))]),
        RejectCode.SHAPE),
    "dtype": (_poison_then(lambda p, x, a: [encode(dataclasses.replace(
        _shm_header(p, x, a), dtypes=["float64", *_shm_header(p, x, a).dtypes[1:]]))]), RejectCode.DTYPE),
}


@pytest.mark.parametrize(("make", "code"), list(_SHM_CASES.values()), ids=list(_SHM_CASES))
def test_shm_batch_not_matching_its_slot_lease_is_rejected_never_applied_and_the_slot_retired(
        wire: Wire, attack: Callable[..., BadPeer], make: ShmCase, code: str) -> None:
    peer = attack("shm")
    peer.join(caps=["shm"])
    assert peer.shm_dir is not None                      # the consumer offers its slot files
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(20)
    lease = peer.lease()
    assert lease.shm is not None and lease.shm.slot < _n_slots(peer)
    peer.send(*make(peer, lease))
    assert peer.errors(1) == [code]
    peer.bye()
    assert wire.stream.wait()
    after = wire.stats()
    assert _delta(before.rejects, after.rejects) == {code: 1}
    assert _delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: 1}
    assert after.shm_retired > before.shm_retired       # the slot it wrote into was orphaned, not reused
    assert lease.batch_id in dict(wire.stream.applied)   # rebuilt by the good producer ...
    wire.check_stream(start)                             # ... with the right content: the poison never applied


def test_shm_header_on_a_payload_lease_gets_err_lease(wire: Wire, attack: Callable[..., BadPeer]) -> None:
    peer = attack("noshm")
    peer.join()                                          # no CAP_SHM: payload leases
    assert peer.shm_dir is None
    start = len(wire.stream.applied)
    wire.stream.take(20)
    lease = peer.lease()
    assert lease.shm is None
    header, _ = peer.poisoned(lease)
    peer.send(encode(dataclasses.replace(header, shm=(0, 0))))
    assert peer.errors(1) == [RejectCode.LEASE]
    peer.bye()
    assert wire.stream.wait()
    wire.check_stream(start)
