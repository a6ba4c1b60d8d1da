"""From flags to the effective config: ``--config``, then each ``--set KEY=VALUE``, then the dedicated flags.

Every step is checked by the config schema (``shared/config/loader.py``): an unknown key or a bad value is one
``ConfigError`` naming the key. ``melfeed config show`` prints the result.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_from_mapping, config_to_mapping, load_config, with_overrides
from melfeed.shared.errors import ConfigError
from melfeed.shared.service.rank_defaults import check_expected_rank, with_rank_defaults
from melfeed.shared.service.tf_config import resolve_worker_place

__all__ = ["OVERRIDES", "config_from_args", "loaded_config", "main_config", "with_demo_cache", "with_settings"]

log = logging.getLogger(__name__)

OVERRIDES = {  # flag dest -> config key
    "cache_dir": "cache_dir",
    "endpoint": "transport.endpoint",
    "steps": "consumer.steps",
    "producers": "producer.count",
    "seed": "seed",
    "ring_slots": "consumer.ring_slots",
    "batch_size": "buckets.batch_size",
    "status_interval_s": "consumer.status_interval_s",
    "state_dir": "consumer.state_dir",
    "model_step": "model.step",
    "checkpoint_every_steps": "consumer.checkpoint_every_steps",
    "metrics_file": "consumer.metrics_file",
    "metrics_port": "consumer.metrics_port",
    "replicas": "consumer.replicas",
    "tensorboard": "consumer.tensorboard_dir",
}


def with_settings(cfg: PipelineConfig, settings: Iterable[tuple[str, Any]]) -> PipelineConfig:
    """Apply ``--set`` pairs in order (``("consumer.steps", None)`` sets null, unlike ``with_overrides``).

    Raises:
        ConfigError: a key the schema does not have, or a value it refuses; names the key.
    """
    data = config_to_mapping(cfg)
    for key, value in settings:
        node = data
        *parents, leaf = key.split(".")
        for depth, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                raise ConfigError("unknown key (no such section)", path=tuple(parents[: depth + 1]))
            node = node[part]
        node[leaf] = value
    return config_from_mapping(data)


def loaded_config(args: argparse.Namespace) -> PipelineConfig:
    """``--config`` (or the defaults) with every ``--set`` applied."""
    return with_settings(load_config(getattr(args, "config", None)), getattr(args, "set", None) or ())


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """``loaded_config``, then the dedicated flags given on the command line (``OVERRIDES``).

    Commands of a rank (``run``, ``consumer``, ``producer``: they have ``--tf-config``) then check
    ``--rank`` against the TF_CONFIG and take the rank's default endpoint where none is set
    (``shared/service/rank_defaults.py``; a world of 1 changes nothing).
    """
    overrides: dict[str, Any] = {key: getattr(args, dest, None) for dest, key in OVERRIDES.items()}
    cfg = with_overrides(loaded_config(args), overrides)
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


def main_config(args: argparse.Namespace) -> int:
    """``melfeed config show``: the effective configuration as YAML, every key (defaults included)."""
    import yaml

    print(yaml.safe_dump(config_to_mapping(loaded_config(args)), sort_keys=False), end="")
    return 0
