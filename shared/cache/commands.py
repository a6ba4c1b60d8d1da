"""Offline commands: ``index`` (manifest from .npy headers and token ids), ``verify-cache`` and ``demo-data``.

``index`` and ``verify-cache`` show a ``melfeed.shared.service.progress.Progress`` on stderr (a bar on a terminal,
else a line every ``_PROGRESS_EVERY_S`` or ``$MELFEED_PROGRESS_S``); results go to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.extras import EXTRAS_DIR
from melfeed.shared.cache.features import check_n_mels_flag
from melfeed.shared.cache.filekind import make_dirs
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import write_manifest
from melfeed.shared.cache.verify import verify_cache
from melfeed.shared.errors import CacheError, ConfigError
from melfeed.shared.flag_checks import resolve_path
from melfeed.shared.service.progress import Progress, progress_interval_s
from melfeed.shared.wire.schema import EXTRA_DTYPES, KINDS, check_declaration, parse_kind

__all__ = ["main_index", "main_verify_cache", "main_demo", "parse_extra_arg"]

log = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 5.0  # a large cache takes minutes to read; say it is alive this often
_INT32_MAX = (1 << 31) - 1  # --vocab-size bound: model.vocab_size's (token ids are int32)


def _link_folder(root: Path, name: str, target: str | None) -> None:
    """Adopt an existing folder of ``<id>.npy`` files as ``ROOT/name`` (a symlink; nothing is copied).

    The link is relative when the folder is inside ``root`` (the cache stays relocatable), else absolute.
    """
    if target is None:
        return
    src = resolve_path(target, ("--extra" if name.startswith(EXTRAS_DIR) else f"--{name}",))
    root = resolve_path(root, ("CACHE_DIR",))
    if not src.is_dir():
        raise CacheError(target, "not a directory")
    link = root / name
    if link.exists() or link.is_symlink():
        if resolve_path(link, ("CACHE_DIR",)) == src:
            return
        raise CacheError(link, f"exists and is not {src}; refusing to replace it")
    make_dirs(link.parent)
    inside = src.is_relative_to(root)
    try:
        link.symlink_to(os.path.relpath(src, root) if inside else src, target_is_directory=True)
    except OSError as err:  # a read-only cache directory
        raise CacheError(link, f"cannot link it to {src} ({err.strerror})") from err


def _progress(label: str) -> Progress:
    """Progress over utterances on stderr; the total is learnt from the first callback."""
    return Progress(0, sys.stderr, label=label, unit="utterances", interval_s=progress_interval_s(_PROGRESS_EVERY_S))


def parse_extra_arg(value: str) -> tuple[str, str | None, str]:
    """``NAME=DIR`` or ``NAME:KIND=DIR`` (``index --extra``; KIND ``matrix/R`` gives a matrix's frame divisor R)
    as (name, kind or None, dir).

    Raises:
        ConfigError: malformed, a name that cannot be an extra's, or an unknown kind (key ``--extra``).
    """
    head, sep, folder = value.partition("=")
    name, _, kind = head.partition(":")
    if not sep or not name or not folder:
        raise ConfigError("must look like NAME=DIR or NAME:KIND=DIR", path=("--extra",), got=value)
    parsed = parse_kind(kind) if kind else (KINDS[0], 1)
    if parsed is None:
        raise ConfigError(
            f"kind must be one of {list(KINDS)} (a matrix may say matrix/R, R frames per column), got {kind!r}",
            path=("--extra",),
            got=value,
        )
    bad = check_declaration(name, parsed[0], EXTRA_DTYPES[0], [], parsed[1])
    if bad is not None:
        raise ConfigError(f"{bad[0]} {bad[1]}", path=("--extra",), got=value)
    return name, kind or None, folder


def main_index(args: argparse.Namespace) -> int:
    """Exit 0 when every file is valid; 1 when some are bad (manifest written only with --skip-bad).

    With ``--mels``/``--tokens``/``--extra``, existing folders are adopted first (``_link_folder``);
    every folder under ``extras/`` is indexed as an extra array, of the kind ``--extra NAME:KIND=DIR``
    declares or else the kind its headers show.
    """
    check_n_mels_flag(args.n_mels)
    extras = [parse_extra_arg(v) for v in getattr(args, "extra", None) or []]
    _link_folder(Path(args.cache_dir), "mels", getattr(args, "mels", None))
    _link_folder(Path(args.cache_dir), "tokens", getattr(args, "tokens", None))
    for name, _, folder in extras:
        _link_folder(Path(args.cache_dir), f"{EXTRAS_DIR}/{name}", folder)
    kinds = {name: kind for name, kind, _ in extras if kind is not None}
    progress = _progress("index")
    try:
        manifest, problems = build_manifest(
            args.cache_dir, n_mels=args.n_mels, progress=progress.callback(), kinds=kinds
        )
    finally:
        progress.finish()  # ends the bar's line before any message
    for problem in problems:
        print(f"bad: {problem}", file=sys.stderr)
    unmatched = sum(p.reason.startswith("no matching ") for p in problems)
    if problems:
        print(f"{unmatched} unmatched, {len(problems) - unmatched} invalid files", file=sys.stderr)
    if problems and not args.skip_bad:
        print(f"{len(problems)} bad files; manifest not written (fix them, or pass --skip-bad)", file=sys.stderr)
        return 1
    path = write_manifest(manifest)
    frames = int(manifest.frames.sum())
    print(
        f"indexed {len(manifest.utterances)} utterances ({frames} frames, fingerprint {manifest.fingerprint})"
        f" -> {path}" + (f"; skipped {len(problems)} bad files" if problems else "")
    )
    for column in manifest.extras:
        spec = column.spec
        print(f"extra {spec.name}: kind {spec.kind_text}, dtype {spec.dtype}, shape {list(spec.shape)}")
    return 0


def main_verify_cache(args: argparse.Namespace) -> int:
    """Exit 0 when every file a training run reads is good, 1 when some are bad.

    Prints ``bad: PATH: REASON`` per bad file and ``warning: PATH: REASON`` per unlisted file
    (stdout, sorted by path), then the summary line. A missing cache dir raises ``CacheError`` (78).
    """
    check_n_mels_flag(args.n_mels)
    vocab_size = getattr(args, "vocab_size", None)
    if vocab_size is not None and not 2 <= vocab_size <= _INT32_MAX:
        raise ConfigError(
            f"must be in 2..{_INT32_MAX} (token ids below it, as the config's model.vocab_size)",
            path=("--vocab-size",),
            got=vocab_size,
        )
    progress = _progress("verify-cache")
    try:
        report = verify_cache(args.cache_dir, n_mels=args.n_mels, progress=progress.callback(), vocab_size=vocab_size)
    finally:
        progress.finish()
    for problem in report.problems:
        print(f"{'bad' if problem.fatal else 'warning'}: {problem}")
    n_warn = len(report.warnings)
    print(
        f"verified {report.utterances} utterances ({report.files} files): {len(report.bad)} bad"
        + (f", {n_warn} not in the manifest" if n_warn else "")
        + ("" if report.has_manifest else " (no usable manifest: checked by header)")
    )
    return 1 if report.bad else 0


def main_demo(args: argparse.Namespace) -> int:
    manifest = write_demo_cache(
        args.cache_dir, n_utterances=args.utterances, seed=args.seed, extras=True, utterances_flag="--utterances"
    )
    print(
        f"demo cache: {len(manifest.utterances)} utterances in {manifest.cache_dir} "
        f"(fingerprint {manifest.fingerprint})"
    )
    return 0
