"""Guided-attention matrices for tests: the ``[tokens, ceil(frames / r)]`` matrix extra a Tacotron-kind model uses,
and the demo cache with them adopted as that extra (``attention_cache``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

R = 3  # frames per decoder step (tests/tts_models.py)


def guided_attention(tokens: int, frames: int, r: int = R, g: float = 0.2) -> npt.NDArray[np.float16]:
    """TensorFlowTTS's guided-attention weights, float16 [tokens, ceil(frames / r)]: 0 on the diagonal."""
    cols = -(-frames // r)
    n = np.arange(tokens)[:, None] / tokens
    t = np.arange(cols)[None, :] / cols
    return (1.0 - np.exp(-np.square(n - t) / (2 * g * g))).astype(np.float16)


def write_attention(folder: Path, lengths: dict[str, tuple[int, int]], r: int = R) -> None:
    """``folder/<id>.npy`` for each ``{id: (tokens, frames)}`` (plus 0.01, so no entry is 0)."""
    folder.mkdir(parents=True, exist_ok=True)
    for uid, (tokens, frames) in lengths.items():
        np.save(folder / f"{uid}.npy", guided_attention(tokens, frames, r) + np.float16(0.01))


def attention_cache(demo: Path, tmp: Path) -> Path:
    """``tmp/cache``: the demo cache's mels and tokens (linked, not copied) plus an ``attn`` matrix extra adopted
    with ``index --extra attn:matrix/3=DIR``."""
    from melfeed import cli
    from melfeed.shared.cache.manifest import load_manifest

    manifest = load_manifest(demo)
    write_attention(tmp / "attn", {u.id: (u.tokens, u.frames) for u in manifest.utterances})
    cache = tmp / "cache"
    code = cli.main(
        [
            "index",
            "--cache-dir",
            str(cache),
            "--mels",
            str(demo / "mels"),
            "--tokens",
            str(demo / "tokens"),
            "--extra",
            f"attn:matrix/3={tmp / 'attn'}",
        ]
    )
    assert code == 0
    return cache
