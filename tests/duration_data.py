"""The demo cache with a per-token ``duration`` extra, as a duration-driven model reads it (tests/value_steps.py).

No TensorFlow here: a test that only needs the cache (its run's step lives in a child process) stays light.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from melfeed.shared.cache.demo_data import DEMO_EXTRAS, write_demo_cache
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest, write_manifest


def write_duration_cache(root: Path, n_utterances: int, n_mels: int) -> Manifest:
    """The demo cache (with its extras) plus ``extras/duration/<id>.npy``: int32 [tokens], each value 1..8."""
    manifest = write_demo_cache(root, n_utterances, n_mels=n_mels, extras=True)
    rng = np.random.default_rng(11)
    (root / "extras" / "duration").mkdir(parents=True, exist_ok=True)
    for u in manifest.utterances:
        np.save(root / "extras" / "duration" / f"{u.id}.npy", rng.integers(1, 9, u.tokens, dtype=np.int32))
    full, problems = build_manifest(root, n_mels, kinds={**DEMO_EXTRAS, "duration": "token"})
    assert problems == [] and "duration" in [c.spec.name for c in full.extras]
    write_manifest(full)
    return full
