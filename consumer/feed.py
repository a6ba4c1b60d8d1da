"""The consumer as a library: fixed-shape numpy batches in plan order, or a ``tf.data.Dataset`` (usage:
docs/guide/your-model.md "A loop of your own").

Owns the ring, the lease book, the receiver thread, the hand-out desk and, with ``producers=N``, the producer
group (``consumer/producer_group.py``). Batches are handed out and applied strictly in plan order
(docs/design.md, invariant 3): ``b`` is applied only after ``b - 1`` (a ``Stager`` or a dataset's
read-ahead may hold a few handed out, not yet applied); one whose iterator was dropped before consuming it is
handed out again, first. ``consumer/handout.py``'s ``HandoutDesk`` keeps that protocol (``Stager`` and
``as_dataset()`` talk to it as ``Consumer._desk``), docs/guide/your-model.md ("A loop of your own")
states the rules. Shapes, schema and epoch length are properties available before ``start()``; each ``Batch``
carries the ``PlannedBatch`` its lease was issued for. Memory bound (invariant 4): ring slots * slot bytes
here, plus Σ lease windows * largest batch in payload producers, logged by ``start()``.
The public names are the library's (tests/unit/consumer/test_consumer_surface.py pins them); the built-in loop,
the app, bench, doctor and the clients read the private attributes (``_cfg``, ``_ring``, ``_bucket_set``,
``_endpoint``, ``_shm``, ``_run_id``, ``_desk``, ``_receiver``...).
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
from melfeed.consumer.flow.decisions import HandshakeContract, ReceiverSessionConfig
from melfeed.consumer.flow.plan import EpochPlan
from melfeed.consumer.flow.ring import BatchRing, slot_nbytes_for
from melfeed.consumer.flow.shards import plan_for_rank
from melfeed.consumer.guards import check_config, check_failures, check_start_batch, check_started, check_timeout
from melfeed.consumer.handout import ArraySpec, Batch, HandoutDesk, HandoutPorts
from melfeed.consumer.producer_group import OwnedProducers
from melfeed.consumer.transport.receiver import Receiver, ReceiverConfig, ReceiverStats
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

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        start_batch: int = 0,
        environ: Mapping[str, str] | None = None,
        rank: int = 0,
        world: int = 1,
        producers: int | None = None,
    ) -> None:
        if check_config(cfg).cache_dir is None:
            raise ConfigError("is required", path=("cache_dir",))
        self._owned = OwnedProducers(producers, cfg) if producers is not None else None
        start_batch = check_start_batch(start_batch)
        self._cfg = cfg
        self._manifest: Manifest = load_manifest_for(cfg, feeds_model=False)  # token ids unchecked: the model is yours
        self._bucket_set: BucketSet = build_buckets(
            self._manifest.frames,
            self._manifest.token_counts,
            cfg.n_mels,
            cfg.buckets,
            self._manifest.schema,
            mel_dtype=cfg.transport.mel_dtype,
        )
        check_ring_bytes(cfg.consumer.ring_slots, self._bucket_set.max_batch_nbytes(), physical_memory_bytes())
        self._rank, self._world = rank, world
        self._plan: EpochPlan = plan_for_rank(
            self._bucket_set, self._manifest.fingerprint, cfg.seed, rank, world, cfg.buckets.partial
        )
        self._endpoint = resolve_endpoint(cfg, environ if environ is not None else os.environ)
        steps = cfg.consumer.steps  # the plan position to stop at: a resumed run keeps its end
        end_batch = max(start_batch, steps) if steps is not None else None
        self._run_id = int.from_bytes(os.urandom(6), "big") | 1  # this start's id on the wire and in slot files
        t = cfg.transport
        checksum = resolve_checksum(t.checksum, self._endpoint, t.insecure)
        book = LeaseBook(self._plan, start_batch, end_batch, t.lease_window, t.lease_timeout_s)
        check_transport_mode(cfg.transport.mode, self._endpoint)  # --endpoint may have made it tcp
        self._shm: ShmSlots | None = open_ring_files(
            cfg.transport,
            self._endpoint,
            cfg.consumer.ring_slots,
            slot_nbytes_for(self._bucket_set.buckets),
            self._run_id,
        )
        # a freed slot wakes the receiver, which leases it at once if a lease waits for one (one wake per release)
        self._ring = BatchRing(
            cfg.consumer.ring_slots,
            self._bucket_set.buckets,
            on_release=lambda: self._receiver.slot_freed(),
            memory=self._shm,
        )
        contract = HandshakeContract(
            self._manifest.fingerprint,
            self._bucket_set.as_wire(),
            cfg.n_mels,
            cfg.seed,
            t.mel_dtype,
            (cfg.buckets.token_cost, cfg.buckets.attention_cost),
        )
        session = ReceiverSessionConfig.from_transport(t, contract, self._run_id, checksum)
        receiving = ReceiverConfig(
            self._endpoint,
            session,
            curve=server_keys_for(t, self._endpoint),
            max_connections=t.max_connections,
            handshake_timeout_s=t.handshake_timeout_s,
        )
        self._receiver = Receiver(receiving, self._ring, book, self._bucket_set, shm=self._shm)
        self._wait_s_total = 0.0
        # late-bound: a wrapper put on the ring's release after construction sees every release
        ports = HandoutPorts(
            self._check_usable,
            self._take,
            lambda slot: self._ring.release(slot),
            lambda batch_id, wake: self._receiver.mark_applied(batch_id, wake),
            lambda: self._receiver.stats().producers_alive,
            cfg.consumer.wait_timeout_s,
        )
        self._desk = HandoutDesk(start_batch, end_batch, self._run_id, ports)
        self._started = self._closed = False
        self._lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the endpoint and start receiving. Idempotent; ``ClosedError`` after ``close()``."""
        if self._closed:  # binding again would leave the endpoint locked until the process exits
            raise ClosedError("this Consumer was closed")
        if self._started:
            return
        try:
            self._receiver.start()
            if self._owned is not None:  # after the bind: the producers find the endpoint
                self._owned.start(self, on_failure=self._ring.close)  # wakes a waiter: next_batch says why
        except BaseException:  # e.g. another consumer holds the endpoint: leave nothing behind
            self.close()
            raise
        self._started = True
        self._log_bound()

    def _log_bound(self) -> None:
        """The INFO lines of a bound consumer (invariant 4: the memory bound is computed and logged at start)."""
        largest = self._bucket_set.max_batch_nbytes()
        ring, window = self._ring, self._cfg.transport.lease_window
        log.info(
            "consumer bound %s epoch=%d buckets=%s padding_efficiency=%.3f",
            self._endpoint,
            self._run_id,
            [b.as_wire() for b in self._bucket_set.buckets],
            self._bucket_set.padding_efficiency(),
        )
        if self._plan.samples_dropped_per_epoch:
            log.info(
                "buckets.partial drop: %d samples of each epoch left out (partial batches); %d batches per epoch",
                self._plan.samples_dropped_per_epoch,
                self._plan.batches_per_epoch,
            )
        if self._shm is not None:
            log.info(
                "in-flight memory bound: ring %d slots x %.1f MB in shared-memory files in %s; producers on "
                "this path hold no send buffers (payload producers: lease window %d x %.1f MB each)",
                ring.n_slots,
                ring.slot_nbytes / 1e6,
                self._shm.directory,
                window,
                largest / 1e6,
            )
        else:
            log.info(
                "in-flight memory bound: ring %d slots x %.1f MB + lease window %d x %.1f MB per producer",
                ring.n_slots,
                ring.slot_nbytes / 1e6,
                window,
                largest / 1e6,
            )

    def close(self) -> None:
        """Stop receiving and wake waiters. Idempotent, any thread: a second caller returns once it is closed."""
        with self._lock:  # else a loop woken by another thread's close() could leave its
            if self._closed:  # ``with`` while the endpoint is still bound
                return
            self._closed = True
            if self._owned is not None:  # first: a finished plan's group still hears ``done`` and leaves
                self._owned.stop(self)
            self._ring.close()
            self._receiver.stop()
            if self._shm is not None:
                self._shm.close()

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
        return tuple(b.shapes() for b in self._bucket_set.buckets)

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one pass over the dataset (every epoch of the plan has this many)."""
        return self._plan.batches_per_epoch

    @property
    def array_schema(self) -> tuple[ArraySpec, ...]:
        """Every array of a batch, in wire order: name, numpy dtype and its shape in each bucket."""
        dtypes = self._bucket_set.buckets[0].dtypes()  # every bucket has the same keys and dtypes
        return tuple(ArraySpec(k, dtype, tuple(s[k] for s in self.bucket_shapes)) for k, dtype in dtypes.items())

    @property
    def extras(self) -> tuple[ExtraSpec, ...]:
        """The cache's extra arrays (name, kind, dtype, trailing shape), in batch order; () for none."""
        return self._manifest.schema.extras

    @property
    def plan(self) -> EpochPlan:
        """The plan this consumer hands out (its rank's share): ``plan.batch(id)`` is batch ``id``'s identity."""
        return self._plan

    @property
    def manifest(self) -> Manifest:
        """The cache's manifest (``manifest.token_range``: the smallest and largest token id, for a vocabulary)."""
        return self._manifest

    @property
    def applied(self) -> int:
        """Batches applied so far by this process (consumer/README.md: what counts as applied)."""
        return self._desk.applied

    @property
    def applied_ids(self) -> list[int]:
        """The ids of the applied batches, in the order they were applied (consecutive from ``start_batch``)."""
        return self._desk.applied_ids

    # --- batches -------------------------------------------------------------------------------
    def next_batch(self, timeout_s: float) -> Batch | None:
        """The next batch in plan order, or ``None`` if it did not arrive within ``timeout_s``.

        A batch given back (its iterator was dropped) comes first. The caller must ``release()`` it
        once its step has finished. ``timeout_s``: seconds, <= 0 = do not wait (``None``: TypeError).

        Raises:
            ClosedError: the consumer was closed, or the plan is finished.
            PipelineError: the receiver thread failed, or the owned producer group exited (its exit code).
            RuntimeError: ``start()`` was not called.
        """
        return self._desk.next_batch(check_timeout(timeout_s))

    def release(self, batch: Batch) -> None:
        """The step that read ``batch`` has finished: count it applied and free its slot."""
        self._desk.release(batch)

    def batches(
        self, stop: threading.Event | None = None, on_wait: Callable[[int], None] | None = None
    ) -> Iterator[Batch]:
        """Yield batches in plan order until the plan ends, ``stop`` is set or ``close()``.

        A batch is applied (and its slot freed) when the loop asks for the next one, or when the
        loop ends because the plan ended, ``stop`` was set or the consumer closed. A batch the loop
        holds when it breaks out (or the iterator is dropped, or a newer ``batches()`` /
        ``as_dataset()`` iterator starts) is not applied: the next iterator hands it out first.
        ``on_wait(producers_alive)`` runs after every bounded wait (``consumer.wait_timeout_s``) that brought no
        batch: the loop is alive though starved (sd_notify watchdog, status).
        """
        return self._desk.iterate(stop, on_wait)

    def as_dataset(
        self,
        single_shape: bool = False,
        features: tuple[str, ...] = ("tokens", "tok_len", "mel_len", "frames"),
        prefetch_device: str | None = "auto",
        token_axis: str = "bucket",
    ) -> Any:
        """A ``tf.data.Dataset`` of ``(features, mel)`` pairs for Keras ``fit`` (``consumer/dataset.py``).

        Zero copy unless ``single_shape`` pads; a batch is applied when the caller takes it, its slot
        freed at the next element. ``features``: any of ``melfeed.consumer.dataset.feature_keys(self)``;
        ``prefetch_device``: "auto" = one batch read ahead onto the model GPU when TensorFlow sees one,
        None = never, or a device name (docs/guide/your-model.md "A loop of your own");
        ``token_axis``: "bucket" (the bucket's width) or "longest" (cut to the batch's longest row).
        """
        from melfeed.consumer.dataset import make_dataset  # TensorFlow is imported only when asked for

        return make_dataset(self, single_shape, features, prefetch_device, token_axis)

    def slot_buffers(self) -> list[npt.NDArray[np.uint8]]:
        """Every ring slot's bytes by slot index (``Batch.slot``), 64-byte aligned uint8 arrays to pin or map once;
        a retired shared-memory slot gets new memory (docs/guide/your-model.md "A loop of your own")."""
        return [self._ring.memory.buffer(slot) for slot in range(self._ring.n_slots)]

    # --- the desk's ports ---------------------------------------------------------------------
    def _check_usable(self) -> None:
        check_failures(self._receiver.error, self._owned)
        if self._closed:  # even a given-back batch: its slot file is gone
            raise ClosedError("this Consumer was closed")
        check_started(self._started)

    def _take(self, batch_id: int, timeout_s: float) -> Batch | None:
        """Batch ``batch_id`` from the ring, as a ``Batch`` over its slot; None if it did not arrive in time."""
        t0 = time.perf_counter()
        try:
            ready = self._ring.take(batch_id, timeout_s)
        except ClosedError:
            check_failures(self._receiver.error, self._owned)  # the receiver or the group's watcher closed it
            raise
        self._wait_s_total += time.perf_counter() - t0
        if ready is None:
            return None
        planned, utterances = ready.planned, self._manifest.utterances
        return Batch(
            planned,
            self._ring.views(ready.slot, planned.bucket),
            ready.slot,
            ready.copies,
            tuple(utterances[i].id for i in planned.sample_ids),
            ready.quarantined,
            ready.quarantine_note,
            owner=self._run_id,
        )

    # --- what the built-in loop, the app, bench and doctor read ---------------------------------
    def _in_flight_bound_bytes(self, producers: int) -> int:
        """docs/design.md invariant 4: (ring slots + Σ lease windows) x largest batch."""
        return (self._ring.n_slots + producers * self._cfg.transport.lease_window) * self._bucket_set.max_batch_nbytes()

    def _telemetry_source(self) -> _TelemetrySource:
        """What ``Telemetry`` reads of this consumer (consumer/observe/telemetry.py)."""
        return _TelemetrySource(self._receiver, self._rank, self._world)


class _TelemetrySource:
    """A consumer's figures as ``Telemetry`` reads them: receiver stats, the ZeroMQ context, the rank."""

    def __init__(self, receiver: Receiver, rank: int, world: int) -> None:
        self._receiver = receiver
        self.rank, self.world = rank, world

    def receiver_stats(self) -> ReceiverStats:
        return self._receiver.stats()

    def zmq_context(self) -> Any:
        """The process's one ZeroMQ context (the receiver's), valid between ``start()`` and ``close()``."""
        return self._receiver.context

    @property
    def connections_cut(self) -> int:
        """Connections cut at ``transport.max_connections`` (docs/security.md "Hostile peers")."""
        return self._receiver.connections_cut
