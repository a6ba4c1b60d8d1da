"""Offline commands: ``index`` (manifest from .npy headers) and ``demo-data``."""

from __future__ import annotations

import argparse
import logging
import sys

from shared.demo_data import write_demo_cache
from shared.manifest import build_manifest, write_manifest

__all__ = ["main_index", "main_demo"]

log = logging.getLogger(__name__)


def main_index(args: argparse.Namespace) -> int:
    """Exit 0 when every file is valid; 1 when some are bad (manifest written only with --skip-bad)."""
    manifest, problems = build_manifest(args.cache_dir, n_mels=args.n_mels)
    for problem in problems:
        print(f"bad: {problem}", file=sys.stderr)
    if problems and not args.skip_bad:
        print(f"{len(problems)} bad files; manifest not written (fix them, or pass --skip-bad)", file=sys.stderr)
        return 1
    path = write_manifest(manifest)
    frames = int(manifest.frames.sum())
    print(f"indexed {len(manifest.utterances)} utterances ({frames} frames, fingerprint {manifest.fingerprint})"
          f" -> {path}" + (f"; skipped {len(problems)} bad files" if problems else ""))
    return 0


def main_demo(args: argparse.Namespace) -> int:
    manifest = write_demo_cache(args.dir, n_utterances=args.utterances, seed=args.seed)
    print(f"demo cache: {len(manifest.utterances)} utterances in {manifest.cache_dir} "
          f"(fingerprint {manifest.fingerprint})")
    return 0
