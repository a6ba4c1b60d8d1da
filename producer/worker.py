"""One producer process: HELLO, then build and send exactly the batches leased to it.

Lifecycle: DISCONNECTED --HELLO/WELCOME--> ACTIVE. A producer drops all leases and says HELLO
again (with back-off up to ``connect_backoff_max_s``) when the consumer is silent for the liveness
period, announces a new epoch, or answers ``ERR UNKNOWN_PEER``. ``ERR PROTO``/``ERR CONTRACT``
are configuration errors, and so is a bad cache file under ``producer.bad_samples: fail``: the process
exits 78 so systemd does not restart it in a loop.
Same-host shared memory: with ``slot_maps`` the HELLO offers ``CAP_SHM``; when the WELCOME names an
``shm_dir`` the leases name slot files, the batch is built straight into the mapped slot and the
BATCH is the header alone. If a slot file cannot be mapped the producer warns once (file, errno),
stops offering ``CAP_SHM`` and joins again: payload frames from then on.
Single-threaded: building a batch takes a few ms, far below the heartbeat interval.
Shutdown: the stop event is checked every loop; on stop it sends BYE (so its leases are reissued at
once) and closes the socket with linger 0.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from producer.batcher import BatchAssembler, BuiltBatch
from producer.slot_maps import SlotMappings
from producer.reader import TransientReadError
from shared.wire.curve import ClientKeys
from shared.wire.buckets import BucketSet
from shared.errors import EXIT_CONFIG, CacheError, ProtocolError
from shared.wire.protocol import (ARRAY_KEYS, CAP_SHM, PROTOCOL_VERSION, BatchHeader, Bye, Err, Heartbeat, Hello,
                             Lease, LeaseGrant, RejectCode, StageCounters, Welcome, decode_header, encode)

__all__ = ["ProducerWorker", "ProducerStats"]

log = logging.getLogger(__name__)

_WAITING_WARN_S = 10.0   # warn when no consumer answered for this long (silent connect failures)
_FIRST_BACKOFF_S = 0.1
_MAX_MISSING_FILES = 3   # more consecutive missing slot files: shm_dir is not visible here, use payload frames


@dataclass(frozen=True, slots=True)
class ProducerStats:
    batches_sent: int
    build_s_total: float
    send_s_total: float
    rejoins: int
    errors_received: dict[str, int]
    shm_batches: int = 0          # of batches_sent, built in the consumer's shared-memory slots


class ProducerWorker:
    """Producer loop over one DEALER socket.

    Args:
        endpoint: the consumer's endpoint.
        producer_id: stable name (``producer-3``); the routing id adds the pid so a restart is new.
        assembler: builds batches into send buffers.
        bucket_set, fingerprint, n_mels, seed: the data contract announced in HELLO.
        slot_maps: maps the consumer's slot files (same-host ipc, ``transport.mode`` auto/shm);
            ``None`` = payload frames only.
    """

    def __init__(self, endpoint: str, producer_id: str, assembler: BatchAssembler, bucket_set: BucketSet,
                 fingerprint: str, n_mels: int, seed: int, *, heartbeat_interval_s: float,
                 liveness_s: float, backoff_max_s: float, debug_delay_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_tick: Callable[[ProducerWorker], None] | None = None,
                 curve: ClientKeys | None = None, slot_maps: SlotMappings | None = None) -> None:
        self.endpoint = endpoint
        self.producer_id = producer_id
        self._assembler = assembler
        self._slot_maps = slot_maps
        self._shm_dir: str | None = None      # from WELCOME: leases name files here
        self._shm_sent = 0
        self._missing_files = 0               # consecutive slot files not found
        self._hello = Hello(PROTOCOL_VERSION, producer_id, fingerprint, bucket_set.as_wire(), n_mels, seed,
                            [CAP_SHM] if slot_maps is not None else [])
        self._hb_s = heartbeat_interval_s
        self._liveness_s = liveness_s
        self._backoff_max_s = backoff_max_s
        self._debug_delay_s = debug_delay_s
        self._clock = clock
        self._epoch: int | None = None
        self._checksum = False
        self._leases: deque[tuple[Lease, float]] = deque()   # (lease, expiry on our clock)
        self._last_heard_s = 0.0
        self._sent = 0
        self._build_s = 0.0
        self._send_s = 0.0
        self._rejoins = 0
        self._errors: dict[str, int] = {}
        self._on_tick = on_tick     # called once per loop turn (bounded by the heartbeat period): sd_notify
        self._curve = curve         # CURVE client keys (tcp beyond loopback); None = plaintext
        self.exit_code = 0

    @property
    def joined_epoch(self) -> int | None:
        """The consumer epoch we joined, or ``None`` while waiting for a consumer."""
        return self._epoch

    def stats(self) -> ProducerStats:
        return ProducerStats(self._sent, self._build_s, self._send_s, self._rejoins, dict(self._errors),
                             self._shm_sent)

    def stage_counters(self) -> StageCounters:
        """Cumulative stage times for the heartbeat: read (preadv), assemble (rest of the build), send."""
        read_s = min(self._assembler.read_s_total, self._build_s)   # reads of a failed build are not counted
        return StageCounters(self._sent, read_s, self._build_s - read_s, self._send_s)

    def run(self, stop: threading.Event) -> int:
        """Run until ``stop`` is set or a fatal error. Returns the process exit code."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)   # never queue into a pipe with no consumer behind it
        # No ROUTING_ID: the consumer's ROUTER assigns a fresh one per connection (docs/ARCHITECTURE.md "Trust").
        if self._curve is not None:
            self._curve.apply(sock)
        try:
            sock.connect(self.endpoint)
            self._loop(sock, stop)
            if self._epoch is not None:
                self._try_send(sock, [encode(Bye(self._epoch))])
        finally:
            sock.close(0)
            ctx.term()
        return self.exit_code

    def _loop(self, sock: zmq.Socket[bytes], stop: threading.Event) -> None:
        backoff_s = _FIRST_BACKOFF_S
        next_hello_s = self._clock()
        waiting_since_s = self._clock()
        warned = False
        next_hb_s = 0.0
        while not stop.is_set() and self.exit_code == 0:
            if self._on_tick is not None:
                self._on_tick(self)
            now = self._clock()
            if self._epoch is None:
                if now >= next_hello_s:
                    self._try_send(sock, [encode(self._hello)])
                    next_hello_s = now + backoff_s
                    backoff_s = min(backoff_s * 2, self._backoff_max_s)
                if not warned and now - waiting_since_s > _WAITING_WARN_S:
                    log.warning("no consumer answered at %s for %.0f s; still waiting", self.endpoint,
                                now - waiting_since_s)
                    warned = True
            elif now - self._last_heard_s > self._liveness_s:
                log.warning("consumer silent for %.1f s; dropping %d leases and re-joining",
                            now - self._last_heard_s, len(self._leases))
                self._forget_consumer()
                backoff_s, next_hello_s, waiting_since_s, warned = _FIRST_BACKOFF_S, now, now, False
                continue
            busy = self._epoch is not None and bool(self._leases)
            timeout_ms = 0 if busy else max(1, int(min(self._hb_s, max(0.0, next_hello_s - now)) * 1000))
            if sock.poll(timeout_ms, zmq.POLLIN):
                self._drain_inbox(sock)
                if self._epoch is None:
                    backoff_s, next_hello_s = _FIRST_BACKOFF_S, self._clock()
                    waiting_since_s = self._clock()
            if self._epoch is None:
                continue
            if self._leases:
                self._build_and_send(sock)
                if self._epoch is None:        # the build made us leave (slot file unusable): HELLO again
                    continue
            now = self._clock()
            if now >= next_hb_s:
                self._try_send(sock, [encode(Heartbeat(self._epoch, stats=self.stage_counters()))])
                next_hb_s = now + self._hb_s

    def _drain_inbox(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_header(frames[0])
            except ProtocolError as err:
                log.warning("undecodable message from consumer: %s", err)
                continue
            self._on_message(msg)

    def _on_message(self, msg: object) -> None:
        now = self._clock()
        if isinstance(msg, Welcome):
            if self._epoch is not None and msg.epoch != self._epoch:
                self._rejoins += 1
            self._epoch, self._checksum = msg.epoch, msg.checksum
            self._shm_dir = msg.shm_dir if self._slot_maps is not None else None
            self._leases.clear()
            if msg.shm_dir is not None and self._slot_maps is None:
                # Answer to a HELLO that still offered shm (sent before we gave it up): join again without.
                self._epoch = None
                return
            self._last_heard_s = now
            log.info("joined consumer epoch=%d window=%d transport=%s", msg.epoch, msg.window,
                     f"shm ({self._shm_dir})" if self._shm_dir else "zmq")
        elif isinstance(msg, LeaseGrant | Heartbeat):
            if msg.epoch != self._epoch:
                if self._epoch is not None:
                    log.warning("consumer epoch changed (%s -> %d); re-joining", self._epoch, msg.epoch)
                    self._forget_consumer()
                return
            self._last_heard_s = now
            if isinstance(msg, LeaseGrant):
                held = {x.batch_id for x, _ in self._leases}
                self._leases.extend((x, now + x.deadline_s) for x in msg.leases if x.batch_id not in held)
        elif isinstance(msg, Err):
            self._errors[msg.code] = self._errors.get(msg.code, 0) + 1
            if msg.code == RejectCode.UNKNOWN_PEER:
                log.info("consumer does not know us (%s); re-joining", msg.why)
                self._forget_consumer()
            elif msg.code in RejectCode.FATAL:
                log.error("consumer refused this producer: %s: %s", msg.code, msg.why)
                self.exit_code = EXIT_CONFIG
            else:
                log.warning("consumer rejected a message: %s: %s", msg.code, msg.why)

    def _forget_consumer(self) -> None:
        if self._epoch is not None:
            self._rejoins += 1
        self._epoch = None
        self._leases.clear()

    def _build_and_send(self, sock: zmq.Socket[bytes]) -> None:
        lease, expiry_s = self._leases.popleft()
        if self._clock() > expiry_s:
            log.info("lease for batch %d expired before it was built; skipping", lease.batch_id)
            return
        t0 = time.perf_counter()
        target = None
        if lease.shm is not None:
            target = self._slot_views(lease)
            if target is None:
                return
        try:
            batch = self._assembler.build(lease.batch_id, lease.bucket, lease.sample_ids, target)
        except TransientReadError as err:   # not the file's fault: exit 1, the supervisor restarts us
            log.error("cannot build batch %d (transient, restarting): %s", lease.batch_id, err)
            self.exit_code = 1
            return
        except CacheError as err:           # producer.bad_samples=fail; a restart would hit it again
            log.error("bad cache file in batch %d (producer.bad_samples=fail); stopping: %s", lease.batch_id, err)
            self.exit_code = EXIT_CONFIG
            return
        if self._debug_delay_s:
            time.sleep(self._debug_delay_s)
        t1 = time.perf_counter()
        self._send_batch(sock, batch, None if lease.shm is None else (lease.shm.slot, lease.shm.generation))
        self._build_s += t1 - t0
        self._send_s += time.perf_counter() - t1

    def _slot_views(self, lease: Lease) -> dict[str, Any] | None:
        """Views of the lease's slot file; on failure fall back to payload frames for good."""
        assert lease.shm is not None
        if self._slot_maps is None or self._shm_dir is None:
            log.warning("lease for batch %d names a slot file, but shared memory was not agreed; joining again",
                        lease.batch_id)
            self._forget_consumer()
            return None
        try:
            views = self._slot_maps.views(self._shm_dir, lease.shm, lease.bucket)
            self._missing_files = 0
            return views
        except (OSError, ValueError, KeyError) as err:
            if getattr(err, "errno", None) == errno.ENOENT and self._missing_files < _MAX_MISSING_FILES:
                # A slot retired while the lease was in flight (a re-handshake race): the consumer has
                # already re-leased it; skip it. Only repeated misses mean we cannot see shm_dir.
                self._missing_files += 1
                log.info("slot file %s is gone (retired); skipping batch %d", lease.shm.name, lease.batch_id)
                return None
            log.warning("cannot map slot file %s (errno %s: %s); using ZeroMQ payload frames from now on",
                        f"{self._shm_dir}/{lease.shm.name}", getattr(err, "errno", None),
                        getattr(err, "strerror", None) or err)
            self._slot_maps.clear()
            self._slot_maps = None
            self._hello = dataclasses.replace(self._hello, caps=[])
            self._forget_consumer()         # the re-HELLO without CAP_SHM returns our leases at once
            return None

    def _send_batch(self, sock: zmq.Socket[bytes], batch: BuiltBatch, shm: tuple[int, int] | None = None) -> None:
        assert self._epoch is not None
        arrays = [batch.arrays[k] for k in ARRAY_KEYS]
        crc = None
        if self._checksum:
            crc = 0
            for a in arrays:
                crc = zlib.crc32(memoryview(a).cast("B"), crc)
        header = BatchHeader(self._epoch, batch.batch_id, batch.bucket, [list(a.shape) for a in arrays],
                             [a.dtype.name for a in arrays], crc, batch.quarantined, shm)
        if shm is not None:                 # built in the consumer's slot: the header is the message
            if self._try_send(sock, [encode(header)]):
                self._sent += 1
                self._shm_sent += 1
            else:
                log.warning("consumer not reachable; batch %d not sent (its lease will be reissued)", batch.batch_id)
            return
        # One tracker over every zero-copy frame: send_multipart's return covers only the last one.
        frames = [zmq.Frame(a, copy=False, track=True) for a in arrays]
        try:
            sock.send_multipart([encode(header), *frames], flags=zmq.NOBLOCK, copy=False)
            tracker = zmq.MessageTracker(*frames)
        except zmq.Again:
            log.warning("consumer not reachable; batch %d not sent (its lease will be reissued)", batch.batch_id)
            return
        batch.attach(tracker)
        self._sent += 1

    @staticmethod
    def _try_send(sock: zmq.Socket[bytes], frames: list[bytes]) -> bool:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
