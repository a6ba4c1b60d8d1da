"""Wire fuzz: seeded random malformed messages from several bad peers while a good producer streams.

Bad peers: rounds of three strangers under fresh routing ids (each stays below the flood limit), one
stranger that floods past it, and one insider that joins with a valid HELLO and answers every lease
with a broken BATCH (wrong frames, shapes, dtypes, checksums, ids, epochs). Oracle:
  * the consumer stays alive and the good producer's batches all arrive once, in plan order, with
    the content a producer builds;
  * every message a bad peer sent is counted exactly once: as a reject (per code and per peer),
    as an ignored message of a blocked peer (FLOOD) or, for the insider, as a duplicate; every
    counted reject except the ignored ones is answered by exactly one ERR;
  * the good producer's batches keep being applied during the fuzz, and 100 more after it.
Replay a failure with ``MELFEED_FUZZ_SEED=<seed>``; ``MELFEED_FUZZ_MESSAGES`` scales the run.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from melfeed.consumer.feed import Consumer
from melfeed.shared.errors import ProtocolError
from melfeed.shared.wire.protocol import (
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
from tests.integration.wire.bad_peer import (
    BATCH_CASES,
    BadPeer,
    Reference,
    Stream,
    Wire,
    delta,
    start_producer,
    wire_config,
)

SEED = int(os.environ.get("MELFEED_FUZZ_SEED", "1357"))
N_STRANGER = int(os.environ.get("MELFEED_FUZZ_MESSAGES", "1200"))  # from the rotating strangers
PER_STRANGER = 150  # below the flood limit (200 per 10 s), so every one of them is answered
N_FLOOD = 260  # from the flooder: 200 answered, the 201st answered FLOOD, the rest ignored
INSIDER_BUDGET = 80  # broken batches the insider sends before it says BYE
FLOOD_LIMIT = 200  # RejectLog's production default
WINDOW_S = 2.0  # the fuzz is spread over this long
_WAIT_S = 30.0

Frames = list[bytes]
_KEYS = [
    "t",
    "epoch",
    "id",
    "bucket",
    "shapes",
    "dtypes",
    "crc",
    "q",
    "proto",
    "pid",
    "fp",
    "buckets",
    "n_mels",
    "seed",
    "depth",
    "applied",
    "code",
    "why",
    "leases",
    "window",
    "hb",
]


class Fuzzer:
    """Seeded generator of malformed (never accidentally valid) messages for a peer without a session."""

    def __init__(self, rng: random.Random, wire: Wire) -> None:
        self.rng = rng
        c = wire.consumer
        epoch = c._run_id
        shapes = [list(s) for s in c._bucket_set.buckets[0].shapes().values()]
        batch = BatchHeader(epoch, 3, 0, shapes, ["float32", "int32", "int32", "int32"], 12345, [])
        # The fingerprint has the real one's length, never its value: no mutation can make a valid HELLO.
        hello = Hello(
            1, "fuzz", "f" * len(c.manifest.fingerprint), c._bucket_set.as_wire(), c._cfg.n_mels, c._cfg.seed, 1
        )
        self.templates = [
            hello,
            batch,
            Heartbeat(epoch, 1, 2),
            Bye(epoch),
            Welcome(epoch, 2, 0.2, True, 1),
            LeaseGrant(epoch, [Lease(1, 0, [1, 2], 3.0)], 1),
            Err(RejectCode.LEASE, "why"),
        ]
        self.batch = batch
        self.payload_bytes = [4, 16, 1024, 65536]

    def message(self) -> Frames:
        r = self.rng
        make: Callable[[], Frames] = r.choices(
            [
                self._random_bytes,
                self._truncated,
                self._flipped,
                self._random_map,
                self._wrong_field,
                self._extra_frames,
                self._batch_mutant,
                self._giant,
            ],
            weights=[15, 10, 15, 15, 20, 10, 12, 3],
        )[0]
        return make()

    # --- categories ---------------------------------------------------------------------------------
    def _random_bytes(self) -> Frames:
        return [self.rng.randbytes(self.rng.randint(0, 64))]

    def _template_bytes(self) -> bytes:
        return encode(self.rng.choice(self.templates))  # type: ignore[arg-type]

    def _truncated(self) -> Frames:
        raw = self._template_bytes()
        return [raw[: self.rng.randrange(len(raw))]]

    def _flipped(self) -> Frames:
        raw = bytearray(self._template_bytes())
        for _ in range(self.rng.randint(1, 3)):
            raw[self.rng.randrange(len(raw))] = self.rng.randrange(256)
        return [bytes(raw)]

    def _value(self, depth: int = 0) -> Any:
        r = self.rng
        kind = r.randrange(10 if depth < 3 else 7)
        if kind == 0:
            return None
        if kind == 1:
            return r.choice([True, False])
        if kind == 2:
            return r.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, r.randint(-1000, 1000)])
        if kind == 3:
            return r.choice([0.5, -1e308, float("nan"), float("inf")])
        if kind == 4:
            return "".join(r.choice("abcxyz\u00e9\u4e2d") for _ in range(r.choice([0, 3, 100, 5000])))
        if kind == 5:
            return r.randbytes(r.choice([0, 8, 5000]))
        if kind == 6:
            return r.choice(_KEYS)
        if kind in (7, 8):
            return [self._value(depth + 1) for _ in range(r.randint(0, 5))]
        return {self._key(): self._value(depth + 1) for _ in range(r.randint(0, 4))}

    def _key(self) -> Any:
        r = self.rng
        return r.choice(_KEYS) if r.random() < 0.7 else r.choice([r.randint(0, 9), "k" * r.randint(1, 9), b"\x01"])

    def _random_map(self) -> Frames:
        d = {self._key(): self._value() for _ in range(self.rng.randint(0, 6))}
        return [msgpack.packb(d, use_bin_type=True)]

    def _wrong_field(self) -> Frames:
        d = msgpack.unpackb(self._template_bytes())
        key = self.rng.choice(list(d))
        action = self.rng.randrange(3)
        if action == 0:
            del d[key]
        elif action == 1:
            d[key] = self._value()
        else:
            d[self._key()] = self._value()
        return [msgpack.packb(d, use_bin_type=True)]

    def _extra_frames(self) -> Frames:
        head = self.rng.choice([self._template_bytes(), *self._random_bytes()])
        return [head] + [self.rng.randbytes(self.rng.choice(self.payload_bytes)) for _ in range(self.rng.randint(1, 5))]

    def _batch_mutant(self) -> Frames:
        d = msgpack.unpackb(encode(self.batch))
        for _ in range(self.rng.randint(0, 2)):
            d[self.rng.choice(list(d))] = self._value()
        payload = [self.rng.randbytes(self.rng.choice(self.payload_bytes)) for _ in range(self.rng.randint(0, 6))]
        return [msgpack.packb(d, use_bin_type=True), *payload]

    def _giant(self) -> Frames:
        r = self.rng
        return [
            r.choice(
                [
                    b"\xdb\xff\xff\xff\xff",
                    b"\xdd\xff\xff\xff\xff",
                    b"\x91" * r.randint(100, 200_000) + b"\xc0",
                    msgpack.packb({"t": 1, "buckets": [[1, 2, 3, 4, 5]] * r.randint(1, 60_000)}),
                    msgpack.packb([None] * 65_537),
                    b"\x80" * 3,
                ]
            )
        ]


class Insider:
    """Joins with a valid HELLO and answers each lease with a broken batch (or a dup / stale / unleased one)."""

    def __init__(self, wire: Wire, rng: random.Random) -> None:
        self.peer = BadPeer(wire, f"fuzz-insider-{SEED}")
        self.rng = rng
        self.sent = 0
        self.done = False

    def step(self, applied: list[tuple[int, int]]) -> None:
        """Answer pending leases; say BYE once the budget is spent."""
        p = self.peer
        p.pump(0)
        while p.leases and not self.done:
            lease = p.leases.pop(0)
            header, payload = p.batch(lease)
            choice = self.rng.randrange(len(BATCH_CASES) + 3)
            if choice < len(BATCH_CASES):  # answers the lease: it is requeued
                mutate, _ = list(BATCH_CASES.values())[choice]
                header, payload = mutate(header, payload)
            else:  # leaves the lease open: answer it later
                p.leases.insert(0, lease)
                if choice == len(BATCH_CASES):
                    header = dataclasses.replace(header, batch_id=10**9 + self.sent)  # LEASE
                elif choice == len(BATCH_CASES) + 1 and applied:
                    header = dataclasses.replace(header, batch_id=applied[-1][0])  # dup
                else:
                    header = dataclasses.replace(header, epoch=header.epoch + 2)  # stale: UNKNOWN_PEER
            p.send(encode(header), *payload)
            self.sent += 1
            if self.sent >= INSIDER_BUDGET:
                p.bye()
                self.done = True


def _drain(sock: zmq.Socket[bytes], errs: dict[bytes, int], key: bytes) -> None:
    while sock.poll(0):
        try:
            msg = decode_header(sock.recv_multipart()[0])
        except ProtocolError:
            continue
        if isinstance(msg, Err):
            errs[key] = errs.get(key, 0) + 1


def _wait(done: Callable[[], bool], timeout_s: float = _WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Attack:
    """The strangers' and the flooder's messages, planned up front, and their sockets and replies."""

    def __init__(self, rng: random.Random, wire: Wire) -> None:
        fuzz = Fuzzer(rng, wire)
        self.plan: list[tuple[bytes, Frames]] = []  # (routing id, frames), in sending order
        for rnd in range(-(-N_STRANGER // (3 * PER_STRANGER))):  # rounds of 3 fresh strangers
            names = [f"fuzz-{SEED}-r{rnd}-{i}".encode() for i in range(3)]
            n = min(3 * PER_STRANGER, N_STRANGER - len(self.plan))
            self.plan.extend((rng.choice(names), fuzz.message()) for _ in range(n))
        self.flooder = f"fuzz-{SEED}-flood".encode()
        middle = len(self.plan) // 2
        self.plan[middle:middle] = [(self.flooder, fuzz.message()) for _ in range(N_FLOOD)]
        self.sent: dict[bytes, int] = {}
        for name, _ in self.plan:
            self.sent[name] = self.sent.get(name, 0) + 1
        assert max(n for k, n in self.sent.items() if k != self.flooder) < FLOOD_LIMIT
        self.errs: dict[bytes, int] = {}
        self.socks: dict[bytes, zmq.Socket[bytes]] = {}
        for name in self.sent:
            s = wire.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, name)
            s.connect(wire.endpoint)
            self.socks[name] = s

    def run(self, insider: Insider, stream: Stream) -> None:
        """Send the plan evenly over ``WINDOW_S``; the insider answers its leases meanwhile."""
        interval_s = WINDOW_S / len(self.plan)
        t0 = time.monotonic()
        for i, (name, frames) in enumerate(self.plan):
            while time.monotonic() < t0 + i * interval_s:
                time.sleep(interval_s / 4)
            self.socks[name].send_multipart(frames)
            insider.step(stream.applied)
            if i % 16 == 0:
                self.drain()

    def drain(self) -> None:
        for key, s in self.socks.items():
            _drain(s, self.errs, key)

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)


def _insider_finishes(insider: Insider, stream: Stream) -> bool:
    insider.step(stream.applied)
    return insider.done


def test_fuzzed_malformed_messages_are_all_counted_and_answered_while_a_good_producer_streams(
    demo_cache: Path, tmp_path: Path, producers: ProducerGroup
) -> None:
    rng = random.Random(SEED)
    endpoint = f"ipc://{tmp_path}/fuzz.sock"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with Consumer(wire_config(demo_cache, endpoint)) as consumer:
        stream = Stream(consumer)
        wire = Wire(consumer, stream, Reference(consumer), endpoint, ctx)
        attack = Attack(rng, wire)  # planned before anything is measured
        insider = Insider(wire, rng)
        try:
            start_producer(producers, demo_cache, endpoint)
            stream.take(10**9)  # free-running step loop
            assert _wait(lambda: len(stream.applied) >= 50), stream.error  # warm
            before = consumer._receiver.stats()
            n0 = len(stream.applied)
            insider.peer.join()
            attack.run(insider, stream)
            applied_during_fuzz = len(stream.applied) - n0
            assert _wait(lambda: _insider_finishes(insider, stream)), insider.sent  # spends its budget, BYE
            total_sent = len(attack.plan) + insider.sent

            def settled() -> bool:
                attack.drain()
                insider.peer.pump(0, heartbeat=False)
                now = consumer._receiver.stats()
                counted = sum(delta(before.rejects, now.rejects).values())
                return counted + now.duplicates_dropped - before.duplicates_dropped >= total_sent

            assert _wait(settled), delta(before.rejects, consumer._receiver.stats().rejects)
            time.sleep(0.2)  # a surplus count or reply would show by now
            settled()
            after = consumer._receiver.stats()
            n_after = len(stream.applied)
            assert _wait(lambda: len(stream.applied) >= n_after + 100), f"stream stopped: {stream.error}"
        finally:
            stream.close()
            attack.close()
            insider.peer.close()
    ctx.term()

    context = f"seed {SEED}"
    assert stream.error is None, context
    rejects = delta(before.rejects, after.rejects)
    by_peer = delta(before.rejects_by_peer, after.rejects_by_peer)
    dups = after.duplicates_dropped - before.duplicates_dropped  # only the insider sends copies
    # Every message counted once: a reject, an ignored one (FLOOD) or a duplicate.
    assert sum(rejects.values()) + dups == total_sent, (context, rejects, dups, total_sent)
    assert rejects.get(RejectCode.FLOOD, 0) == N_FLOOD - FLOOD_LIMIT - 1, (context, rejects)
    # ... per peer, and every reject but the ignored ones answered by exactly one ERR.
    for key, n in attack.sent.items():
        answered = FLOOD_LIMIT + 1 if key == attack.flooder else n
        assert (by_peer.get(key.decode()), attack.errs.get(key)) == (n, answered), (context, key)
    insider_rejects = by_peer.get(insider.peer.label, 0)
    assert (insider_rejects + dups, len(insider.peer.errs)) == (insider.sent, insider_rejects), context
    assert set(by_peer) <= {k.decode() for k in attack.sent} | {insider.peer.label}, context  # never the good one
    answers = sum(attack.errs.values()) + len(insider.peer.errs)
    assert answers == sum(rejects.values()) - rejects.get(RejectCode.FLOOD, 0), context
    # The good producer's batches: once, in plan order, with a producer's content.
    ids = [b for b, _ in stream.applied]
    assert ids == list(range(len(ids))), context
    assert all(got == wire.reference.digest(b) for b, got in stream.applied), context
    # The good producer kept streaming while the fuzz ran (a count, not a speed: a loaded machine may be slow,
    # but a receiver stuck on bad input would apply nothing in the window); its throughput is measured by bench.
    assert applied_during_fuzz > 0, (context, applied_during_fuzz)
