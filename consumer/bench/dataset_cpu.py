"""Trainer CPU per batch of ``Consumer.as_dataset()`` against the plain ``batches()`` loop.

Role: ``python -m melfeed.consumer.bench.dataset_cpu --demo`` runs a real ``Consumer`` fed by a real
producer group (``melfeed producer``, child processes) twice on the same plan: once
iterating ``batches()`` (the receiver thread plus the loop: the floor), once iterating
``as_dataset()`` from Python (what a Keras ``fit`` pays per element before its step). Neither loop
reads the arrays (a step reads them inside its own program), so the difference is the hand-over
itself: the tf.data machinery and any copy it makes. Prints one JSON line with the
trainer's CPU ms per batch (``getrusage(RUSAGE_SELF)``; producers are children, not counted) for
both and their difference, measured after ``--warmup`` batches. docs/performance.md cites it.
Invariants: both loops see the same batches (same seed, same plan positions); TensorFlow is
imported before either window opens, so its import is in neither.
Shutdown: the producer group is stopped (SIGTERM ladder) in ``finally`` after each loop.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_from_mapping, with_overrides
from melfeed.shared.service.cli import OneLineParser

__all__ = ["main"]

log = logging.getLogger(__name__)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _numpy_loop(feed: Any) -> Iterator[None]:
    for _batch in feed.batches():
        yield None


def _dataset_loop(feed: Any) -> Iterator[None]:
    for _element in feed.as_dataset():
        yield None


def _measure(cfg: PipelineConfig, loop: Callable[[Any], Iterator[None]], warmup: int, batches: int) -> dict[str, float]:
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.producer_group import start_producers, stop_producers

    with Consumer(cfg) as feed:
        group = start_producers(with_overrides(cfg, {"transport.endpoint": feed._endpoint}))
        try:
            cpu0 = wall0 = 0.0
            done = 0
            for done, _ in enumerate(loop(feed), start=1):
                if done == warmup:
                    cpu0, wall0 = _cpu_s(), time.perf_counter()
            cpu_s, wall_s = _cpu_s() - cpu0, time.perf_counter() - wall0
        finally:
            stop_producers(group)
    measured = done - warmup
    if measured < batches:
        raise RuntimeError(f"only {done} of {warmup + batches} batches arrived")
    return {"cpu_ms_per_batch": 1000 * cpu_s / measured, "wall_ms_per_batch": 1000 * wall_s / measured}


def _config(args: argparse.Namespace) -> PipelineConfig:
    from melfeed.shared.cache.demo_data import default_demo_dir, write_demo_cache

    cache = Path(args.cache_dir) if args.cache_dir else default_demo_dir(args.demo_utterances)
    if args.demo:
        write_demo_cache(cache, n_utterances=args.demo_utterances, extras=True)
    return config_from_mapping(
        {
            "cache_dir": str(cache.resolve()),
            "producer": {"count": args.producers},
            "consumer": {"steps": args.warmup + args.batches, "wait_timeout_s": 0.5},
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m melfeed.consumer.bench.dataset_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", help="cache with mels/, tokens/ and manifest.json (default: the demo cache)")
    ap.add_argument("--demo", action="store_true", help="generate (once) the built-in demo cache")
    ap.add_argument("--demo-utterances", type=int, default=2000)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batches", type=int, default=200)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MELFEED_LOG_LEVEL", "WARNING"))
    cfg = _config(args)
    importlib.import_module("tensorflow")  # imported before either window opens
    numpy_loop = _measure(cfg, _numpy_loop, args.warmup, args.batches)
    dataset_loop = _measure(cfg, _dataset_loop, args.warmup, args.batches)
    out = {
        "batches": args.batches,
        "producers": args.producers,
        "batches_loop": numpy_loop,
        "as_dataset_loop": dataset_loop,
        "as_dataset_extra_cpu_ms_per_batch": dataset_loop["cpu_ms_per_batch"] - numpy_loop["cpu_ms_per_batch"],
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    from melfeed.shared.service.lean_tensorflow import quiet_tensorflow_import, skip_optional_imports_of_tensorflow

    skip_optional_imports_of_tensorflow()  # TensorFlow's import without JAX and matplotlib: 1-1.5 s of CPU less
    quiet_tensorflow_import()  # and without its C++ lines below TF_CPP_MIN_LOG_LEVEL
    sys.exit(main())
