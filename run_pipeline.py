#!/usr/bin/env python3
"""melfeed command line: argv -> config -> start -> wait -> exit code. No logic lives here."""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Sequence

_STARTED_S = time.time()

# command -> "module:function(args)"; imported only when chosen (most commands never load TensorFlow)
_COMMANDS = {
    "index": "shared.cache.commands:main_index", "verify-cache": "shared.cache.commands:main_verify_cache",
    "demo-data": "shared.cache.commands:main_demo", "pack": "shared.cache.pack_write:main_pack", "prepare": "producer.prepare.command:main_prepare",
    "audit": "consumer.resume.job_audit:main_audit", "deploy": "shared.service.units:main_deploy", "keys": "shared.wire.curve:main_keys",
    "producer": "producer.app:main_producer", "report": "consumer.observe.report_plot:main_report",
    "status": "consumer.observe.status:main_status",
    "doctor": "consumer.doctor.command:main_doctor",
    "bench": "consumer.bench.command:main_bench",
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from shared.service.cli import build_parser
        from shared.errors import (EXIT_CONFIG, EXIT_DATA, EXIT_JOB_LOST, CacheError, ConfigError, DataError,
                                   JobLostError, StateError, StepError)
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:   # Ctrl-C while the modules load
        print("run_pipeline.py: stopped by SIGINT", file=sys.stderr)
        return 130
    try:
        _setup_logging(getattr(args, "log_level", None))
        if args.command in _COMMANDS:
            module, function = _COMMANDS[args.command].split(":")
            return int(getattr(importlib.import_module(module), function)(args))
        from consumer.app import main_consumer, main_run
        if args.command == "consumer":
            return main_consumer(args, _STARTED_S)
        return main_run(args, _STARTED_S, __file__)
    except (ConfigError, CacheError) as err:
        print(f"run_pipeline.py {args.command}: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except StateError as err:
        print(f"run_pipeline.py {args.command}: {err}", file=sys.stderr)
        return EXIT_CONFIG if err.fatal else 1
    except StepError as err:    # the step cannot run (e.g. jit_compile: true and XLA fails)
        print(f"run_pipeline.py {args.command}: {err}", file=sys.stderr)
        return 1
    except DataError as err:    # the data went bad mid-run (producer.max_quarantined_fraction): stopped in order
        print(f"run_pipeline.py {args.command}: {err}", file=sys.stderr)
        return EXIT_DATA
    except JobLostError as err:  # a multi-worker job lost a rank: restart every rank (newest common checkpoint)
        print(f"run_pipeline.py {args.command}: {err}", file=sys.stderr)
        return EXIT_JOB_LOST
    except KeyboardInterrupt:   # Ctrl-C where no command's own handler runs yet (imports, index, doctor's set-up)
        print(f"run_pipeline.py {args.command}: stopped by SIGINT", file=sys.stderr)
        return 130


def _setup_logging(flag: str | None) -> None:
    """``--log-level``, else ``MELFEED_LOG_LEVEL``, else INFO; a bad name is a ConfigError naming its source.

    The variable is checked whenever it is set (children read it) and exported in canonical case.
    """
    from shared.service.lifecycle import LOG_LEVEL_ENV, log_level, setup_logging
    env = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if env:
        log_level(env, LOG_LEVEL_ENV)
        os.environ[LOG_LEVEL_ENV] = env.upper()
    if flag is not None:
        setup_logging(flag)
    else:
        setup_logging(env or "INFO", LOG_LEVEL_ENV)


if __name__ == "__main__":
    from shared.service.lean_tensorflow import skip_optional_imports_of_tensorflow
    skip_optional_imports_of_tensorflow()   # TensorFlow's import without JAX and matplotlib: 1-1.5 s of CPU less
    sys.exit(main())
