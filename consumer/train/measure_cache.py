"""What the consumer measured on the user's step at start, kept in the state directory for the next start.

Role: ``buckets.batch_size: auto`` (consumer/train/auto_rows.py, ``batch_sizes.json``) and ``buckets.cost:
measured`` (consumer/train/measured_costs.py, ``bucket_costs.json``) each keep one JSON file: the values the
current plan is built with (``plan_<what>``: a resumed run keeps them, whatever device it resumes on) and one entry
per identity measured (``entries``: a restart on the same step, settings, cache and device measures nothing).
``measure_identity`` is that identity. Invariants: a missing or damaged file is an empty one (the values are
measured again, with a warning for a damaged one); writes are atomic (temp file, rename) and 0640 like the state
directory's other files; a failed write is a warning, never an error. Shutdown: nothing to release.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from melfeed.shared.config import BucketConfig, PipelineConfig
from melfeed.shared.config.loader import config_to_mapping

__all__ = [
    "COSTS_FILE",
    "ROWS_FILE",
    "cached_entry",
    "measure_identity",
    "planned_settings",
    "read_measures",
    "store_measures",
]

log = logging.getLogger(__name__)

ROWS_FILE = "batch_sizes.json"  # buckets.batch_size: auto; {"plan_rows": [...], "entries": {identity: {"rows": ...}}}
COSTS_FILE = "bucket_costs.json"  # buckets.cost: measured; {"plan_costs": [t, a], "entries": {identity: {...}}}


def measure_identity(cfg: PipelineConfig, fingerprint: str, device_kind: str, measured: Iterable[str]) -> str:
    """A digest of everything a measurement depends on: the step (``model``), the bucket settings but the
    ``measured`` ones (its outputs), the mel's channels and dtype, the replicas, the memory share, the cache's
    fingerprint and the device kind."""
    outputs = set(measured)
    mapping = config_to_mapping(cfg)
    c = cfg.consumer
    key = {
        "model": mapping["model"],
        "buckets": {k: v for k, v in mapping["buckets"].items() if k not in outputs},
        "n_mels": cfg.n_mels,
        "mel_dtype": cfg.transport.mel_dtype,
        "replicas": c.replica_count,
        "gpu_memory_fraction": c.gpu_memory_fraction,
        "gpu_memory_limit_mb": c.gpu_memory_limit_mb,
        "fingerprint": fingerprint,
        "device": device_kind,
    }
    return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()


def read_measures(path: Path, what: str) -> dict[str, Any]:
    """The file's content ({} when absent or damaged: ``what`` is measured again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring %s (%s): the %s are measured again", path, err, what)
        return {}
    return data if isinstance(data, dict) else {}


def cached_entry(path: Path | None, identity: str, what: str) -> dict[str, Any] | None:
    """The entry measured earlier for ``identity`` (None: none, or no file)."""
    entries = read_measures(path, what).get("entries") if path is not None else None
    entry = entries.get(identity) if isinstance(entries, dict) else None
    return entry if isinstance(entry, dict) else None


def store_measures(
    path: Path, what: str, plan_key: str, plan_value: Any, entry: tuple[str, dict[str, Any]] | None = None
) -> None:
    """Record the values the plan is built with (``plan_key``) and a measured ``entry`` (identity, content)."""
    from melfeed.consumer.resume.filemode import write_private

    data = read_measures(path, what)
    found = data.get("entries")
    entries: dict[str, Any] = found if isinstance(found, dict) else {}
    if entry is not None:
        entries[entry[0]] = entry[1]
    tmp = path.with_suffix(".tmp")
    try:
        text = json.dumps({plan_key: plan_value, "entries": entries}, indent=1, sort_keys=True) + "\n"
        write_private(tmp, text.encode())
        os.replace(tmp, path)
    except OSError as err:  # not fatal: the next start measures again
        log.warning("cannot write %s: %s; a restart measures the %s again", path, err.strerror, what)


def planned_settings(state_dir: Path, buckets: BucketConfig) -> BucketConfig:
    """``buckets`` as the run in ``state_dir`` planned with them: its measured weights and its rows from the files
    (``plan_costs``, ``plan_rows``), where the settings left them to the consumer (unchanged when a file lacks them:
    a plan built from them then refuses, naming the setting). For readers of a run's state (``audit``)."""
    from melfeed.shared.wire.buckets import learns_costs, learns_rows, with_costs

    if learns_costs(buckets):
        costs = read_measures(state_dir / COSTS_FILE, "bucket cost weights").get("plan_costs")
        if isinstance(costs, list) and len(costs) == 2 and all(isinstance(c, (int, float)) for c in costs):
            buckets = with_costs(buckets, float(costs[0]), float(costs[1]))
    if learns_rows(buckets):
        rows = read_measures(state_dir / ROWS_FILE, "rows").get("plan_rows")
        if isinstance(rows, list) and rows and all(type(r) is int and r >= 1 for r in rows):
            buckets = dataclasses.replace(buckets, rows=tuple(rows))
    return buckets
