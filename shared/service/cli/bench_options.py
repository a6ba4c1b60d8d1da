"""The options of ``melfeed bench``: which systems it measures, for how long, and where the result goes."""

from __future__ import annotations

import argparse
from typing import Any

from melfeed.shared.service.cli.options import config_help, path
from melfeed.shared.service.cli.parser import add_config_options, add_demo, add_log_level

__all__ = ["add_bench_options"]


def add_bench_options(p: argparse.ArgumentParser, g: dict[str, Any]) -> None:
    add_config_options(g["common"], "YAML config (buckets, seed, n_mels, transport settings apply)")
    add_log_level(g["common"])
    g["data"].add_argument(
        "--cache-dir",
        type=path,
        metavar="DIR",
        help=config_help("cache with mels/, tokens/ and manifest.json", "cache_dir"),
    )
    add_demo(g["data"], "generate (once) and use the built-in demo data")
    _systems(g["transport"])
    _duration(g["training"])
    o = g["observability"]
    o.add_argument(
        "--json",
        action="store_true",
        help="print every trial's raw numbers, the medians, ratios and goals as JSON to stdout (instead of the text)",
    )
    o.add_argument(
        "-o",
        "--output",
        type=path,
        metavar="FILE",
        help="also write every trial's raw numbers, the medians, ratios and goals as JSON to FILE (default: none)",
    )
    g["advanced"].add_argument(
        "--trial-timeout-s", type=float, default=300.0, help="kill a trial (and its helpers) after this"
    )


def _systems(t: Any) -> None:
    t.add_argument("--producer-counts", default="1,2", metavar="N,N", help="melfeed producer counts, comma-separated")
    t.add_argument(
        "--transports",
        default="zmq,shm,tcp",
        help="melfeed paths, comma-separated: zmq (payload frames over ipc), shm, tcp (payload frames over "
        "loopback tcp with CURVE; the first producer count, max rate only)",
    )
    t.add_argument("--tfdata-parallel", default="autotune,8,16", help="tuned tf.data num_parallel_calls variants")
    t.add_argument("--service-workers", type=int, default=1, help="tf.data service workers (0 = skip the service)")
    t.add_argument("--transport-only", action="store_true", help="only the transport GB/s section")
    t.add_argument("--no-transport", action="store_true", help="skip the transport GB/s section")
    t.add_argument(
        "--mel-dtypes",
        default="float32,float16",
        help="wire formats (transport.mel_dtype) of the transport section and the producer build probe; "
        "float16 rows are labelled -f16 and judged by no goal (--smoke: float32 only)",
    )


def _duration(r: Any) -> None:
    r.add_argument("--step-ms", default="5,20,50", help="modelled device time per step, comma-separated")
    r.add_argument("--rounds", type=int, default=3, help="rounds alternating the systems; medians over them")
    r.add_argument("--batches", type=int, default=300, help="measured batches per trial")
    r.add_argument("--warmup", type=int, default=10, help="batches before measuring, per trial")
    r.add_argument(
        "--efficiency-batches",
        type=int,
        default=None,
        help="measured batches of each feed-efficiency trial (reference model; default 100, 0 with "
        "--smoke; 0 = skip the section)",
    )
    r.add_argument("--efficiency-only", action="store_true", help="only the feed-efficiency section")
    r.add_argument(
        "--smoke",
        action="store_true",
        help="tiny structural run: 1 round, 5 ms step, 10 batches, 1 producer, tf.data at 8, float32 "
        "(replaces --rounds, --step-ms, --batches, --warmup, --producer-counts, --tfdata-parallel, "
        "--mel-dtypes, --demo-utterances); each section's trials run in turn in one trial process, so its "
        "figures are not comparable with a full run's",
    )
