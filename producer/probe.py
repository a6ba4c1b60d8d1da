"""Stage 1 of ``melfeed doctor``: cache read + batch assembly in this one process.

``python -m melfeed.producer.probe --config FILE --seconds S [--debug-delay-ms D] [--start-at T] [--seed N] [--warm]``
builds representative batches (``melfeed.shared.wire.bucket_mix``: the epoch's bucket proportions) with the real
``BatchAssembler`` and ``CacheReader`` (and the packed cache, as ``producer.pack`` selects) for S seconds
and prints ONE JSON object on stdout:
``{"batches", "elapsed_s", "batches_per_s", "build_ms_p50", "build_ms_p99", "read_ms_p50",
"cpu_ms_per_batch", "reader", "pack_read"}`` (``reader``: the pack's path, or ``"files"``; ``pack_read``: how
the pack was read, ``"mapped"`` or ``"preadv"``, or null). Build time includes the
debug delay (as the producer worker's does); the read part is the assembler's own read-loop clock
(``BatchAssembler.read_s_total``), so the probe adds no per-row work of its own. Nothing is sent.
``--warm`` first builds every batch of the plan once, untimed, so the figures are a long-running
producer's (cache files already open, values already checked) rather than its first epoch's.
``--start-at`` (a ``time.time()`` value) lines up N probes started together, so they contend as N
producers would. Exit codes: 0 measured, 78 configuration/cache error (one line on stderr).
Shutdown: nothing outlives the process; buffers are freed on exit. Started by ``doctor`` or ``bench``
(``MELFEED_PARENT_PID``), it gets SIGTERM when that parent dies, even by SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]

_MIN_BATCHES = 3  # a p50 of fewer builds says nothing
_MAX_BATCHES = 100_000  # bounds memory of the timing lists on very fast caches
_MAX_START_WAIT_S = 10.0  # --start-at further away than this is a caller bug; cap the sleep


def _p(values: list[float], q: float) -> float:
    from melfeed.shared.metrics import percentile

    return percentile(sorted(values), q)


def measure(
    config_path: str, seconds: float, debug_delay_s: float, start_at: float | None, seed: int, warm: bool = False
) -> dict[str, float | str | None]:
    """Build batches for ``seconds`` (at least ``_MIN_BATCHES``) and return the figures."""
    from melfeed.producer.batcher import BatchAssembler
    from melfeed.producer.pack.reader import open_pack_reader
    from melfeed.producer.reader import CacheReader
    from melfeed.shared.cache.features import load_manifest_for
    from melfeed.shared.config.loader import load_config
    from melfeed.shared.errors import ConfigError
    from melfeed.shared.wire.bucket_mix import representative_batches
    from melfeed.shared.wire.buckets import build_buckets

    cfg = load_config(config_path)
    if cfg.cache_dir is None:
        raise ConfigError("is required", path=("cache_dir",))
    manifest = load_manifest_for(cfg, feeds_model=False)
    bucket_set = build_buckets(
        manifest.frames,
        manifest.token_counts,
        cfg.n_mels,
        cfg.buckets,
        manifest.schema,
        mel_dtype=cfg.transport.mel_dtype,
    )
    reader = CacheReader(manifest, open_files=cfg.producer.open_files, mel_dtype=cfg.transport.mel_dtype)
    pack = open_pack_reader(manifest, cfg.producer.pack, cfg.transport.mel_dtype)
    assembler = BatchAssembler(reader, bucket_set, max_buffers=2, bad_sample_policy=cfg.producer.bad_samples, pack=pack)
    plan = representative_batches(bucket_set, 256, seed)
    read_ids: set[int] = set()
    bad_ids: set[int] = set()  # quarantined rows: a bad file is not read, so it would flatter the rate
    bad_note = ""

    def build(batch_id: int, bucket: int, sample_ids: list[int]) -> None:
        nonlocal bad_note
        built = assembler.build(batch_id, bucket, sample_ids)
        read_ids.update(sample_ids)
        bad_ids.update(built.quarantined)
        bad_note = bad_note or built.quarantine_note

    if warm:
        for i, (bucket, sample_ids) in enumerate(plan):
            build(i, bucket, sample_ids)
    if start_at is not None:
        time.sleep(min(max(0.0, start_at - time.time()), _MAX_START_WAIT_S))
    build_ms: list[float] = []
    read_ms: list[float] = []
    cpu0, t_start = time.process_time(), time.perf_counter()
    while len(build_ms) < _MAX_BATCHES and (len(build_ms) < _MIN_BATCHES or time.perf_counter() - t_start < seconds):
        bucket, sample_ids = plan[len(build_ms) % len(plan)]
        read0, t0 = assembler.read_s_total, time.perf_counter()
        build(len(build_ms), bucket, sample_ids)
        if debug_delay_s:
            time.sleep(debug_delay_s)
        build_ms.append(1000 * (time.perf_counter() - t0))
        read_ms.append(1000 * (assembler.read_s_total - read0))
    elapsed_s = time.perf_counter() - t_start
    n = len(build_ms)
    return {
        "batches": n,
        "elapsed_s": elapsed_s,
        "batches_per_s": n / elapsed_s,
        "build_ms_p50": _p(build_ms, 50),
        "build_ms_p99": _p(build_ms, 99),
        "read_ms_p50": _p(read_ms, 50),
        "cpu_ms_per_batch": 1000 * (time.process_time() - cpu0) / n,
        "reader": str(pack.path) if pack is not None else "files",
        "pack_read": pack.mode if pack is not None else None,
        "rows_read": len(read_ids),
        "rows_quarantined": len(bad_ids),
        "quarantine_note": bad_note,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="melfeed.producer.probe")
    ap.add_argument("--config", required=True)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--debug-delay-ms", type=float, default=0.0)
    ap.add_argument("--start-at", type=float, help="time.time() at which to start building")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm", action="store_true", help="build every plan batch once, untimed, first")
    args = ap.parse_args(argv)

    import os

    from melfeed.shared.errors import EXIT_CONFIG, PipelineError
    from melfeed.shared.service.lifecycle import die_with_named_parent, setup_logging

    die_with_named_parent()  # started by doctor or bench: ends with it, even when it is SIGKILLed
    setup_logging(os.environ.get("MELFEED_LOG_LEVEL", "WARNING"))
    try:
        result = measure(args.config, args.seconds, args.debug_delay_ms / 1000.0, args.start_at, args.seed, args.warm)
    except PipelineError as err:
        print(f"melfeed.producer.probe: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
