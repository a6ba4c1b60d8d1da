"""The ``melfeed`` parser: its conventions, and the options of the commands that run the pipeline.

Conventions (docs/reference/commands.md): every ``--help`` shows every default (a config-backed flag names its
key and the schema's default); options come in the groups of ``options.GROUPS``; test-only flags are accepted
but not listed; a bad flag, a mistyped command or a bad ``--set`` is one line and exit 78, never argparse's
usage block and exit 2.
"""

from __future__ import annotations

import argparse
import difflib
from importlib.metadata import version
from typing import Any, NoReturn

from melfeed.shared.service.cli.options import (
    HelpFormatter,
    config_help,
    delay_ms,
    groups,
    path,
    schema_default,
    setting,
)

__all__ = ["OneLineParser", "build_parser", "add_config_options", "add_log_level"]

_LOG_LEVEL_HELP = "DEBUG, INFO, WARNING, ERROR or CRITICAL (default: $MELFEED_LOG_LEVEL, else INFO)"
_USAGE = "%(prog)s [options]"  # the options are listed by group below; a flat usage line of them is unreadable
_TRAIN_EXITS = (
    "exit 0 plan finished or stopped (SIGTERM/SIGINT: checkpoint first), 1 failure, 65 too many "
    "quarantined rows trained (producer.max_quarantined_fraction), 75 a rank lost contact with its job, "
    "78 configuration error"
)
_PRODUCER_EXITS = (
    "exit 0 stopped (SIGTERM/SIGINT) or, under run, the plan finished; 1 failure (--instance: "
    "systemd restarts it); 78 configuration error (a bad flag, key or cache, or the consumer refused "
    "its contract: one producer's 78 stops the group)"
)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag like any other configuration error: one line naming the flag, exit 78
    (argparse's own way is the usage block and exit 2). Subparsers inherit the class. Flags that contradict each
    other are refused here too, and a mistyped command gets the nearest one suggested."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = super().parse_known_args(args, namespace)
        if getattr(parsed, "demo_utterances_given", False) and not getattr(parsed, "demo", False):
            self.error("argument --demo-utterances: needs --demo (without it the cache is --cache-dir)")
        if getattr(parsed, "instance", None) is not None and getattr(parsed, "producers", None) is not None:
            self.error("argument --instance: runs one producer, --producers N starts N under one parent: pick one")
        return parsed, rest

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, argparse._SubParsersAction) and value not in (action.choices or {}):
            names = list(action.choices or {})
            near = difflib.get_close_matches(str(value), names, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"the commands are {', '.join(names)}"
            self.error(f"unknown command {value!r}: {hint}")
        super()._check_value(action, value)

    def error(self, message: str) -> NoReturn:
        from melfeed.shared.errors import EXIT_CONFIG

        self.exit(EXIT_CONFIG, f"{self.prog}: {' '.join(message.split())} (see --help)\n")


def add_config_options(group: Any, about: str = "YAML config file (see deploy/example.yaml)") -> None:
    """``--config FILE`` and the repeatable ``--set KEY=VALUE`` applied after it, before the dedicated flags."""
    group.add_argument("--config", type=path, metavar="FILE", help=about)
    group.add_argument(
        "--set",
        type=setting,
        action="append",
        metavar="KEY=VALUE",
        help="set one config key after --config, before the flags below (repeatable; the value is "
        "YAML: consumer.steps=null, buckets.batch_size=16, consumer.model_gpu='\"0\"')",
    )


def add_log_level(group: Any) -> None:
    group.add_argument("--log-level", metavar="LEVEL", help=_LOG_LEVEL_HELP)


def add_demo(group: Any, about: str) -> None:
    group.add_argument("--demo", action="store_true", help=about)
    group.add_argument(
        "--demo-utterances", type=int, default=2000, action=_DemoCount, help="demo utterances, 1..1000000"
    )


class _DemoCount(argparse.Action):
    """``--demo-utterances``, remembered as given: without ``--demo`` it would be ignored without a word."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.demo_utterances_given = True


def add_debug_delay(group: Any) -> None:
    """``--debug-delay-ms``: for tests only, so accepted but not listed."""
    group.add_argument("--debug-delay-ms", type=delay_ms, default=0.0, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    from melfeed.shared.service.cli.commands import add_tool_commands

    ap = OneLineParser(prog="melfeed", description="melfeed: keep the training GPU busy")
    ap.add_argument("--version", action="version", version=f"melfeed {version('melfeed')}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _rank_command(
        sub.add_parser(
            "run",
            help="consumer and N producers on this host",
            usage=_USAGE,
            description="consumer and N producers on this host; " + _TRAIN_EXITS,
        ),
        producers=True,
        consumer=True,
    )
    _rank_command(
        sub.add_parser(
            "consumer",
            help="the training side alone (systemd: consumer.service)",
            usage=_USAGE,
            description="the training side alone (systemd: consumer.service); " + _TRAIN_EXITS,
        ),
        consumer=True,
    )
    _rank_command(
        sub.add_parser(
            "producer",
            help="N producer processes under one parent",
            usage=_USAGE,
            description="N producer processes under one parent (a failed one is restarted), or "
            "one with --instance; " + _PRODUCER_EXITS,
        ),
        producers=True,
    )
    add_tool_commands(sub)
    return ap


def _rank_command(p: argparse.ArgumentParser, *, producers: bool = False, consumer: bool = False) -> None:
    """``run``, ``consumer``, ``producer``: the processes of one rank."""
    g = groups(p)
    add_config_options(g["common"])
    add_log_level(g["common"])
    g["data"].add_argument(
        "--cache-dir", type=path, help=config_help("cache with mels/, tokens/ and manifest.json", "cache_dir")
    )
    g["data"].add_argument("--seed", type=int, help=config_help("data order seed", "seed"))
    g["transport"].add_argument(
        "--endpoint",
        help=config_help("ipc://PATH or tcp://HOST:PORT", "transport.endpoint", " = ipc in a private runtime dir"),
    )
    g["training"].add_argument(
        "--tf-config",
        type=path,
        metavar="FILE",
        help="TF_CONFIG as a JSON file: this rank and the world size of a multi-worker job "
        "(a rank's default endpoint ends -rankR; default: the TF_CONFIG variable)",
    )
    g["training"].add_argument(
        "--rank",
        type=int,
        help="refuse to start unless TF_CONFIG makes this process rank "
        "R (deploy writes it into a rank's units; default: any)",
    )
    if producers:
        _producer_options(g, standalone=not consumer)
    if consumer:
        _consumer_options(g)


def _producer_options(g: dict[str, Any], *, standalone: bool) -> None:
    g["transport"].add_argument(
        "--producers", type=int, help=config_help("number of producer processes", "producer.count")
    )
    if standalone:
        g["transport"].add_argument(
            "--instance",
            type=int,
            help="run only producer N in this process (systemd producer@N; default: all of --producers)",
        )
    add_demo(g["data"], "generate (once) and use the built-in demo data")
    add_debug_delay(g["advanced"])


def _consumer_options(g: dict[str, Any]) -> None:
    g["data"].add_argument("--batch-size", type=int, help=config_help("rows per batch", "buckets.batch_size"))
    g["transport"].add_argument(
        "--ring-slots", type=int, help=config_help("preallocated batch slots, 3..256", "consumer.ring_slots")
    )
    t = g["training"]
    t.add_argument(
        "--steps",
        type=int,
        help=config_help(
            "stop once this many batches were applied in total: a resumed run keeps its end", "consumer.steps"
        ),
    )
    t.add_argument(
        "--state-dir",
        type=path,
        help=config_help(
            "directory for checkpoints and the audit log (resume from it)", "consumer.state_dir", " = no state"
        ),
    )
    t.add_argument(
        "--checkpoint-every-steps",
        type=int,
        help=config_help("checkpoint period (also on stop and at the end)", "consumer.checkpoint_every_steps"),
    )
    t.add_argument("--model-step", help=config_help("training step factory, module:function", "model.step"))
    t.add_argument(
        "--replicas",
        type=int,
        help=config_help(
            "model replicas (MirroredStrategy): N GPUs, or N logical CPUs",
            "consumer.replicas",
            " = one per GPU in consumer.model_gpu, else 1",
        ),
    )
    o = g["observability"]
    o.add_argument(
        "--status-interval-s",
        type=float,
        help=config_help("seconds between status lines", "consumer.status_interval_s"),
    )
    o.add_argument(
        "--summary-json", type=path, metavar="FILE", help="write the final summary as JSON to this file (default: none)"
    )
    o.add_argument(
        "--metrics-file",
        type=path,
        help=config_help(
            "append one JSON snapshot per status interval (and a final one) here", "consumer.metrics_file", " = off"
        ),
    )
    o.add_argument(
        "--metrics-port",
        type=int,
        help=config_help(
            f"serve Prometheus metrics on this port (on {schema_default('consumer.metrics_host')})",
            "consumer.metrics_port",
            " = off",
        ),
    )
    o.add_argument(
        "--tensorboard",
        type=path,
        metavar="DIR",
        help=config_help(
            "write TensorBoard scalars (losses, feed figures, GPUs, producers) here",
            "consumer.tensorboard_dir",
            " = off",
        ),
    )
