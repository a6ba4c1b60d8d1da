"""One producer process's socket shell: a DEALER loop around ``ProducerSession``.

The session (``producer/session.py``) decides everything about the protocol (HELLO and its back-off,
epochs, liveness, leases, heartbeats, when to exit); this module owns the socket, the poll loop, building
each leased batch through ``producer/batcher.py`` (into the consumer's mapped slot file on the shm
path, else a send buffer) and sending it; with rows or a whole plan learned in the handshake, the buffers and slot
views take the joined consumer's rows or shapes before its first build. ``ERR PROTO``/``ERR CONTRACT`` and a bad
cache file under ``producer.bad_samples: fail`` exit 78 so systemd does not restart the process in a loop; any other
failure to build exits 1 (the supervisor restarts it).
Errors cross the process boundary as data: before exiting non-zero the worker sends
``Bye(epoch, exit_code, "<ExceptionType>: <message>")`` so the consumer logs why (best-effort: NOBLOCK,
and the socket lingers at most ``_BYE_LINGER_MS`` for it; docs/design.md, invariant 6).
Trust (docs/security.md "Which consumer a producer trusts"): for an ``ipc://PATH`` endpoint the DEALER
connects only once the socket file is a socket owned by our effective uid or root, and a WELCOME (a new consumer
epoch, or a
repeat) is taken only if that still holds (the file may have been replaced since); otherwise that consumer is
refused with one WARNING naming the path and the owner, and HELLO goes on with its back-off as if no
consumer had answered. Slot files are checked in ``producer/slot_maps.py``.
Single-threaded: building a batch takes a few ms, far below the heartbeat interval.
Shutdown: the stop event is checked every loop turn; on stop it sends BYE (so its leases are reissued
at once) and closes the socket with linger 0. The loop also ends, exit 0, when the consumer's plan ended
and the session was told to exit then (``exit_at_plan_end``, set by ``run``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import zmq

from melfeed.producer.batcher import BuiltBatch
from melfeed.producer.reader import TransientReadError
from melfeed.producer.session import BuildOrder, Planner, ProducerSession, ProducerSessionConfig
from melfeed.producer.slot_maps import SlotMappings
from melfeed.shared.errors import EXIT_CONFIG, CacheError, ProtocolError
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.curve import ClientKeys
from melfeed.shared.wire.protocol import BatchHeader, Message, StageCounters, Welcome, decode_header, encode
from melfeed.shared.wire.same_host import ipc_socket_path, socket_file_problem

__all__ = ["ProducerWorker", "ProducerStats", "WorkerConfig", "BatchBuilder", "Dealer"]

log = logging.getLogger(__name__)

_BYE_LINGER_MS = 500  # a failing producer's BYE may take this long to leave; then the exit goes on


class BatchBuilder(Protocol):
    """What the worker needs of ``melfeed.producer.batcher.BatchAssembler`` (tests pass a fake)."""

    read_s_total: float

    def build(
        self,
        batch_id: int,
        bucket: int,
        sample_ids: list[int],
        target: dict[str, npt.NDArray[np.generic]] | None = None,
    ) -> BuiltBatch: ...

    def use_rows(self, rows: list[int]) -> None: ...

    def use_buckets(self, buckets: tuple[Bucket, ...]) -> None: ...


class Dealer(Protocol):
    """The few ``zmq.Socket`` calls the loop makes (tests pass ``tests.fakes.FakeDealer``)."""

    def connect(self, addr: str) -> Any: ...

    def poll(self, timeout: int, flags: int) -> int: ...

    def recv_multipart(self, flags: int) -> list[bytes]: ...

    def send_multipart(self, msg_parts: Any, flags: int = 0, copy: bool = True) -> Any: ...


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Where to connect and how; the session's config carries the producer's name and contract."""

    endpoint: str
    session: ProducerSessionConfig
    debug_delay_s: float = 0.0  # sleep after each build (``--debug-delay-ms``: a slow producer)
    curve: ClientKeys | None = None  # CURVE client keys (tcp beyond loopback); None = plaintext


@dataclass(frozen=True, slots=True)
class ProducerStats:
    batches_sent: int
    build_s_total: float
    send_s_total: float
    rejoins: int
    errors_received: dict[str, int]
    shm_batches: int = 0  # of batches_sent, built in the consumer's shared-memory slots


class ProducerWorker:
    """Producer loop over one DEALER socket.

    Args:
        cfg: endpoint, the session's config (name, contract, timing), debug delay, CURVE keys.
        assembler: builds batches into send buffers or a given slot.
        slot_maps: maps the consumer's slot files (same-host ipc, ``transport.mode`` auto/shm);
            ``None`` = payload frames only. Its presence makes HELLO offer ``CAP_SHM``.
        clock: monotonic seconds (tests inject a fake).
        on_tick: called once per loop turn (bounded by the heartbeat period): sd_notify.
        planner: plans the shapes with a WELCOME's weights (``cfg.session.learns_plan``: ``buckets.cost: measured``).
    """

    def __init__(
        self,
        cfg: WorkerConfig,
        assembler: BatchBuilder,
        slot_maps: SlotMappings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_tick: Callable[[ProducerWorker], None] | None = None,
        planner: Planner | None = None,
    ) -> None:
        self.cfg = cfg
        self.endpoint = cfg.endpoint
        self.producer_id = cfg.session.producer_id
        self._assembler = assembler
        self._slot_maps = slot_maps
        self._clock = clock
        self._on_tick = on_tick
        self.session = ProducerSession(cfg.session, clock(), offers_shm=slot_maps is not None, planner=planner)
        self._sent = 0
        self._shm_sent = 0
        self._build_s = 0.0
        self._send_s = 0.0
        self._socket_path = ipc_socket_path(cfg.endpoint)  # None: tcp (CURVE authenticates), nothing to check
        self._connected = True  # False: the loop connects before its first HELLO (``serve(connect=True)``)
        self._refusal_logged = ""  # the last refusal line logged at WARNING (repeats go to DEBUG)
        self._rows: list[int] | None = None  # learned rows the assembler and slot maps are shaped for
        self._plan: tuple[Bucket, ...] | None = None  # the learned plan they are shaped for

    def close(self) -> None:
        """Release what the assembler keeps between batches (open cache files). Idempotent."""
        close = getattr(self._assembler, "close", None)  # test fakes keep nothing
        if close is not None:
            close()

    @property
    def joined_epoch(self) -> int | None:
        """The consumer epoch we joined, or ``None`` while waiting for a consumer."""
        return self.session.joined_epoch

    @property
    def exit_code(self) -> int:
        return self.session.exit_code

    def stats(self) -> ProducerStats:
        c = self.session.counts
        return ProducerStats(self._sent, self._build_s, self._send_s, c.rejoins, dict(c.errors), self._shm_sent)

    def stage_counters(self) -> StageCounters:
        """Cumulative stage times for the heartbeat: read (preadv), assemble (rest of the build), send."""
        read_s = min(self._assembler.read_s_total, self._build_s)  # reads of a failed build are not counted
        return StageCounters(self._sent, read_s, self._build_s - read_s, self._send_s)

    def run(self, stop: threading.Event) -> int:
        """Run until ``stop`` is set or a fatal error. Returns the process exit code.

        Raises:
            Exception: whatever escaped the loop (a bug, an unexpected build error), after the BYE
                carrying exit code 1 and its one-line reason went out; ``melfeed.producer.process`` logs it
                and exits 1.
        """
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue into a pipe with no consumer behind it
        # No ROUTING_ID: the consumer's ROUTER assigns a fresh one per connection (docs/security.md "Identity").
        if self.cfg.curve is not None:
            self.cfg.curve.apply(sock)
        try:
            self.serve(sock, stop, connect=True)
        finally:
            if self.exit_code != 0:  # let the BYE that says why leave, for a bounded moment
                sock.setsockopt(zmq.LINGER, _BYE_LINGER_MS)
            sock.close()
            ctx.term()
        return self.exit_code

    def serve(self, sock: Dealer, stop: threading.Event, *, connect: bool = False) -> None:
        """The loop, then the BYE (with the exit code and reason when failing).

        ``connect``: ``sock`` is not connected yet; the loop connects it to the endpoint before the first
        HELLO that finds the socket file trusted. Otherwise ``sock`` is already connected.
        """
        self._connected = not connect
        try:
            self._loop(sock, stop)
        except Exception as err:  # reported to the consumer, then re-raised for the process's top level
            self.session.fail(1, err)
            raise
        finally:
            bye = self.session.farewell()
            if bye is not None:
                _try_send(sock, [encode(bye)])

    def _loop(self, sock: Dealer, stop: threading.Event) -> None:
        session = self.session
        while not stop.is_set() and session.exit_code == 0 and not session.finished:
            if self._on_tick is not None:
                self._on_tick(self)
            self._send_all(sock, self._connected_or_none(sock, session.on_turn(self._clock())))
            if sock.poll(math.ceil(session.poll_timeout_s(self._clock()) * 1000), zmq.POLLIN):  # never wake early
                self._drain_inbox(sock)
            order = session.next_build(self._clock())
            if order is not None:
                self._build_and_send(sock, order)
            hb = session.heartbeat(self._clock(), self.stage_counters())
            if hb is not None:
                _try_send(sock, [encode(hb)])

    def _send_all(self, sock: Dealer, msgs: list[Message]) -> None:
        for msg in msgs:
            _try_send(sock, [encode(msg)])

    def _drain_inbox(self, sock: Dealer) -> None:
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
            if isinstance(msg, Welcome) and not self._socket_trusted():  # every one: a repeat can name a new shm_dir
                continue  # a consumer we refuse: as if nobody had answered our HELLO
            self.session.on_message(msg, self._clock())

    def _connected_or_none(self, sock: Dealer, msgs: list[Message]) -> list[Message]:
        """``msgs`` to send once the DEALER is connected; before that, connect first if the socket file is trusted."""
        if self._connected or not msgs:
            return msgs
        if (self._socket_path is not None and not os.path.lexists(self._socket_path)) or not self._socket_trusted():
            # No consumer (to trust) yet: look again soon instead of letting the HELLO back-off grow to
            # transport.connect_backoff_max_s, so a consumer that binds later is joined at once. The session
            # still warns after 10 s of silence.
            self.session.hello_soon(self._clock())
            return []
        sock.connect(self.endpoint)
        self._connected = True
        self.session.hello_soon(self._clock())
        return msgs

    def _socket_trusted(self) -> bool:
        """True for tcp, or an ipc socket file of ours or root's; else one WARNING per distinct refusal."""
        problem = None if self._socket_path is None else socket_file_problem(self._socket_path)
        if problem is None:
            self._refusal_logged = ""
            return True
        line = f"refusing the consumer at {self._socket_path}: {problem}; waiting for a consumer to trust"
        if line != self._refusal_logged:
            log.warning("%s", line)
            self._refusal_logged = line
        else:
            log.debug("%s", line)
        return False

    def _use_learned_shapes(self) -> None:
        """Shape the send buffers and slot views for the joined consumer's plan or rows when they are new to us."""
        plan = self.session.buckets
        if plan is not None:
            if plan != self._plan:
                self._assembler.use_buckets(plan)
                if self._slot_maps is not None:
                    self._slot_maps.use_buckets(plan)
                self._plan = plan
            return
        rows = self.session.rows
        if rows is None or rows == self._rows:
            return
        self._assembler.use_rows(rows)
        if self._slot_maps is not None:
            self._slot_maps.use_rows(rows)
        self._rows = rows

    def _build_and_send(self, sock: Dealer, order: BuildOrder) -> None:
        lease = order.lease
        self._use_learned_shapes()  # before the first build of an epoch whose WELCOME gave rows or a plan
        t0 = time.perf_counter()
        target = None
        if order.shm_dir is not None:
            target = self._slot_views(order)
            if target is None:
                return
        try:
            batch = self._assembler.build(lease.batch_id, lease.bucket, lease.sample_ids, target)
        except TransientReadError as err:  # not the file's fault: exit 1, the supervisor restarts us
            log.error("cannot build batch %d (transient, restarting): %s", lease.batch_id, err)
            self.session.fail(1, err)
            return
        except CacheError as err:  # producer.bad_samples=fail; a restart would hit it again
            log.error("bad cache file in batch %d (producer.bad_samples=fail); stopping: %s", lease.batch_id, err)
            self.session.fail(EXIT_CONFIG, err)
            return
        if self.cfg.debug_delay_s:
            time.sleep(self.cfg.debug_delay_s)
        t1 = time.perf_counter()
        self._send_batch(sock, order, batch)
        self._build_s += t1 - t0
        self._send_s += time.perf_counter() - t1

    def _slot_views(self, order: BuildOrder) -> dict[str, npt.NDArray[np.generic]] | None:
        """Views of the order's slot file; on failure the session decides: skip it, or payload frames for good."""
        assert order.lease.shm is not None and order.shm_dir is not None  # BuildOrder sets both or neither
        if self._slot_maps is None:  # the session agreed shm only while we offered it
            raise RuntimeError("a shared-memory order without slot mappings")
        try:
            views = self._slot_maps.views(order.shm_dir, order.lease.shm, order.lease.bucket)
        except (OSError, ValueError, KeyError) as err:
            detail = getattr(err, "strerror", None) or str(err)
            if self.session.on_slot_error(order, getattr(err, "errno", None), detail, self._clock()):
                self._slot_maps.clear()
                self._slot_maps = None
            return None
        self.session.on_slot_mapped()
        return views

    def _send_batch(self, sock: Dealer, order: BuildOrder, batch: BuiltBatch) -> None:
        arrays = list(batch.arrays.values())  # layout order: ARRAY_KEYS, then the extras
        crc = None
        if order.checksum:
            crc = 0
            for a in arrays:
                crc = zlib.crc32(a.data.cast("B"), crc)
        shm = None if order.lease.shm is None else (order.lease.shm.slot, order.lease.shm.generation)
        header = BatchHeader(
            order.epoch,
            batch.batch_id,
            batch.bucket,
            [list(a.shape) for a in arrays],
            [a.dtype.name for a in arrays],
            crc,
            batch.quarantined,
            shm,
            batch.quarantine_note,
        )
        if shm is not None:  # built in the consumer's slot: the header is the message
            if _try_send(sock, [encode(header)]):
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


def _try_send(sock: Dealer, frames: list[bytes]) -> bool:
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
