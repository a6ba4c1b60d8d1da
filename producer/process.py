"""Entry point of one producer process (spawned by ``melfeed.producer.supervisor``).

``python -m melfeed.producer.process --config FILE --index N``: lowers its CPU priority to ``producer.nice``,
sets ``CUDA_VISIBLE_DEVICES`` to the data GPU (in PCI bus order, ``shared/gpu_select.py``) before anything could
import a
framework, loads the manifest, derives the bucket shapes (the
consumer checks them in HELLO; under ``buckets.batch_size: auto`` without ``buckets.rows`` each bucket's rows come
from the consumer's WELCOME; under ``buckets.cost: measured`` there are none until a WELCOME gives the weights, and
``producer/learned_plan.py`` plans them then) and runs ``ProducerWorker`` until SIGTERM (or, under
``producer.exit_at_plan_end``, until the consumer's plan ended).
Exit codes: 0 clean stop or plan ended, 78 configuration/contract error (no restart), 1 unexpected error.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from melfeed.producer.worker import ProducerWorker
    from melfeed.shared.config import PipelineConfig
    from melfeed.shared.service.sdnotify import Notifier

__all__ = ["main", "run_one"]

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    # A terminal's Ctrl-C reaches the whole group, this child too, while it still imports (a KeyboardInterrupt
    # traceback): the supervisor stops it with SIGTERM; ``run_one``'s handlers take over from here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ap = argparse.ArgumentParser(prog="melfeed.producer.process")
    ap.add_argument("--config", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--debug-delay-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    multiprocessing.current_process().name = f"producer-{args.index}"

    from melfeed.shared.config.loader import load_config
    from melfeed.shared.errors import EXIT_CONFIG, PipelineError
    from melfeed.shared.service.lifecycle import PARENT_PID_ENV, die_with_parent, setup_logging

    setup_logging(os.environ.get("MELFEED_LOG_LEVEL", "INFO"))
    parent = os.environ.get(PARENT_PID_ENV, "")
    die_with_parent(parent_pid=int(parent) if parent.isdigit() else None)  # the supervisor may already be gone
    try:
        cfg = load_config(args.config)
    except PipelineError as err:
        print(f"producer-{args.index}: {err}", file=sys.stderr)
        return EXIT_CONFIG
    return run_one(cfg, args.index, args.debug_delay_ms / 1000.0)


def run_one(cfg: PipelineConfig, index: int, debug_delay_s: float, notifier: Notifier | None = None) -> int:
    """One producer in this process until SIGTERM: the launcher's child, or a systemd instance.

    With a ``melfeed.shared.service.sdnotify.Notifier``: READY once built and connecting, STATUS on join/leave and
    every few seconds, WATCHDOG from the worker loop (which turns at least every heartbeat).
    """
    from melfeed.shared.errors import EXIT_CONFIG, PipelineError
    from melfeed.shared.gpu_select import gpu_env
    from melfeed.shared.service.lifecycle import stop_on_signals
    from melfeed.shared.service.priority import lower_cpu_priority
    from melfeed.shared.service.sdnotify import Notifier

    # First, in the main thread: the threads ZeroMQ starts later inherit it (shared/service/priority.py).
    lower_cpu_priority(cfg.producer.nice)
    notifier = notifier if notifier is not None else Notifier({})
    # Handlers first: a SIGTERM while the worker is built (or right after READY) is a clean stop
    # that says STOPPING, not a death by the default action that says nothing.
    with stop_on_signals() as stop:
        try:
            # Before any framework import: producers see only the data GPU ("" = CPU only).
            os.environ.update(gpu_env(cfg.producer.data_gpu))
            status = _Status(notifier)
            worker = _build_worker(cfg, index, debug_delay_s, status.tick)
        except PipelineError as err:
            print(f"producer-{index}: {err}", file=sys.stderr)
            notifier.notify(STATUS=f"configuration error: {err}", ERRNO=78)
            return EXIT_CONFIG
        notifier.ready(f"producer-{index}: connecting to {worker.endpoint}")
        try:
            code = worker.run(stop)
        except Exception:  # top level of the process: log and map to an exit code
            log.error("producer crashed", exc_info=True)
            return 1
        finally:
            notifier.stopping()
            worker.close()  # the kept cache descriptors
    s = worker.stats()
    log.info(
        "producer stopped batches=%d shm_batches=%d build_ms=%.2f send_ms=%.2f rejoins=%d",
        s.batches_sent,
        s.shm_batches,
        1000 * s.build_s_total / max(1, s.batches_sent),
        1000 * s.send_s_total / max(1, s.batches_sent),
        s.rejoins,
    )
    return code


class _Status:
    """Turns worker loop ticks into WATCHDOG pings and a STATUS line (on change or every 5 s)."""

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier
        self._last: tuple[int | None, int] | None = None
        self._next_s = 0.0

    def tick(self, worker: ProducerWorker) -> None:
        self._notifier.watchdog()
        if not self._notifier.enabled:
            return
        now = time.monotonic()
        epoch = worker.joined_epoch
        if self._last is not None and self._last[0] == epoch and now < self._next_s:
            return
        sent = worker.stats().batches_sent
        self._last, self._next_s = (epoch, sent), now + 5.0
        self._notifier.status(
            f"joined consumer epoch {epoch}; {sent} batches sent"
            if epoch is not None
            else f"waiting for a consumer at {worker.endpoint}; {sent} batches sent"
        )


def _build_worker(
    cfg: PipelineConfig, index: int, debug_delay_s: float, on_tick: Callable[[ProducerWorker], None] | None = None
) -> ProducerWorker:
    from melfeed.producer.batcher import BatchAssembler
    from melfeed.producer.learned_plan import CostPlanner
    from melfeed.producer.pack.reader import open_pack_reader
    from melfeed.producer.reader import CacheReader
    from melfeed.producer.session import ProducerSessionConfig
    from melfeed.producer.slot_maps import SlotMappings
    from melfeed.producer.worker import ProducerWorker, WorkerConfig
    from melfeed.shared.cache.features import load_manifest_for
    from melfeed.shared.config import check_transport_mode
    from melfeed.shared.errors import ConfigError
    from melfeed.shared.service.lifecycle import resolve_endpoint
    from melfeed.shared.wire.buckets import build_buckets, learns_costs, learns_rows, one_row_settings
    from melfeed.shared.wire.curve import client_keys_for

    if cfg.cache_dir is None:
        raise ConfigError("is required for producers", path=("cache_dir",))
    manifest = load_manifest_for(cfg, feeds_model=False)  # refuses a config whose features differ from the cache
    learns = learns_rows(cfg.buckets)  # auto without rows: the shapes now, each bucket's rows from the WELCOME
    # measured costs: no shapes until a WELCOME gives the weights (the session plans them with ``planner`` then)
    planner = (
        CostPlanner(
            manifest.frames,
            manifest.token_counts,
            cfg.n_mels,
            cfg.buckets,
            manifest.schema,
            mel_dtype=cfg.transport.mel_dtype,
        )
        if learns_costs(cfg.buckets)
        else None
    )
    bucket_set = (
        build_buckets(
            manifest.frames,
            manifest.token_counts,
            cfg.n_mels,
            one_row_settings(cfg.buckets) if learns else cfg.buckets,
            manifest.schema,
            mel_dtype=cfg.transport.mel_dtype,
        )
        if planner is None
        else None
    )
    reader = CacheReader(manifest, open_files=cfg.producer.open_files, mel_dtype=cfg.transport.mel_dtype)
    fault_dir = _fault_dir()
    pack = open_pack_reader(
        manifest, cfg.producer.pack, cfg.transport.mel_dtype, fault_dir=fault_dir, mapped=fault_dir is not None
    )
    assembler = BatchAssembler(
        reader,
        bucket_set,
        max_buffers=cfg.transport.lease_window + 2,
        bad_sample_policy=cfg.producer.bad_samples,
        pack=pack,
    )
    t = cfg.transport
    endpoint = resolve_endpoint(cfg, os.environ)
    curve = client_keys_for(t, endpoint)
    name = curve.name if curve is not None else "producer"  # a CURVE key named N may only speak as N-<index>
    check_transport_mode(t.mode, endpoint)  # --endpoint may have made it tcp
    # Same-host ipc and mode auto/shm: offer to build in the consumer's slot files (it may decline).
    slot_maps = (
        SlotMappings(bucket_set, 2 * cfg.consumer.ring_slots, shm_dir=t.shm_dir, endpoint=endpoint)
        if endpoint.startswith("ipc://") and t.mode != "zmq"
        else None
    )
    session = ProducerSessionConfig(
        f"{name}-{index}",
        endpoint,
        manifest.fingerprint,
        bucket_set.as_wire(learn_rows=learns) if bucket_set is not None else [],
        cfg.n_mels,
        cfg.seed,
        heartbeat_interval_s=t.heartbeat_interval_s,
        liveness_s=t.liveness_s,
        backoff_max_s=t.connect_backoff_max_s,
        exit_at_plan_end=cfg.producer.exit_at_plan_end,
        mel_dtype=t.mel_dtype,
        max_rows=cfg.buckets.max_batch_size,
    )
    return ProducerWorker(
        WorkerConfig(endpoint, session, debug_delay_s, curve), assembler, slot_maps, on_tick=on_tick, planner=planner
    )


def _fault_dir() -> Path | None:
    """Where a mapped pack's fault record goes (the private runtime dir, producer/pack/mapped.py), or None:
    without one the pack is read with ``preadv`` (a bus error must not become a restart loop)."""
    from melfeed.shared.config import resolve_runtime_dir
    from melfeed.shared.errors import ConfigError
    from melfeed.shared.service.lifecycle import prepare_runtime_dir

    try:
        return prepare_runtime_dir(resolve_runtime_dir(os.environ))
    except ConfigError as err:
        log.warning(
            "no private runtime directory for a mapped pack's fault record (%s): a pack is read with preadv", err
        )
        return None


if __name__ == "__main__":
    sys.exit(main())
