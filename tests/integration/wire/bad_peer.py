"""A harness for bad input on the wire: one real consumer, one real producer, and raw bad peers.

``Wire`` holds a library ``Consumer`` and its test-owned step loop (``Stream``), which takes batches on
demand; ``BadPeer`` is a raw DEALER that sends whatever a test builds; ``Reference`` recomputes, with the
producer's own assembler, the content every batch must have. The fixtures (tests/integration/wire/conftest.py)
start one of each per test module. The cases themselves are in test_bad_frames.py (undecodable, wrong
frame counts, kinds, sizes, floods) and test_bad_leases.py (handshake, leases, duplicates, the shm
fencing); the fuzz test (test_fuzz_wire.py) reuses the same harness and ``BATCH_CASES``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from melfeed.consumer.feed import Consumer
from melfeed.consumer.flow.plan import EpochPlan
from melfeed.consumer.transport.receiver import ReceiverStats
from melfeed.producer.batcher import BatchAssembler
from melfeed.producer.reader import CacheReader
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ClosedError
from melfeed.shared.wire.layout import ARRAY_KEYS
from melfeed.shared.wire.protocol import (
    PROTOCOL_VERSION,
    BatchHeader,
    Bye,
    Err,
    Heartbeat,
    Hello,
    Lease,
    LeaseGrant,
    RejectCode,
    Welcome,
    decode_header,
    encode,
)
from tests.conftest import ProducerGroup

BATCH_SIZE = 4  # tiny batches: a test moves dozens in well under a second
HB_S = 0.2
WAIT_S = 20.0  # bound of every wait below; only a hang gets near it
_names = itertools.count()
_NONCES = itertools.count(1)  # a new join nonce for every HELLO not given one


def wire_config(cache: Path, endpoint: str, lease_timeout_s: float = 5.0) -> Any:
    """Endless consumer, checksums on (B10), short liveness and lease deadlines; loopback tcp without CURVE."""
    return config_from_mapping(
        {
            "cache_dir": str(cache),
            "buckets": {"batch_size": BATCH_SIZE},
            "consumer": {"steps": None, "wait_timeout_s": 0.2},
            "transport": {
                "endpoint": endpoint,
                "heartbeat_interval_s": HB_S,
                "checksum": True,
                "lease_timeout_s": lease_timeout_s,
                "insecure": endpoint.startswith("tcp://"),
            },
        }
    )


def start_producer(group: ProducerGroup, cache: Path, endpoint: str) -> None:
    group.start(
        cache, endpoint, 1, buckets={"batch_size": BATCH_SIZE}, transport={"insecure": endpoint.startswith("tcp://")}
    )


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

    def wait(self, timeout_s: float = WAIT_S) -> bool:
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
        self._plan = EpochPlan(
            consumer._bucket_set, consumer.manifest.fingerprint, consumer._cfg.seed, consumer._cfg.buckets.partial
        )
        self._assembler = BatchAssembler(CacheReader(consumer.manifest), consumer._bucket_set, max_buffers=1)

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
        return self.consumer._receiver.stats()

    def hello(self, **change: Any) -> Hello:
        c = self.consumer
        good = Hello(
            PROTOCOL_VERSION,
            "bad",
            c.manifest.fingerprint,
            c._bucket_set.as_wire(),
            c._cfg.n_mels,
            c._cfg.seed,
            next(_NONCES),
        )
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
        self.sock.setsockopt(zmq.ROUTING_ID, label.encode())  # fixed, so its counters have a known label
        self.monitor = self.sock.get_monitor_socket(monitor_events) if monitor_events else None
        self.sock.connect(wire.endpoint)
        self.errs: list[Err] = []
        self.leases: list[Lease] = []
        self.epoch: int | None = None
        self.shm_dir: str | None = None
        self.welcomes: list[Welcome] = []
        self._next_hb_s = 0.0

    @property
    def codes(self) -> list[str]:
        return [e.code for e in self.errs]

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def pump(self, timeout_ms: int, heartbeat: bool = True) -> None:
        if heartbeat and self.epoch is not None and time.monotonic() >= self._next_hb_s:
            self.send(encode(Heartbeat(self.epoch)))  # valid: keeps our leases; never counted
            self._next_hb_s = time.monotonic() + HB_S
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            msg = decode_header(self.sock.recv_multipart()[0])
            if isinstance(msg, Err):
                self.errs.append(msg)
            elif isinstance(msg, Welcome):
                self.epoch, self.shm_dir = msg.epoch, msg.shm_dir
                self.welcomes.append(msg)
            elif isinstance(msg, LeaseGrant):
                self.leases.extend(msg.leases)

    def until(self, done: Callable[[], bool], what: str, timeout_s: float = WAIT_S, heartbeat: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"{self.label}: no {what} within {timeout_s} s; errs {self.codes}"
            self.pump(20, heartbeat)

    def errors(self, n: int) -> list[str]:
        """The codes of the first ``n`` ERRs (waits for them)."""
        self.until(lambda: len(self.errs) >= n, f"{n} ERR replies")
        return self.codes[:n]

    def join(self, caps: list[str] | None = None, nonce: int | None = None) -> None:
        """HELLO (with ``nonce``, else a new join's), then wait for a WELCOME to it."""
        answered = len(self.welcomes)
        change: dict[str, Any] = {} if nonce is None else {"nonce": nonce}
        self.send(encode(self.wire.hello(producer_id=self.label, caps=caps or [], **change)))
        self.until(lambda: len(self.welcomes) > answered, "WELCOME")

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
        header = BatchHeader(
            self.epoch,
            lease.batch_id,
            lease.bucket,
            [list(arrays[k].shape) for k in ARRAY_KEYS],
            [arrays[k].dtype.name for k in ARRAY_KEYS],
            digest(arrays),
            [],
        )
        return header, [arrays[k].tobytes() for k in ARRAY_KEYS]

    def poisoned(self, lease: Lease) -> tuple[BatchHeader, list[bytes]]:
        """Well-formed, correctly checksummed, but the wrong content: applying it would show."""
        arrays = self.wire.reference.arrays(lease.batch_id)
        arrays["mel"][:] = 7.0
        return self.batch(lease, arrays)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()  # before close (zmq-systemd E6)
            self.monitor.close(0)
        self.sock.close(0)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def expect_rejected(wire: Wire, frames_list: list[list[bytes]], peer: BadPeer, codes: Sequence[str]) -> None:
    """Send each message, expect these ERR codes in order, counted per code and for this peer only."""
    before = wire.stats()
    start = len(wire.stream.applied)
    wire.stream.take(10)  # the good producer streams meanwhile
    for frames in frames_list:
        peer.send(*frames)
    assert peer.errors(len(codes)) == codes
    after = wire.stats()
    expected: dict[str, int] = {}
    for c in codes:
        expected[c] = expected.get(c, 0) + 1
    assert delta(before.rejects, after.rejects) == expected
    assert delta(before.rejects_by_peer, after.rejects_by_peer) == {peer.label: len(codes)}
    peer.bye()  # a joined peer returns its leases
    assert wire.stream.wait()
    wire.check_stream(start)


# --- B5/B9/B10: a leased BATCH that is broken --------------------------------------------------------

Mutation = Callable[[BatchHeader, list[bytes]], tuple[BatchHeader, list[bytes]]]


def _relength(h: BatchHeader, p: list[bytes]) -> tuple[BatchHeader, list[bytes]]:
    mel_len = np.frombuffer(p[1], dtype=np.int32).copy()
    mel_len[0] = h.shapes[0][1] + 1  # longer than the bucket's frames
    p = [p[0], mel_len.tobytes(), *p[2:]]
    crc = 0
    for frame in p:
        crc = zlib.crc32(frame, crc)
    return dataclasses.replace(h, crc32=crc), p


def grow_frames(shape: Sequence[int]) -> list[int]:
    return [shape[0], shape[1] + 8, *shape[2:]]


BATCH_CASES: dict[str, tuple[Mutation, str]] = {
    "B5-missing-frame": (lambda h, p: (h, p[:-1]), RejectCode.FRAMES),
    "B5-header-only": (lambda h, p: (h, []), RejectCode.FRAMES),
    "B5-extra-frame": (lambda h, p: (h, [*p, b"x"]), RejectCode.FRAMES),
    "B9-header-shape": (
        lambda h, p: (dataclasses.replace(h, shapes=[grow_frames(h.shapes[0]), *h.shapes[1:]]), p),
        RejectCode.SHAPE,
    ),
    "B9-wrong-bucket": (lambda h, p: (dataclasses.replace(h, bucket=h.bucket + 1), p), RejectCode.SHAPE),
    "B9-short-payload": (lambda h, p: (h, [p[0][:-4], *p[1:]]), RejectCode.SHAPE),
    "B9-long-payload": (lambda h, p: (h, [*p[:3], p[3] + b"\0\0\0\0"]), RejectCode.SHAPE),
    "B9-length-beyond-bucket": (_relength, RejectCode.SHAPE),
    "B9-dtype-float64": (lambda h, p: (dataclasses.replace(h, dtypes=["float64", *h.dtypes[1:]]), p), RejectCode.DTYPE),
    "B9-dtype-unknown": (lambda h, p: (dataclasses.replace(h, dtypes=[*h.dtypes[:3], "object"]), p), RejectCode.DTYPE),
    "B10-crc-mismatch": (lambda h, p: (dataclasses.replace(h, crc32=(h.crc32 or 0) ^ 1), p), RejectCode.CRC),
    "B10-crc-missing": (lambda h, p: (dataclasses.replace(h, crc32=None), p), RejectCode.CRC),
    "B10-payload-corrupted": (lambda h, p: (h, [p[0][:-1] + bytes([p[0][-1] ^ 0xFF]), *p[1:]]), RejectCode.CRC),
}
