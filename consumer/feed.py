"""The consumer as a library: fixed-shape numpy batches in plan order, or a ``tf.data.Dataset`` (usage:
consumer/README.md, "Using your own training loop").

Owns the ring, the lease book, the receiver thread and, with ``producers=N``, the producer group
(``consumer/producer_group.py``). Batches are handed out and applied strictly in plan order
(docs/design.md, invariant 3): ``b`` is applied only after ``b - 1`` (a ``Stager`` or a dataset's
read-ahead may hold a few handed out, not yet applied); one whose iterator was dropped before consuming it is
handed out again, first. ``consumer/handout.py`` keeps that book, consumer/README.md ("Exactly once on the
library path") states the rules. Shapes, schema and epoch length are properties available before ``start()``;
each ``Batch`` carries the ``PlannedBatch`` its lease was issued for. Memory bound (invariant 4): ring slots *
slot bytes here, plus Σ lease windows * largest batch in payload producers (``consumer/observe/startup.py``).
On an ipc:// endpoint the slots are shared-memory files (``consumer/transport/shm_slots.py``) unless
``transport.mode`` is ``zmq`` or the directory is too small. Shutdown: ``close()`` stops the owned producers,
the receiver and wakes any waiter; idempotent, final (then ``start()`` raises ``ClosedError``); every wait
bounded; misuse: ``consumer/guards.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.consumer.flow.credit import LeaseBook
from melfeed.consumer.producer_group import OwnedProducers
from melfeed.consumer.guards import check_config, check_failures, check_start_batch, check_started, check_timeout
from melfeed.consumer.observe.startup import log_bound
from melfeed.consumer.handout import ArraySpec, Batch, Handout
from melfeed.consumer.flow.plan import EpochPlan
from melfeed.consumer.flow.shards import plan_for_rank
from melfeed.consumer.flow.decisions import HandshakeContract, SessionConfig
from melfeed.consumer.transport.receiver import Receiver, ReceiverConfig, ReceiverStats
from melfeed.consumer.flow.ring import BatchRing, slot_nbytes_for
from melfeed.consumer.transport.shm_slots import ShmSlots, open_ring_files
from melfeed.shared.cache.features import load_manifest_for
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import PipelineConfig, check_transport_mode, resolve_checksum
from melfeed.shared.config.checks import check_ring_bytes, physical_memory_bytes
from melfeed.shared.errors import ClosedError, ConfigError
from melfeed.shared.service.lifecycle import resolve_endpoint
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from melfeed.shared.wire.curve import server_keys_for
from melfeed.shared.wire.schema import ExtraSpec

__all__ = ["Batch", "Consumer", "ArraySpec"]

log = logging.getLogger(__name__)

_WAITING_LOG_S = 10.0


class Consumer:
    """Receives leased batches from producers into a ring and hands them out in plan order.

    Args:
        cfg: the pipeline config (``cache_dir`` is required).
        start_batch: first batch id to apply (a resume position); ``consumer.steps`` stays the
            absolute end, so a resumed run stops where an uninterrupted one would.
        environ: where the default ipc endpoint's runtime directory is looked up.
        rank, world: this consumer's rank in a job of ``world`` (``shared/service/tf_config.py``): it
            leases and hands out only its share of the plan (``consumer/flow/shards.py``), whose ids
            are its steps; the default, rank 0 of 1, is the whole plan.
        producers: start this many producers at ``start()`` and stop them at ``close()``
            (``consumer/producer_group.py``); None = they are started elsewhere.
    """

    def __init__(self, cfg: PipelineConfig, *, start_batch: int = 0, environ: Mapping[str, str] | None = None,
                 rank: int = 0, world: int = 1, producers: int | None = None) -> None:
        if check_config(cfg).cache_dir is None:
            raise ConfigError("is required", path=("cache_dir",))
        self._owned = OwnedProducers(producers, cfg) if producers is not None else None
        start_batch = check_start_batch(start_batch)
        self.cfg = cfg
        self.manifest: Manifest = load_manifest_for(cfg, feeds_model=False)  # token ids unchecked: the model is yours
        self.bucket_set: BucketSet = build_buckets(self.manifest.frames, self.manifest.token_counts, cfg.n_mels,
                                                   cfg.buckets, self.manifest.schema, mel_dtype=cfg.transport.mel_dtype)
        check_ring_bytes(cfg.consumer.ring_slots, self.bucket_set.max_batch_nbytes(), physical_memory_bytes())
        self.rank, self.world = rank, world
        self.plan: EpochPlan = plan_for_rank(self.bucket_set, self.manifest.fingerprint, cfg.seed, rank, world,
                                                   cfg.buckets.partial)
        self.endpoint = resolve_endpoint(cfg, environ if environ is not None else os.environ)
        steps = cfg.consumer.steps          # the plan position to stop at: a resumed run keeps its end
        self.end_batch = max(start_batch, steps) if steps is not None else None
        self.next_apply = start_batch
        self.epoch = int.from_bytes(os.urandom(6), "big") | 1
        t = cfg.transport
        checksum = resolve_checksum(t.checksum, self.endpoint, t.insecure)
        self._book = LeaseBook(self.plan, start_batch, self.end_batch, t.lease_window, t.lease_timeout_s)
        check_transport_mode(cfg.transport.mode, self.endpoint)          # --endpoint may have made it tcp
        self.shm: ShmSlots | None = open_ring_files(cfg.transport, self.endpoint, cfg.consumer.ring_slots,
                                                    slot_nbytes_for(self.bucket_set.buckets), self.epoch)
        # a freed slot wakes the receiver, which leases it at once if a lease waits for one (one wake per release)
        self.ring = BatchRing(cfg.consumer.ring_slots, self.bucket_set.buckets,
                              on_release=lambda: self._receiver.slot_freed(), memory=self.shm)
        contract = HandshakeContract(self.manifest.fingerprint, self.bucket_set.as_wire(), cfg.n_mels, cfg.seed, t.mel_dtype)
        session = SessionConfig.from_transport(t, contract, self.epoch, checksum)
        receiving = ReceiverConfig(self.endpoint, session, curve=server_keys_for(t, self.endpoint),
                                   max_connections=t.max_connections, handshake_timeout_s=t.handshake_timeout_s)
        self._receiver = Receiver(receiving, self.ring, self._book, self.bucket_set, shm=self.shm)
        self.wait_s_total = 0.0
        self._handout = Handout(start_batch, owner=self.epoch)
        self._held: Batch | None = None     # applied, slot kept until the next element (as_dataset)
        self._started = self._closed = False
        self._lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the endpoint and start receiving. Idempotent; ``ClosedError`` after ``close()``."""
        if self._closed:                # binding again would leave the endpoint locked until the process exits
            raise ClosedError("this Consumer was closed")
        if self._started:
            return
        try:
            self._receiver.start()
            if self._owned is not None:         # after the bind: the producers find the endpoint
                self._owned.start(self, on_failure=self.ring.close)   # wakes a waiter: next_batch says why
        except BaseException:       # e.g. another consumer holds the endpoint: leave nothing behind
            self.close()
            raise
        self._started = True
        log_bound(log, self)

    def close(self) -> None:
        """Stop receiving and wake waiters. Idempotent, any thread: a second caller returns once it is closed."""
        with self._lock:                # else a loop woken by another thread's close() could leave its
            if self._closed:            # ``with`` while the endpoint is still bound
                return
            self._closed = True
            if self._owned is not None:   # first: a finished plan's group still hears ``done`` and leaves
                self._owned.stop(self)
            self.ring.close()
            self._receiver.stop()
            if self.shm is not None:
                self.shm.close()

    def __enter__(self) -> Consumer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what a training loop needs before start() ------------------------------------------------
    @property
    def bucket_shapes(self) -> tuple[dict[str, tuple[int, ...]], ...]:
        """Array shapes of each bucket (by bucket index): mel [B,T,M], mel_len [B], tokens [B,L], tok_len [B],
        then the cache's extras by name (``shared/wire/schema.py``)."""
        return tuple(b.shapes() for b in self.bucket_set.buckets)

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one pass over the dataset (every epoch of the plan has this many)."""
        return self.plan.batches_per_epoch

    @property
    def array_schema(self) -> tuple[ArraySpec, ...]:
        """Every array of a batch, in wire order: name, numpy dtype and its shape in each bucket."""
        dtypes = self.bucket_set.buckets[0].dtypes()   # every bucket has the same keys and dtypes
        return tuple(ArraySpec(k, dtype, tuple(s[k] for s in self.bucket_shapes)) for k, dtype in dtypes.items())

    @property
    def extras(self) -> tuple[ExtraSpec, ...]:
        """The cache's extra arrays (name, kind, dtype, trailing shape), in batch order; () for none."""
        return self.manifest.schema.extras

    @property
    def applied(self) -> int:
        """Batches applied so far by this process (consumer/README.md: what counts as applied)."""
        return self._handout.applied

    @property
    def applied_ids(self) -> list[int]:
        """The ids of the applied batches, in the order they were applied (consecutive from ``start_batch``)."""
        return self._handout.applied_ids

    # --- batches -------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """The plan's end was reached and nothing handed out waits to be handed out again."""
        return (self.end_batch is not None and self.next_apply >= self.end_batch
                and not self._handout.has_returned)

    def next_batch(self, timeout_s: float) -> Batch | None:
        """The next batch in plan order, or ``None`` if it did not arrive within ``timeout_s``.

        A batch given back (its iterator was dropped) comes first. The caller must ``release()`` it
        once its step has finished. ``timeout_s``: seconds, <= 0 = do not wait (``None``: TypeError).

        Raises:
            ClosedError: the consumer was closed, or the plan is finished.
            PipelineError: the receiver thread failed, or the owned producer group exited (its exit code).
            RuntimeError: ``start()`` was not called.
        """
        timeout_s = check_timeout(timeout_s)
        check_failures(self._receiver.error, self._owned)
        if self._closed:                # even a given-back batch: its slot file is gone
            raise ClosedError("this Consumer was closed")
        check_started(self._started)
        again = self._handout.pop_returned()
        if again is not None:
            return again
        if self.finished:
            raise ClosedError("all planned batches were applied")
        t0 = time.perf_counter()
        try:
            ready = self.ring.take(self.next_apply, timeout_s)
        except ClosedError:
            check_failures(self._receiver.error, self._owned)    # the receiver or the group's watcher closed it
            raise
        self.wait_s_total += time.perf_counter() - t0
        if ready is None:
            return None
        planned, utterances = ready.planned, self.manifest.utterances
        batch = Batch(planned, self.ring.views(ready.slot, planned.bucket), ready.slot, ready.copies,
                      tuple(utterances[i].id for i in planned.sample_ids), ready.quarantined, ready.quarantine_note,
                      owner=self.epoch)
        self.next_apply += 1
        return batch

    def release(self, batch: Batch) -> None:
        """The step that read ``batch`` has finished: count it applied and free its slot."""
        self.mark_applied(batch, wake=False)     # the release wakes the receiver if that helps
        self.free_slot(batch)

    def mark_applied(self, batch: Batch, wake: bool = True) -> None:
        """Count ``batch`` applied (the next id in plan order); its slot stays held. ``wake=False`` (``release``):
        no wake of its own, except for the plan's last batch (its ``done`` heartbeat should not wait)."""
        self._handout.record_applied(batch)
        last = self.end_batch is not None and batch.batch_id + 1 >= self.end_batch
        self._receiver.mark_applied(batch.batch_id, wake=wake or last)

    def free_slot(self, batch: Batch) -> None:
        """Give ``batch``'s slot back to the ring (its arrays are invalid from here on)."""
        self._handout.record_freed(batch)       # never twice: the slot may hold another batch by now
        self.ring.release(batch.slot)

    def apply_and_hold(self, batch: Batch) -> None:
        """Count ``batch`` applied and keep its slot until ``free_held_slot`` or a newer iterator starts."""
        with self._lock:
            self._apply_and_hold(batch)

    def _apply_and_hold(self, batch: Batch) -> None:
        self._free_held()
        self.mark_applied(batch)
        self._held = batch

    def free_held_slot(self, batch: Batch) -> None:
        """Free the slot ``apply_and_hold`` kept for ``batch``, unless a newer iterator already did."""
        with self._lock:
            if self._held is batch:
                self._free_held()

    def _free_held(self) -> None:
        if self._held is not None:
            self.free_slot(self._held)
            self._held = None

    def hold_read_ahead(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` handed ``batch`` to a read-ahead stage: held, not applied until consumed."""
        with self._lock:
            self._handout.hold(token, batch)

    def consume_read_ahead(self, token: int, batch_id: int, keep_slot: bool) -> None:
        """The caller of iterator ``token`` took batch ``batch_id`` out of the read-ahead stage: apply it.

        ``keep_slot``: the element still reads the slot (host stage), so it is freed at the next consumption or
        iterator; else (copied to a device) now. A superseded iterator's elements are handed out again.
        """
        with self._lock:
            batch = self._handout.first_held(token)
            if batch is None or batch.batch_id != batch_id:
                return
            if keep_slot:
                self._apply_and_hold(batch)
            else:
                self.mark_applied(batch)
                self.free_slot(batch)

    def begin_iterator(self) -> int:
        """Start a new hand-out iterator (superseding any older one); returns its token. The slot a superseded
        dataset iterator still holds is freed here: a ``fit`` that ended never reads it again (a Keras iterator
        may be collected late, and would otherwise keep a ring slot until then)."""
        with self._lock:
            self._free_held()
            return self._handout.begin()

    def is_current(self, token: int) -> bool:
        return self._handout.is_current(token)

    def hold(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` handed ``batch`` out, unapplied: if the iterator ends without it, it comes back."""
        self._handout.hold(token, batch)

    def give_back(self, token: int, batch: Batch) -> None:
        """Iterator ``token`` ends without applying ``batch`` (slot still held): handed out again, first."""
        self._handout.give_back(token, batch)

    def wait_next(self, token: int, stop: threading.Event | None = None,
                  on_wait: Callable[[int], None] | None = None) -> Batch | None:
        """The next batch for iterator ``token``, waiting in bounded steps; ``None`` when the plan ended, ``stop``
        was set or the consumer was closed. ``on_wait(producers_alive)`` runs after every bounded wait that brought no batch
        (``consumer.wait_timeout_s``): the loop is alive though starved (sd_notify watchdog, status).

        Raises:
            RuntimeError: a newer iterator superseded ``token``.
            PipelineError: the receiver thread failed, or the owned producer group exited.
        """
        waited_s = 0.0
        while not self.finished and not (stop is not None and stop.is_set()):
            if not self.is_current(token):
                raise RuntimeError("this iterator was superseded by a newer batches() / as_dataset() iterator")
            try:
                batch = self.next_batch(self.cfg.consumer.wait_timeout_s)
            except ClosedError:
                return None
            if batch is not None:
                return batch
            if on_wait is not None:
                on_wait(self._receiver.stats().producers_alive)
            waited_s += self.cfg.consumer.wait_timeout_s
            if waited_s >= _WAITING_LOG_S:
                log.info("waiting for batch %d: producers alive=%d", self.next_apply,
                         self._receiver.stats().producers_alive)
                waited_s = 0.0
        return None

    def batches(self, stop: threading.Event | None = None,
                on_wait: Callable[[int], None] | None = None) -> Iterator[Batch]:
        """Yield batches in plan order until the plan ends, ``stop`` is set or ``close()``.

        A batch is applied (and its slot freed) when the loop asks for the next one, or when the
        loop ends because the plan ended, ``stop`` was set or the consumer closed. A batch the loop
        holds when it breaks out (or the iterator is dropped, or a newer ``batches()`` /
        ``as_dataset()`` iterator starts) is not applied: the next iterator hands it out first.
        ``on_wait``: see ``wait_next``.
        """
        return self._iterate(self.begin_iterator(), stop, on_wait)

    def _iterate(self, token: int, stop: threading.Event | None,
                 on_wait: Callable[[int], None] | None) -> Iterator[Batch]:
        while True:
            batch = self.wait_next(token, stop, on_wait)
            if batch is None:
                return
            self.hold(token, batch)
            try:
                yield batch
            except BaseException:           # GeneratorExit (break, dropped) or an error thrown in
                self.give_back(token, batch)
                raise
            if not self.is_current(token):  # a newer iterator took this batch over: it is not applied
                raise RuntimeError("this iterator was superseded by a newer batches() / as_dataset() iterator")
            if not self._handout.is_applied(batch):      # the loop body may have called release(batch)
                self.mark_applied(batch, wake=False)
            if not batch.slot_freed:
                self.free_slot(batch)

    def as_dataset(self, single_shape: bool = False,
                   features: tuple[str, ...] = ("tokens", "tok_len", "mel_len", "frames"),
                   prefetch_device: str | None = "auto", token_axis: str = "bucket") -> Any:
        """A ``tf.data.Dataset`` of ``(features, mel)`` pairs for Keras ``fit`` (``consumer/dataset.py``).

        Zero copy unless ``single_shape`` pads; a batch is applied when the caller takes it, its slot
        freed at the next element. ``features``: any of ``melfeed.consumer.dataset.feature_keys(self)``;
        ``prefetch_device``: "auto" = one batch read ahead onto the model GPU when TensorFlow sees one,
        None = never, or a device name (consumer/README.md, "Exactly once on the library path");
        ``token_axis``: "bucket" (the bucket's width) or "longest" (cut to the batch's longest row).
        """
        from melfeed.consumer.dataset import make_dataset  # TensorFlow is imported only when asked for
        return make_dataset(self, single_shape, features, prefetch_device, token_axis)

    def slot_buffers(self) -> list[npt.NDArray[np.uint8]]:
        """Every ring slot's bytes by slot index (``Batch.slot``), 64-byte aligned uint8 arrays to pin or map once;
        a retired shared-memory slot gets new memory (consumer/README.md, "What a loop of your own can use")."""
        return [self.ring.memory.buffer(slot) for slot in range(self.ring.n_slots)]

    def zmq_context(self) -> Any:
        """The process's one ZeroMQ context (the receiver's), valid between ``start()`` and ``close()``."""
        return self._receiver.context

    def receiver_stats(self) -> ReceiverStats:
        return self._receiver.stats()

    def queue_depth(self) -> int:
        return self._receiver.queue_depth()

    @property
    def connections_cut(self) -> int:
        """Connections cut at ``transport.max_connections`` (docs/security.md "Hostile peers")."""
        return self._receiver.connections_cut

    def in_flight_bound_bytes(self, producers: int) -> int:
        """docs/design.md invariant 4: (ring slots + Σ lease windows) x largest batch."""
        return (self.ring.n_slots + producers * self.cfg.transport.lease_window) * self.bucket_set.max_batch_nbytes()
