"""``melfeed producer``: supervise N producers, or run one (``--instance N``, for systemd).

``--producers N`` writes the effective config once (``melfeed.shared.service.children.handed_over_config``:
mode 0600 in the runtime directory, removed on exit) and supervises N child processes (restart with
back-off). ``--instance N`` runs producer N in this process, for ``producer@N.service``, where
systemd restarts it; ``--demo`` serves the built-in demo cache (written first if missing, as for
``run --demo``); both notify systemd when ``$NOTIFY_SOCKET`` is set.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal

from melfeed.producer.supervisor import supervise_producers
from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_to_mapping, with_overrides
from melfeed.shared.errors import ConfigError
from melfeed.shared.flag_checks import resolve_path
from melfeed.shared.service.children import handed_over_config
from melfeed.shared.service.cli import config_from_args, with_demo_cache
from melfeed.shared.service.lifecycle import die_with_named_parent, resolve_endpoint, stop_on_signals
from melfeed.shared.service.sdnotify import Notifier

__all__ = ["main_producer"]


def main_producer(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.instance is not None:
        _check_instance(cfg, args.instance)
    cfg = with_demo_cache(args, cfg)
    if cfg.cache_dir is None:
        raise ConfigError("is required (--cache-dir, --demo, or cache_dir in the config)", path=("cache_dir",))
    cfg = with_overrides(
        cfg,
        {
            "transport.endpoint": resolve_endpoint(cfg, os.environ),
            "cache_dir": str(resolve_path(cfg.cache_dir, ("cache_dir",))),
        },
    )
    if args.instance is None:  # else each of the N children prints the same refusal of a bad manifest: one line here
        from melfeed.shared.cache.features import load_manifest_for

        load_manifest_for(cfg, feeds_model=False)
    notifier = Notifier()
    try:
        if args.instance is not None:  # systemd producer@N.service: systemd is the supervisor
            from melfeed.producer.process import run_one

            multiprocessing.current_process().name = f"producer-{args.instance}"
            return run_one(cfg, args.instance, args.debug_delay_ms / 1000.0, notifier)
        # Handlers first (a SIGTERM from here on is a clean stop that removes the file and says
        # STOPPING); children read one file holding the config with every CLI override applied.
        with (
            stop_on_signals() as stop,
            handed_over_config(config_to_mapping(cfg), f"producers-{os.getpid()}.yaml") as path,
        ):
            die_with_named_parent(signal.SIGTERM)  # started by `run`, a trial, a probe: a clean stop when it dies
            return supervise_producers(
                path,
                cfg.producer.count,
                stop,
                backoff_s=cfg.producer.restart_backoff_s,
                debug_delay_ms=args.debug_delay_ms,
                notifier=notifier,
                exit_at_plan_end=cfg.producer.exit_at_plan_end,
            )
    finally:
        notifier.close()


def _check_instance(cfg: PipelineConfig, instance: int) -> None:
    """``--instance N``: N in 1..the cap on ``producer.count`` (the same bound ``deploy --producers`` has).

    Not 1..``producer.count`` itself: under systemd the target wants ``producer@1..N`` for ``deploy
    --producers N`` whatever the config's count, and ``systemctl start producer@7`` adds one by hand.
    """
    if instance < 1:
        raise ConfigError(
            "must be >= 1 (systemd's producer@N numbers instances from 1)", path=("--instance",), got=instance
        )
    try:
        with_overrides(cfg, {"producer.count": instance})
    except ConfigError as err:  # the config's own cap, e.g. "must be in 1..64"
        raise ConfigError(f"{err.reason} (the bound on producer.count)", path=("--instance",), got=instance) from None
