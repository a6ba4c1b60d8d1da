"""Entry point of one producer process (spawned by ``producer.launcher``).

``python -m producer.main --config FILE --index N``: sets ``CUDA_VISIBLE_DEVICES`` to the data GPU
before anything could import a framework, loads the manifest, derives the bucket shapes (the
consumer checks them in HELLO) and runs ``ProducerWorker`` until SIGTERM.
Exit codes: 0 clean stop, 78 configuration/contract error (no restart), 1 unexpected error.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="producer.main")
    ap.add_argument("--config", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--debug-delay-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    multiprocessing.current_process().name = f"producer-{args.index}"

    from shared.config import load_config
    from shared.errors import EXIT_CONFIG, PipelineError
    from shared.lifecycle import die_with_parent, setup_logging, stop_on_signals
    setup_logging(os.environ.get("MELFEED_LOG_LEVEL", "INFO"))
    die_with_parent()
    try:
        cfg = load_config(args.config)
        # Before any framework import: producers see only the data GPU ("" = CPU only).
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.producer.data_gpu
        worker = _build_worker(cfg, args.index, args.debug_delay_ms / 1000.0)
    except PipelineError as err:
        print(f"producer-{args.index}: {err}", file=sys.stderr)
        return EXIT_CONFIG
    with stop_on_signals() as stop:
        try:
            code = worker.run(stop)
        except Exception:  # top level of the process: log and map to an exit code
            log.error("producer crashed", exc_info=True)
            return 1
    s = worker.stats()
    log.info("producer stopped batches=%d build_ms=%.2f send_ms=%.2f rejoins=%d", s.batches_sent,
             1000 * s.build_s_total / max(1, s.batches_sent), 1000 * s.send_s_total / max(1, s.batches_sent),
             s.rejoins)
    return code


def _build_worker(cfg, index: int, debug_delay_s: float):  # type: ignore[no-untyped-def]
    from producer.batcher import BatchAssembler
    from producer.source import CacheReader
    from producer.worker import ProducerWorker
    from shared.buckets import build_buckets
    from shared.errors import ConfigError
    from shared.lifecycle import resolve_endpoint
    from shared.manifest import load_manifest

    if cfg.cache_dir is None:
        raise ConfigError("is required for producers", path=("cache_dir",))
    manifest = load_manifest(cfg.cache_dir, cfg.n_mels)
    bucket_set = build_buckets(manifest.frames, manifest.token_counts, cfg.n_mels, cfg.buckets)
    assembler = BatchAssembler(CacheReader(manifest), bucket_set, max_buffers=cfg.transport.lease_window + 2,
                               bad_sample_policy=cfg.producer.bad_samples)
    t = cfg.transport
    return ProducerWorker(resolve_endpoint(cfg, os.environ), f"producer-{index}", assembler, bucket_set,
                          manifest.fingerprint, cfg.n_mels, cfg.seed, heartbeat_interval_s=t.heartbeat_interval_s,
                          liveness_s=t.liveness_s, backoff_max_s=t.connect_backoff_max_s,
                          debug_delay_s=debug_delay_s)


if __name__ == "__main__":
    sys.exit(main())
