"""The ``melfeed`` commands that are tools around the pipeline: measure, build and check a cache, deploy, report.

One spelling per concept on every command: the cache directory is ``--cache-dir``; ``--json`` prints the
machine-readable result to stdout and ``-o/--output FILE`` writes it to a file.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from melfeed.shared.service.cli.options import config_help, groups, path, schema_default
from melfeed.shared.service.cli.parser import add_config_options, add_debug_delay, add_demo, add_log_level
from melfeed.shared.service.units import DEPLOY_DIR

__all__ = ["add_tool_commands"]

_USAGE = "%(prog)s [options]"  # many options, listed by group below


def _command(
    sub: Any, name: str, about: str, exits: str, listed: str = "", usage: str | None = None
) -> argparse.ArgumentParser:
    """A command whose ``--help`` opens with what it does and its exit codes; the command list shows ``about``
    (and ``listed``, the exit worth knowing there)."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=about + listed, description=f"{about}; {exits}", usage=usage
    )
    return parser


def add_tool_commands(sub: Any) -> None:
    _doctor(
        _command(
            sub,
            "doctor",
            "measure every stage, name the bottleneck",
            "exit 0 supply >= 1.2 x demand, 3 the data side is the bottleneck, 1 a probe failed, 78 "
            "configuration error, 128 + signal when SIGTERM/SIGINT stopped it (its probes stopped, no report)",
            "; exit 0 only if supply keeps up",
            usage=_USAGE,
        )
    )
    _index(
        _command(
            sub,
            "index",
            "build CACHE_DIR/manifest.json from the .npy headers and token ids",
            "their range recorded; exit 0 written, 1 bad files (not written without --skip-bad), 78 cache "
            "directory unusable",
        )
    )
    _prepare(
        _command(
            sub,
            "prepare",
            "build a mel cache from an LJSpeech-format corpus (resumable)",
            "exit 0 complete (skips reported), 1 bad output files (manifest not written), 130 / 143 "
            "interrupted by SIGINT / SIGTERM (run it again to resume), 78 configuration error",
        )
    )
    _verify(
        _command(
            sub,
            "verify-cache",
            "check every cache file (header, size, values)",
            "exit 0 nothing bad, 1 a bad file, 78 the directory or a flag unusable",
            "; exit 1 if any is bad",
        )
    )
    _pack(
        _command(
            sub,
            "pack",
            "write CACHE_DIR/melfeed-<mel_dtype>.pack: the cache's data in one file, checked "
            "once (producers copy rows out of it)",
            "exit 0 written, 1 bad files (not written without --skip-bad), 78 cache unreadable",
        )
    )
    _audit(
        _command(
            sub,
            "audit",
            "compare the applied-batch logs of STATE_DIR (one per rank of a job) with the plan",
            "exit 0 exact, 1 not exact, 78 a state directory or flag unusable",
            "; exit 1 if not exact",
        )
    )
    _deploy(
        _command(
            sub,
            "deploy",
            "render the systemd units (consumer, producer@N, pipeline.target)",
            "exit 0 written, 78 a bad flag, config or target directory (nothing written)",
        )
    )
    _keys(
        _command(
            sub,
            "keys",
            "generate CURVE key pairs (consumer + one per producer name) into DIR",
            "exit 0 written, 78 a bad name or DIR",
        )
    )
    _report(
        _command(
            sub,
            "report",
            "draw a run's metrics JSONL (--metrics-file) as a PNG timeline",
            "exit 0 written, 78 a bad metrics file or output, or no matplotlib (the report extra)",
        )
    )
    _status(
        _command(
            sub,
            "status",
            "print a running consumer's live figures",
            "exit 0 printed, 1 no consumer answered or the answer is no snapshot, 78 a bad flag or config",
            " (exit 1 if none answers)",
        )
    )
    _bench(
        _command(
            sub,
            "bench",
            "melfeed vs tuned tf.data, the naive loader and tf.data service",
            "exit 0 every trial ran (a FAILed goal is a result), 1 a trial failed, 78 bad flag or cache, 128 + "
            "signal when SIGTERM/SIGINT stopped it (its trials stopped, no report)",
            usage=_USAGE,
        )
    )
    _demo_data(
        _command(
            sub,
            "demo-data",
            "write the deterministic demo cache into --cache-dir",
            "exit 0 written, 78 a bad flag or directory",
        )
    )
    _config(
        _command(
            sub,
            "config",
            "print the effective configuration (config show)",
            "exit 0 printed, 78 a bad config file, key or value",
        )
    )


def _cache_dir(g: Any, about: str = "cache with mels/, tokens/ and manifest.json", *, required: bool = False) -> None:
    g.add_argument(
        "--cache-dir",
        type=path,
        required=required,
        metavar="DIR",
        help=about if required else config_help(about, "cache_dir"),
    )


def _n_mels(g: Any) -> None:
    g.add_argument(
        "--n-mels",
        type=int,
        default=schema_default("n_mels"),
        help=config_help("mel bins per frame, 1..1024", "n_mels"),
    )


def _outputs(g: Any, what: str) -> None:
    g.add_argument("--json", action="store_true", help=f"print {what} as JSON to stdout (instead of the text)")
    g.add_argument(
        "-o", "--output", type=path, metavar="FILE", help=f"also write {what} as JSON to FILE (default: none)"
    )


def _doctor(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_config_options(g["common"])
    add_log_level(g["common"])
    _cache_dir(g["data"])
    g["data"].add_argument("--seed", type=int, help=config_help("data order seed", "seed"))
    add_demo(g["data"], "run on the built-in demo cache (generated once)")
    g["transport"].add_argument(
        "--endpoint",
        help=config_help("ipc://PATH or tcp://HOST:PORT", "transport.endpoint", " = ipc in a private runtime dir"),
    )
    g["transport"].add_argument(
        "--producers", type=int, help=config_help("producer processes to measure", "producer.count")
    )
    g["training"].add_argument("--model-step", help=config_help("training step factory, module:function", "model.step"))
    g["observability"].add_argument("--seconds-per-stage", type=float, default=3.0, help="measuring time of each stage")
    _outputs(g["observability"], "every figure and the verdict")
    add_debug_delay(g["advanced"])


def _index(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_log_level(g["common"])
    _cache_dir(g["data"], "the cache directory (manifest.json is written here)", required=True)
    _n_mels(g["data"])
    g["data"].add_argument("--skip-bad", action="store_true", help="write the manifest without the bad files")
    a = g["advanced"]
    a.add_argument(
        "--mels", type=path, help="adopt an existing folder of <id>.npy mels (linked as CACHE_DIR/mels; default: none)"
    )
    a.add_argument(
        "--tokens",
        type=path,
        help="adopt an existing folder of <id>.npy token ids (linked as CACHE_DIR/tokens; default: none)",
    )
    a.add_argument(
        "--extra",
        action="append",
        metavar="NAME[:KIND]=DIR",
        help="adopt a folder of <id>.npy extra arrays (linked as CACHE_DIR/extras/NAME); KIND is frame, "
        "token, utterance, sequence or matrix[/R] ([tokens, ceil(frames/R)]; default: what the "
        "headers show); repeatable",
    )


def _prepare(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_config_options(g["common"], "YAML config: its features section, n_mels and producer.data_gpu apply")
    add_log_level(g["common"])
    g["data"].add_argument(
        "--ljspeech",
        type=path,
        required=True,
        metavar="DIR",
        help="corpus dir with metadata.csv (id|text|normalized_text) and wavs/",
    )
    _cache_dir(g["data"], "output cache dir (created; an interrupted run resumes in it)", required=True)
    g["advanced"].add_argument(
        "--workers",
        type=int,
        help="worker processes, >= 1 (default and most: one per "
        "available CPU; more is lowered to that, with one INFO line)",
    )
    add_debug_delay(g["advanced"])


def _verify(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_log_level(g["common"])
    _cache_dir(g["data"], "the cache directory to check", required=True)
    _n_mels(g["data"])
    g["data"].add_argument(
        "--vocab-size",
        type=int,
        help="also report token files holding an id >= this (the config's model.vocab_size; default: not checked)",
    )


def _pack(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_log_level(g["common"])
    _cache_dir(g["data"], "the cache directory to pack", required=True)
    _n_mels(g["data"])
    g["data"].add_argument(
        "--skip-bad",
        action="store_true",
        help="write the pack even with bad files: their rows are zeros, listed bad, quarantined by producers",
    )
    g["transport"].add_argument(
        "--mel-dtype",
        choices=("float32", "float16"),
        default=schema_default("transport.mel_dtype"),
        help=config_help("the mels' dtype in the pack: the one it serves", "transport.mel_dtype"),
    )


def _audit(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_log_level(g["common"])
    g["training"].add_argument(
        "state_dir",
        type=path,
        nargs="+",
        metavar="STATE_DIR",
        help="state directories: one consumer's, or one per rank of a job",
    )
    _outputs(g["observability"], "the counts")


def _deploy(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    c = g["common"]
    c.add_argument(
        "--config",
        type=path,
        default=str(DEPLOY_DIR / "example.yaml"),
        metavar="FILE",
        help="YAML config the services read (must set cache_dir)",
    )
    c.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="set one config key after --config, checked now and passed to both units' command lines "
        "(repeatable; a value systemd would split or expand belongs in the config file)",
    )
    add_log_level(c)
    c.add_argument("--user", required=True, help="service user (owns the socket and state directories)")
    c.add_argument("--group", help="service group (default: the user's primary group)")
    c.add_argument("--prefix", type=path, default=sys.prefix, help="the venv the services run")
    c.add_argument("--target-dir", type=path, default="/etc/systemd/system", help="where the unit files go")
    t = g["transport"]
    t.add_argument(
        "--producers",
        type=int,
        required=True,
        help="instances pipeline.target wants (1..N); 0: none here (tcp endpoint, producers elsewhere)",
    )
    t.add_argument(
        "--producers-only",
        action="store_true",
        help="a producer host: no consumer unit (its consumer is on another host, over tcp + CURVE)",
    )
    r = g["training"]
    r.add_argument(
        "--state-dir",
        type=path,
        help="consumer checkpoints and audit log (default: /var/lib/melfeed, a rank's /var/lib/melfeed-rankR)",
    )
    r.add_argument(
        "--tf-config",
        type=path,
        metavar="FILE",
        help="this host's TF_CONFIG (JSON file, read now and "
        "passed to its units): render rank R's units (needs --rank; default: a single worker)",
    )
    r.add_argument("--rank", type=int, help="this host's rank; must be the rank FILE's task names (default: none)")
    a = g["advanced"]
    a.add_argument(
        "--work-dir",
        type=path,
        help="the services' working directory, where model.step's module is found first (default: this directory)",
    )
    a.add_argument("--env-file", type=path, default="/etc/melfeed/melfeed.env", help="optional EnvironmentFile")


def _keys(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_log_level(g["common"])
    t = g["transport"]
    t.add_argument(
        "dir", type=path, metavar="DIR", help="where the keys go (created 0700; existing keys are never overwritten)"
    )
    t.add_argument("--producer", action="append", help="producer name (repeat); its ids are NAME-<n>")


def _report(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_log_level(g["common"])
    o = g["observability"]
    o.add_argument(
        "metrics",
        type=path,
        nargs="+",
        help="metrics JSONL written by the consumer's --metrics-file "
        "(several: the ranks of one job, drawn on one time axis)",
    )
    o.add_argument("-o", "--output", type=path, required=True, metavar="FILE", help="PNG file to write (1600x1400 px)")
    o.add_argument("--title", help="first title line (default: the metrics file name)")


def _status(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_config_options(g["common"], "YAML config the consumer runs with (to find its control endpoint)")
    g["common"].add_argument(
        "--log-level",
        default="WARNING",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL "
        "(default: WARNING, so only the figures print; $MELFEED_LOG_LEVEL is not used)",
    )
    t = g["transport"]
    t.add_argument(
        "--endpoint",
        help=config_help(
            "the consumer's control endpoint", "consumer.control_endpoint", " = derived from transport.endpoint"
        ),
    )
    t.add_argument(
        "--tf-config",
        type=path,
        metavar="FILE",
        help="the rank's TF_CONFIG: ask that rank's default control socket (default: the TF_CONFIG variable)",
    )
    t.add_argument("--timeout-s", type=float, default=2.0, help="give up after this many seconds")
    _outputs(g["observability"], "the snapshot")


def _bench(p: argparse.ArgumentParser) -> None:
    from melfeed.shared.service.cli.bench_options import add_bench_options

    add_bench_options(p, groups(p))


def _demo_data(p: argparse.ArgumentParser) -> None:
    g = groups(p)
    add_log_level(g["common"])
    d = g["data"]
    _cache_dir(d, "the cache directory to write (created)", required=True)
    d.add_argument("--utterances", type=int, default=2000, help="utterances to write, 1..1000000")
    d.add_argument("--seed", type=int, default=1234, help="seed of lengths, tokens and noise, 0..2^63-1")


def _config(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", title="actions", required=True)
    show = sub.add_parser(
        "show",
        help="print the effective configuration as YAML: every key, defaults included",
        description="print the effective configuration (--config, then each --set) as YAML: every "
        "key, defaults included; exit 0 printed, 78 a bad config file, key or value",
    )
    g = groups(show)
    add_config_options(g["common"])
    add_log_level(g["common"])
