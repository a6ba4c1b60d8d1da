"""Command-line parser of the ``melfeed`` command and the mapping from flags to config keys.

Only argparse lives here; the commands are in ``consumer/app.py``, ``producer/app.py``,
``shared/cache/commands.py`` and the other modules ``consumer/melfeed/cli.py`` names. Rooms: ``parser``
(conventions, the pipeline's own commands), ``commands`` (the tools), ``bench_options``, ``options`` (groups,
types, defaults read from the config schema), ``settings`` (flags -> config, ``config show``).
"""

from __future__ import annotations

from melfeed.shared.service.cli.parser import OneLineParser, build_parser
from melfeed.shared.service.cli.settings import config_from_args, loaded_config, with_demo_cache

__all__ = ["OneLineParser", "build_parser", "config_from_args", "loaded_config", "with_demo_cache"]
