"""Command-line parser of the ``melfeed`` command and the mapping from flags to config keys.

Only argparse lives here; the commands are in ``consumer/app.py``, ``producer/app.py`` and
``shared/cache/commands.py``, ``consumer/observe/report_plot.py``. A flag overrides the YAML value of the key it names.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config_loader import load_config, with_overrides
from melfeed.shared.errors import ConfigError
from melfeed.shared.flag_checks import check_number
from melfeed.shared.service.rank_defaults import check_expected_rank, with_rank_defaults
from melfeed.shared.service.tf_config import resolve_worker_place
from melfeed.shared.service.units import DEPLOY_DIR

__all__ = ["OneLineParser", "build_parser", "config_from_args", "with_demo_cache"]

log = logging.getLogger(__name__)

_OVERRIDES = {  # flag dest -> config key
    "cache_dir": "cache_dir", "endpoint": "transport.endpoint", "steps": "consumer.steps",
    "producers": "producer.count", "seed": "seed", "ring_slots": "consumer.ring_slots",
    "batch_size": "buckets.batch_size", "status_interval_s": "consumer.status_interval_s",
    "state_dir": "consumer.state_dir", "model_step": "model.step",
    "checkpoint_every_steps": "consumer.checkpoint_every_steps",
    "metrics_file": "consumer.metrics_file", "metrics_port": "consumer.metrics_port",
    "replicas": "consumer.replicas",
}


_MAX_DEBUG_DELAY_MS = 3_600_000.0   # an hour per batch: far past any test; a larger sleep can overflow
_LOG_LEVEL_HELP = "DEBUG, INFO, WARNING, ERROR or CRITICAL (default: $MELFEED_LOG_LEVEL, else INFO)"
_N_MELS_HELP = "mel bins per frame, 1..1024 (the config's n_mels; default 80)"
_DEMO_UTTERANCES_HELP = "demo utterances, 1..1000000 (default 2000)"
_TRAIN_EXITS = ("exit 0 plan finished or stopped (SIGTERM/SIGINT: checkpoint first), 1 failure, 65 too many "
                "quarantined rows trained (producer.max_quarantined_fraction), 75 a rank lost contact with its job, "
                "78 configuration error")


def _common(p: argparse.ArgumentParser, *, producers: bool = False, consumer: bool = False) -> None:
    p.add_argument("--config", type=_path, help="YAML config file (see deploy/example.yaml)")
    p.add_argument("--cache-dir", type=_path, help="cache with mels/, tokens/ and manifest.json")
    p.add_argument("--endpoint", help="ipc://PATH or tcp://HOST:PORT (default: ipc in a private runtime dir)")
    p.add_argument("--seed", type=int, help="data order seed")
    p.add_argument("--log-level", help=_LOG_LEVEL_HELP)
    if producers or consumer:
        p.add_argument("--tf-config", type=_path, metavar="FILE",
                       help="TF_CONFIG as a JSON file (default: the TF_CONFIG environment variable): this "
                            "rank and the world size of a multi-worker job (a rank's default endpoint "
                            "ends -rankR)")
        p.add_argument("--rank", type=int, help="refuse to start unless TF_CONFIG makes this process rank R "
                                                "(deploy writes it into a rank's units)")
    if producers:
        p.add_argument("--producers", type=int, help="number of producer processes (producer.count, default 2)")
        p.add_argument("--debug-delay-ms", type=_delay_ms, default=0.0, help="slow every batch build (testing)")
        if not consumer:
            p.add_argument("--instance", type=int, help="run only producer N in this process (systemd producer@N)")
    if consumer:
        p.add_argument("--steps", type=int, help="stop once this many batches were applied in total: a resumed run "
                                                         "keeps its end (consumer.steps, default 300)")
        p.add_argument("--ring-slots", type=int, help="preallocated batch slots, 3..256 (consumer.ring_slots)")
        p.add_argument("--batch-size", type=int, help="rows per batch")
        p.add_argument("--status-interval-s", type=float, help="seconds between status lines")
        p.add_argument("--state-dir", type=_path, help="directory for checkpoints and the audit log (resume from it)")
        p.add_argument("--checkpoint-every-steps", type=int, help="checkpoint period (also on stop and at the end)")
        p.add_argument("--model-step", help="training step factory, module:function")
        p.add_argument("--replicas", type=int, help="model replicas (MirroredStrategy): N GPUs, or N logical CPUs")
        p.add_argument("--summary-json", type=_path, help="write the final summary as JSON to this file")
        p.add_argument("--metrics-file", type=_path,
                       help="append one JSON snapshot per status interval (and a final one) here")
        p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (127.0.0.1 by default)")


def _delay_ms(text: str) -> float:
    """``--debug-delay-ms`` (run, producer, doctor, prepare): a sleep per batch or utterance, so finite, >= 0 and
    at most an hour; a NaN or negative sleep would crash every producer, restarted by its supervisor for ever."""
    try:
        return check_number(float(text), "--debug-delay-ms", ceiling=_MAX_DEBUG_DELAY_MS)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds, got {text!r}") from None
    except ConfigError as err:
        raise argparse.ArgumentTypeError(f"{err.reason}, got {text!r}") from None


def _path(text: str) -> str:
    """A file or directory argument: "" (or only blanks) would quietly mean the current directory (``keys ""``
    wrote the keys there, ``demo-data ""`` a whole cache), so it is refused by name, as the config's paths are."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a path (an empty one would mean the current directory), "
                                         f"got {text!r}")
    return text


def _demo(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--demo", action="store_true", help=help_text)
    p.add_argument("--demo-utterances", type=int, default=2000, action=_DemoCount, help=_DEMO_UTTERANCES_HELP)


class _DemoCount(argparse.Action):
    """``--demo-utterances``, remembered as given: without ``--demo`` it would be ignored without a word."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.demo_utterances_given = True


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag like any other configuration error: one line naming the flag, exit 78
    (argparse's own way is the usage block and exit 2). Subparsers inherit the class. Flags that contradict each
    other are refused here too."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = super().parse_known_args(args, namespace)
        if getattr(parsed, "demo_utterances_given", False) and not getattr(parsed, "demo", False):
            self.error("argument --demo-utterances: needs --demo (without it the cache is --cache-dir or cache_dir)")
        if getattr(parsed, "instance", None) is not None and getattr(parsed, "producers", None) is not None:
            self.error("argument --instance: runs one producer, --producers N starts N under one parent: pick one")
        return parsed, rest

    def error(self, message: str) -> NoReturn:
        from melfeed.shared.errors import EXIT_CONFIG

        self.exit(EXIT_CONFIG, f"{self.prog}: {' '.join(message.split())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="melfeed", description="melfeed: keep the training GPU busy")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="consumer and N producers on this host",
                         description="consumer and N producers on this host; " + _TRAIN_EXITS)
    _common(run, producers=True, consumer=True)
    _demo(run, "generate (once) and train on the built-in demo data")
    _common(sub.add_parser("consumer", help="the training side alone (systemd: consumer.service)",
                           description="the training side alone (systemd: consumer.service); " + _TRAIN_EXITS),
            consumer=True)
    producer = sub.add_parser("producer", help="N producer processes under one parent",
                              description="N producer processes under one parent (a failed one is restarted), or "
                                          "one with --instance; exit 0 stopped (SIGTERM/SIGINT) or, under run, the "
                                          "plan finished; 1 failure (--instance: systemd restarts it); 78 "
                                          "configuration error (a bad flag, key or cache, or the consumer refused its "
                                          "contract: one producer's 78 stops the group)")
    _common(producer, producers=True)
    _demo(producer, "generate (once) and serve the built-in demo data")
    doc = sub.add_parser("doctor", help="measure every stage, name the bottleneck; exit 0 only if supply keeps up",
                         description="measure every stage, name the bottleneck; exit 0 supply >= 1.2 x demand, 3 the "
                                     "data side is the bottleneck, 1 a probe failed, 78 configuration error, 128 + "
                                     "signal when SIGTERM/SIGINT stopped it (its probes stopped, no report)")
    _common(doc)
    doc.add_argument("--producers", type=int, help="producer processes to measure (default: producer.count)")
    doc.add_argument("--debug-delay-ms", type=_delay_ms, default=0.0, help="slow every batch build (testing)")
    doc.add_argument("--model-step", help="training step factory, module:function")
    doc.add_argument("--demo", action="store_true", help="run on the built-in demo cache (generated once)")
    doc.add_argument("--demo-utterances", type=int, default=2000, action=_DemoCount, help=_DEMO_UTTERANCES_HELP)
    doc.add_argument("--seconds-per-stage", type=float, default=3.0, help="measuring time of each stage")
    doc.add_argument("--json", type=_path, help="also write every figure and the verdict as JSON to this file")
    idx = sub.add_parser("index", help="build CACHE_DIR/manifest.json from the .npy headers and token ids",
                         description="build CACHE_DIR/manifest.json from the .npy headers and token ids (their "
                                     "range recorded); exit 0 written, 1 bad files (not written without --skip-bad), "
                                     "78 cache directory unusable")
    idx.add_argument("cache_dir", type=_path)
    idx.add_argument("--n-mels", type=int, default=80, help=_N_MELS_HELP)
    idx.add_argument("--skip-bad", action="store_true", help="write the manifest without the bad files")
    idx.add_argument("--mels", type=_path, help="adopt an existing folder of <id>.npy mels (linked as CACHE_DIR/mels)")
    idx.add_argument("--tokens", type=_path, help="adopt an existing folder of <id>.npy token ids (linked as CACHE_DIR/tokens)")
    idx.add_argument("--extra", action="append", metavar="NAME[:KIND]=DIR",
                     help="adopt a folder of <id>.npy extra arrays (linked as CACHE_DIR/extras/NAME); KIND is "
                          "frame, token, utterance or sequence (default: what the headers show); repeatable")
    prep = _command(sub, "prepare", "build a mel cache from an LJSpeech-format corpus (resumable)",
                    "exit 0 complete (skips reported), 1 bad output files (manifest not written), 2 interrupted "
                    "(run it again to resume), 78 configuration error")
    prep.add_argument("--ljspeech", type=_path, required=True, help="corpus dir with metadata.csv (id|text|normalized_text) and wavs/")
    prep.add_argument("--cache", type=_path, required=True, help="output cache dir (created; an interrupted run resumes in it)")
    prep.add_argument("--config", type=_path, help="YAML config: its features section, n_mels and producer.data_gpu apply")
    prep.add_argument("--workers", type=int, help="worker processes, >= 1 (default and most: one per available "
                                                  "CPU; more is lowered to that, with one INFO line)")
    prep.add_argument("--debug-delay-ms", type=_delay_ms, default=0.0, help="slow every utterance (testing)")
    prep.add_argument("--log-level", help=_LOG_LEVEL_HELP)
    ver = _command(sub, "verify-cache", "check every cache file (header, size, values)",
                   "exit 0 nothing bad, 1 a bad file, 78 the directory or a flag unusable", "; exit 1 if any is bad")
    ver.add_argument("cache_dir", type=_path)
    ver.add_argument("--n-mels", type=int, default=80, help=_N_MELS_HELP)
    ver.add_argument("--vocab-size", type=int, help="also report token files holding an id >= this "
                                                    "(the config's model.vocab_size)")
    about = ("write CACHE_DIR/melfeed-<mel_dtype>.pack: the cache's data in one file, checked once (producers copy "
             "rows out of it); exit 0 written, 1 bad files (not written without --skip-bad), 78 cache unreadable")
    pack = sub.add_parser("pack", help=about, description=about)
    pack.add_argument("cache_dir", type=_path)
    pack.add_argument("--n-mels", type=int, default=80, help=_N_MELS_HELP)
    pack.add_argument("--mel-dtype", choices=("float32", "float16"), default="float32",
                      help="the mels' dtype in the pack: the transport.mel_dtype it serves (default float32)")
    pack.add_argument("--skip-bad", action="store_true", help="write the pack even with bad files: their rows are "
                                                              "zeros, listed bad, quarantined by producers")
    aud = _command(sub, "audit", "compare the applied-batch logs of STATE_DIR (one per rank of a job) with the plan",
                   "exit 0 exact, 1 not exact, 78 a state directory or flag unusable", "; exit 1 if not exact")
    aud.add_argument("state_dir", type=_path, nargs="+", help="state directories: one consumer's, or one per rank of a job")
    aud.add_argument("--json", type=_path, help="also write the counts as JSON to this file")
    dep = _command(sub, "deploy", "render the systemd units (consumer, producer@N, pipeline.target)",
                   "exit 0 written, 78 a bad flag, config or target directory (nothing written)")
    dep.add_argument("--producers", type=int, required=True,
                     help="instances pipeline.target wants (1..N); 0: none here (tcp endpoint, producers elsewhere)")
    dep.add_argument("--prefix", type=_path, default=sys.prefix, help="the venv the services run (default: this one)")
    dep.add_argument("--user", required=True, help="service user (owns the socket and state directories)")
    dep.add_argument("--group", help="service group (default: the user's primary group)")
    dep.add_argument("--config", type=_path, default=str(DEPLOY_DIR / "example.yaml"),
                     help="YAML config the services read (must set cache_dir)")
    dep.add_argument("--target-dir", type=_path, default="/etc/systemd/system", help="where the unit files go")
    dep.add_argument("--state-dir", type=_path, help="consumer checkpoints and audit log (default: /var/lib/melfeed, a "
                                         "rank's /var/lib/melfeed-rankR)")
    dep.add_argument("--tf-config", type=_path, metavar="FILE", help="this host's TF_CONFIG (JSON file, read now and passed to "
                                                         "its units): render rank R's units (needs --rank)")
    dep.add_argument("--rank", type=int, help="this host's rank; must be the rank FILE's task names")
    dep.add_argument("--producers-only", action="store_true",
                     help="a producer host: no consumer unit (its consumer is on another host, over tcp + CURVE)")
    dep.add_argument("--work-dir", type=_path, help="the services' working directory, where model.step's module "
                     "is found first (default: this directory)")
    dep.add_argument("--env-file", type=_path, default="/etc/melfeed/melfeed.env", help="optional EnvironmentFile")
    keys = _command(sub, "keys", "generate CURVE key pairs (consumer + one per producer name) into DIR",
                    "exit 0 written, 78 a bad name or DIR")
    keys.add_argument("dir", type=_path, help="where the keys go (created 0700; existing keys are never overwritten)")
    keys.add_argument("--producer", action="append", help="producer name (repeat); its ids are NAME-<n>")
    rep = _command(sub, "report", "draw a run's metrics JSONL (--metrics-file) as a PNG timeline",
                   "exit 0 written, 78 a bad metrics file or output, or no matplotlib (the report extra)")
    rep.add_argument("metrics", type=_path, nargs="+",
                     help="metrics JSONL written by the consumer's --metrics-file (several: the ranks of one job, "
                          "drawn on one time axis)")
    rep.add_argument("-o", "--output", type=_path, required=True, help="PNG file to write (1600x1400 px)")
    rep.add_argument("--title", help="first title line (default: the metrics file name)")
    st = _command(sub, "status", "print a running consumer's live figures",
                  "exit 0 printed, 1 no consumer answered or the answer is no snapshot, 78 a bad flag or config",
                  " (exit 1 if none answers)")
    st.add_argument("--config", type=_path, help="YAML config the consumer runs with (to find its control endpoint)")
    st.add_argument("--endpoint", help="the consumer's control endpoint (default: derived from --config)")
    st.add_argument("--tf-config", type=_path, metavar="FILE",
                    help="the rank's TF_CONFIG (default: the TF_CONFIG variable): ask that rank's default control "
                         "socket")
    st.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    st.add_argument("--timeout-s", type=float, default=2.0, help="give up after this many seconds")
    st.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: WARNING, "
                                                           "so only the figures print; $MELFEED_LOG_LEVEL is not used)")
    _bench(sub.add_parser("bench", help="melfeed vs tuned tf.data, the naive loader and tf.data service",
                          description="melfeed vs tuned tf.data, the naive loader and tf.data service; exit 0 every "
                                      "trial ran (a FAILed goal is a result), 1 a trial failed, 78 bad flag or cache, "
                                      "128 + signal when SIGTERM/SIGINT stopped it (its trials stopped, no report)"))
    demo = _command(sub, "demo-data", "write the deterministic demo cache into DIR", "exit 0 written, 78 a bad flag or DIR")
    demo.add_argument("dir", type=_path, help="the cache directory to write (created)")
    demo.add_argument("--utterances", type=int, default=2000, help="utterances to write, 1..1000000 (default 2000)")
    demo.add_argument("--seed", type=int, default=1234, help="seed of lengths, tokens and noise, 0..2^63-1")
    return ap


def _command(sub: Any, name: str, about: str, exits: str, listed: str = "") -> argparse.ArgumentParser:
    """A command whose ``--help`` opens with what it does and its exit codes; the command list shows ``about``
    (and ``listed``, the exit worth knowing there)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=about + listed, description=f"{about}; {exits}")
    return parser


def _bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=_path, help="YAML config (buckets, seed, n_mels, transport settings apply)")
    p.add_argument("--cache-dir", type=_path, help="cache with mels/, tokens/ and manifest.json")
    p.add_argument("--demo", action="store_true", help="generate (once) and use the built-in demo data")
    p.add_argument("--demo-utterances", type=int, default=2000, action=_DemoCount, help=_DEMO_UTTERANCES_HELP)
    p.add_argument("--producers", default="1,2", help="melfeed producer counts, comma-separated")
    p.add_argument("--transports", default="zmq,shm,tcp",
                   help="melfeed paths, comma-separated: zmq (payload frames over ipc), shm, tcp (payload frames over "
                        "loopback tcp with CURVE; the first producer count, max rate only)")
    p.add_argument("--step-ms", default="5,20,50", help="modelled device time per step, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds alternating the systems; medians over them")
    p.add_argument("--batches", type=int, default=300, help="measured batches per trial")
    p.add_argument("--warmup", type=int, default=10, help="batches before measuring, per trial")
    p.add_argument("--tfdata-parallel", default="autotune,8,16", help="tuned tf.data num_parallel_calls variants")
    p.add_argument("--service-workers", type=int, default=1, help="tf.data service workers (0 = skip the service)")
    p.add_argument("--transport-only", action="store_true", help="only the transport GB/s section")
    p.add_argument("--no-transport", action="store_true", help="skip the transport GB/s section")
    p.add_argument("--mel-dtypes", default="float32,float16",
                   help="wire formats (transport.mel_dtype) of the transport section and the producer build probe; "
                        "float16 rows are labelled -f16 and judged by no goal (--smoke: float32 only)")
    p.add_argument("--efficiency-batches", type=int, default=None,
                   help="measured batches of each feed-efficiency trial (reference model; default 100, "
                        "0 with --smoke; 0 = skip the section)")
    p.add_argument("--efficiency-only", action="store_true", help="only the feed-efficiency section")
    p.add_argument("--smoke", action="store_true", help="tiny structural run: 1 round, 5 ms step, 10 batches, 1 producer, tf.data at 8, float32 "
                        "(replaces --rounds, --step-ms, --batches, --warmup, --producers, --tfdata-parallel, "
                        "--mel-dtypes, --demo-utterances)")
    p.add_argument("--trial-timeout-s", type=float, default=300.0, help="kill a trial (and its helpers) after this")
    p.add_argument("--json", type=_path, help="write every trial's raw numbers, the medians, ratios and goals to this file")
    p.add_argument("--log-level", help=_LOG_LEVEL_HELP)


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """Load ``--config`` (or defaults) and apply the flags given on the command line.

    Commands of a rank (``run``, ``consumer``, ``producer``: they have ``--tf-config``) then check
    ``--rank`` against the TF_CONFIG and take the rank's default endpoint where none is set
    (``shared/service/rank_defaults.py``; a world of 1 changes nothing).
    """
    cfg = load_config(getattr(args, "config", None))
    overrides: dict[str, Any] = {key: getattr(args, dest, None) for dest, key in _OVERRIDES.items()}
    cfg = with_overrides(cfg, overrides)
    if not hasattr(args, "tf_config"):
        return cfg
    place = resolve_worker_place(args.tf_config, os.environ)
    check_expected_rank(place, getattr(args, "rank", None))
    return with_rank_defaults(cfg, place, os.environ)


def with_demo_cache(args: argparse.Namespace, cfg: PipelineConfig) -> PipelineConfig:
    """``--demo`` (run, producer): the built-in demo cache, written first unless already complete.

    ``cache_dir`` becomes ``--cache-dir`` if given, else ``default_demo_dir(--demo-utterances)``; without
    ``--demo`` ``cfg`` is returned as is.
    """
    if not getattr(args, "demo", False):
        return cfg
    from melfeed.shared.cache.demo_data import default_demo_dir, write_demo_cache
    cache = Path(args.cache_dir) if args.cache_dir else default_demo_dir(args.demo_utterances)
    log.info("demo data in %s", cache)
    write_demo_cache(cache, n_utterances=args.demo_utterances, extras=True)
    return with_overrides(cfg, {"cache_dir": str(cache)})
