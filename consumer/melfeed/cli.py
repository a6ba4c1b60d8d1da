"""The ``melfeed`` command (and ``python -m melfeed``): argv -> command table -> exit code. No logic lives here.

Each command's module is imported only when that command is chosen: most commands never load TensorFlow.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "PROG"]

PROG = "melfeed"
_STARTED_S = time.time()

# command -> "module:function(args)"
_COMMANDS = {
    "index": "melfeed.shared.cache.commands:main_index",
    "verify-cache": "melfeed.shared.cache.commands:main_verify_cache",
    "demo-data": "melfeed.shared.cache.commands:main_demo",
    "pack": "melfeed.shared.cache.pack_write:main_pack",
    "prepare": "melfeed.producer.prepare.command:main_prepare",
    "audit": "melfeed.consumer.resume.job_audit:main_audit",
    "deploy": "melfeed.shared.service.units:main_deploy",
    "keys": "melfeed.shared.wire.curve:main_keys",
    "producer": "melfeed.producer.app:main_producer",
    "report": "melfeed.consumer.observe.report_plot:main_report",
    "status": "melfeed.consumer.observe.status:main_status",
    "doctor": "melfeed.consumer.doctor.command:main_doctor",
    "bench": "melfeed.consumer.bench.command:main_bench",
    "config": "melfeed.shared.service.cli.settings:main_config",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (0 done, 1 failure, 65 data, 75 job lost, 78 configuration, 130/143 stopped)."""
    try:
        from melfeed.shared.errors import PipelineError
        from melfeed.shared.service.cli import build_parser

        parser = build_parser()
        if not (sys.argv[1:] if argv is None else argv):  # bare `melfeed`: the command overview
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the modules load
        print(f"{PROG}: stopped by SIGINT", file=sys.stderr)
        return 130
    try:
        _setup_logging(getattr(args, "log_level", None))
        if args.command in _COMMANDS:
            module, function = _COMMANDS[args.command].split(":")
            return int(getattr(importlib.import_module(module), function)(args))
        from melfeed.consumer.app import main_consumer, main_run

        if args.command == "consumer":
            return main_consumer(args, _STARTED_S)
        return main_run(args, _STARTED_S)
    except PipelineError as err:  # one line; each error class carries its exit code (shared/errors.py)
        print(f"{PROG} {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C where no command's own handler runs yet (imports, index, doctor's set-up)
        print(f"{PROG} {args.command}: stopped by SIGINT", file=sys.stderr)
        return 130


def _setup_logging(flag: str | None) -> None:
    """``--log-level``, else ``MELFEED_LOG_LEVEL``, else INFO; a bad name is a ConfigError naming its source.

    The variable is checked whenever it is set (children read it) and exported in canonical case.
    """
    from melfeed.shared.service.lifecycle import LOG_LEVEL_ENV, log_level, setup_logging

    env = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if env:
        log_level(env, LOG_LEVEL_ENV)
        os.environ[LOG_LEVEL_ENV] = env.upper()
    if flag is not None:
        setup_logging(flag)
    else:
        setup_logging(env or "INFO", LOG_LEVEL_ENV)
    from melfeed.shared.service.lean_tensorflow import quiet_tensorflow_logs

    quiet_tensorflow_logs(flag or env or "INFO")  # TF_CPP_MIN_LOG_LEVEL=3 unless set or DEBUG; children inherit


def console_main() -> None:
    """The ``melfeed`` script and ``python -m melfeed``: TensorFlow's import without JAX and matplotlib (1-1.5 s
    of CPU less per process; docs/performance.md) and quiet (``shared/service/lean_tensorflow.py``), then
    :func:`main`."""
    from melfeed.shared.service.lean_tensorflow import quiet_tensorflow_import, skip_optional_imports_of_tensorflow

    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # every child inherits it (shared/gpu_select.py)
    skip_optional_imports_of_tensorflow()
    quiet_tensorflow_import()  # TensorFlow's C++ lines below TF_CPP_MIN_LOG_LEVEL, also those it logs as it loads
    sys.exit(main())
