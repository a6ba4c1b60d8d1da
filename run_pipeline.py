#!/usr/bin/env python3
"""melfeed command line: argv -> config -> start -> wait -> exit code. No logic lives here."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

_STARTED_S = time.time()


def main(argv: Sequence[str] | None = None) -> int:
    from shared.cli import build_parser
    from shared.errors import EXIT_CONFIG, CacheError, ConfigError, StateError
    from shared.lifecycle import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", "INFO"))
    try:
        if args.command == "index":
            from shared.tools import main_index
            return main_index(args)
        if args.command == "verify-cache":
            from shared.tools import main_verify_cache
            return main_verify_cache(args)
        if args.command == "audit":
            from consumer.audit import main_audit
            return main_audit(args)
        if args.command == "deploy":
            from shared.deploy import main_deploy
            return main_deploy(args)
        if args.command == "prepare":
            from shared.prepare import main_prepare
            return main_prepare(args)
        if args.command == "demo-data":
            from shared.tools import main_demo
            return main_demo(args)
        if args.command == "producer":
            from producer.app import main_producer
            return main_producer(args)
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


if __name__ == "__main__":
    sys.exit(main())
