"""``run_pipeline.py producer``: supervise N producers, or run one (``--instance N``, for systemd).

``--producers N`` writes the effective config once and supervises N child processes (restart with
back-off). ``--instance N`` runs producer N in this process, for ``producer@N.service``, where
systemd restarts it; both notify systemd when ``$NOTIFY_SOCKET`` is set.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from pathlib import Path

import yaml

from producer.supervisor import supervise_producers
from shared.service.cli import config_from_args
from shared.config import resolve_runtime_dir
from shared.config_loader import config_to_mapping, with_overrides
from shared.errors import ConfigError
from shared.service.lifecycle import prepare_runtime_dir, resolve_endpoint, stop_on_signals
from shared.service.sdnotify import Notifier

__all__ = ["main_producer", "write_effective_config"]


def write_effective_config(cfg_map: dict[str, object], name: str) -> Path:
    """Children read one file holding the config with every CLI override applied."""
    path = prepare_runtime_dir(resolve_runtime_dir(os.environ)) / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg_map, sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)
    return path


def main_producer(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.cache_dir is None:
        raise ConfigError("is required (--cache-dir or cache_dir in the config)", path=("cache_dir",))
    cfg = with_overrides(cfg, {"transport.endpoint": resolve_endpoint(cfg, os.environ),
                               "cache_dir": str(Path(cfg.cache_dir).resolve())})
    notifier = Notifier()
    try:
        if args.instance is not None:        # systemd producer@N.service: systemd is the supervisor
            from producer.process import run_one
            multiprocessing.current_process().name = f"producer-{args.instance}"
            return run_one(cfg, args.instance, args.debug_delay_ms / 1000.0, notifier)
        path = write_effective_config(config_to_mapping(cfg), f"producers-{os.getpid()}.yaml")
        try:
            with stop_on_signals() as stop:
                return supervise_producers(path, cfg.producer.count, stop, backoff_s=cfg.producer.restart_backoff_s,
                                           debug_delay_ms=args.debug_delay_ms, notifier=notifier)
        finally:
            path.unlink(missing_ok=True)
    finally:
        notifier.close()
