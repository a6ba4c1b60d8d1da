"""Synthetic inputs for unit tests of pure logic."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def ljspeech_like(n: int, seed: int = 0) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Frames (1-10 s at 22050 Hz, hop 256) and roughly proportional token counts."""
    rng = np.random.default_rng(seed)
    seconds = np.clip(rng.normal(6.6, 2.2, n), 1.0, 10.1)
    frames = np.round(seconds * 22050 / 256).astype(np.int64)
    tokens = np.clip(np.round(seconds * 15 + rng.normal(0, 5, n)), 10, 190).astype(np.int64)
    return frames, tokens
