"""Indexing a cache: a ``Manifest`` built from the ``.npy`` headers of ``mels/`` and ``tokens/``.

Role: ``build_manifest`` (``melfeed index``, ``prepare``, the demo data) reads each mel's and
extra's header, never its data, pairs mels and tokens by file stem, and records every file's data
offset and size. Token files are small (a few hundred bytes of int32), so their data is read too: a
negative id makes the file bad, and the smallest and largest id over the usable utterances become the
manifest's ``token_range``, which consumer starts compare with ``model.vocab_size``. The rules
(``check_mel_header``, ``check_token_header``, ``token_range``) are the same ones ``verify-cache``
applies. Bad or unpaired files become ``CacheProblem``s naming the file and are left out of the
manifest; the caller decides whether that is fatal.
Shutdown: nothing to shut down; every file opened here is closed before returning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from melfeed.shared.cache.extras import ExtraColumn, extra_dirs, index_extra
from melfeed.shared.cache.features import FEATURES_NAME, read_feature_record
from melfeed.shared.cache.filekind import open_regular, read_json
from melfeed.shared.cache.manifest import (
    MANIFEST_NAME,
    MEL_DTYPES,
    TOKEN_DTYPE,
    CacheProblem,
    FeatureItems,
    Manifest,
    Utterance,
    parse_features,
    parse_vocabulary,
)
from melfeed.shared.cache.npyfile import NpyHeader, inspect_npy
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.schema import KINDS

__all__ = ["build_manifest", "check_mel_header", "check_token_header", "ids_outside", "list_npy", "token_range"]

log = logging.getLogger(__name__)

_MEL_DTYPE_NAMES = {dtype: name for name, dtype in MEL_DTYPES.items()}  # .npy dtype -> manifest mel_dtype
_TOKEN_CHUNK_ITEMS = 1 << 18  # ids per read (1 MiB): one read for any real token file, bounded memory for any file


def _list_npy(directory: Path) -> dict[str, Path]:
    if not directory.is_dir():
        raise CacheError(directory, "missing directory")
    return list_npy(directory)


def list_npy(directory: Path) -> dict[str, Path]:
    """``{stem: path}`` of the ``.npy`` entries of an existing ``directory`` (``index``, ``verify-cache``).

    Raises:
        CacheError: the directory cannot be listed (mode 000, EIO), naming it and the OS reason.
    """
    try:
        with os.scandir(directory) as entries:
            # Every entry, not only regular files: a FIFO, device, directory or broken symlink named
            # x.npy is reported by the check that opens it (melfeed.shared.cache.filekind), never skipped silently.
            return {e.name[:-4]: Path(e.path) for e in entries if e.name.endswith(".npy") and len(e.name) > 4}
    except OSError as err:
        raise CacheError(directory, f"cannot read the directory ({err.strerror})") from err


def check_mel_header(header: NpyHeader, n_mels: int) -> str | None:
    """Why a mel header is unusable (one line), or ``None``; ``index`` and ``verify-cache`` share it."""
    if len(header.shape) != 2:
        return f"expected rank 2 [frames, n_mels], got shape {header.shape}"
    if header.shape[1] != n_mels:
        hint = " (stored as [n_mels, frames]? transpose it)" if header.shape[0] == n_mels else ""
        return f"expected n_mels={n_mels} in shape [frames, n_mels], got shape {header.shape}{hint}"
    if header.dtype not in _MEL_DTYPE_NAMES:
        return f"mel dtype {header.dtype.str} not allowed (little-endian float32 or float16)"
    if header.shape[0] == 0:
        return "zero frames"
    return None


def check_token_header(header: NpyHeader) -> str | None:
    """Why a token header is unusable (one line), or ``None``."""
    if len(header.shape) != 1:
        return f"expected rank 1 [tokens], got shape {header.shape}"
    if header.dtype != TOKEN_DTYPE:
        return f"token dtype {header.dtype.str} not allowed (little-endian int32)"
    if header.shape[0] == 0:
        return "zero tokens"
    return None


def ids_outside(ids: npt.NDArray[np.int32], recorded: tuple[int, int] | None) -> str | None:
    """Why token ``ids`` read now are not the ones ``index`` saw (outside the manifest's ``token_range``), or
    ``None``. ``pack`` and producers ask it: the consumer's start checked ``model.vocab_size`` against that
    range, so an id beyond it (a token file rewritten since) would reach the model unchecked."""
    if recorded is None or ids.size == 0:
        return None  # an older manifest records no range (its start warned)
    low, high = int(ids.min()), int(ids.max())
    if recorded[0] <= low and high <= recorded[1]:
        return None
    return (
        f"file changed since index: token ids {low}..{high}, outside the {recorded[0]}..{recorded[1]} the "
        "manifest records; re-run index"
    )


def token_range(path: Path, header: NpyHeader) -> tuple[int, int]:
    """The smallest and largest id of a token file whose header passed ``check_token_header``.

    Reads the data at ``header.data_offset`` (a second open: the header was read by ``inspect_npy``).

    Raises:
        CacheError: a negative id (naming it and its position: no vocabulary has one), or the file cannot
            be read (missing now, short, EIO), naming the file.
    """
    try:
        fd, _ = open_regular(path)
    except OSError as err:
        raise CacheError(path, f"cannot open ({err.strerror})") from err
    total, item = header.shape[0], TOKEN_DTYPE.itemsize
    lo, hi, done = 0, 0, 0
    try:
        while done < total:
            k = min(_TOKEN_CHUNK_ITEMS, total - done)
            raw = os.pread(fd, k * item, header.data_offset + done * item)
            if len(raw) != k * item:
                raise CacheError(path, f"short read at token {done + len(raw) // item} of {total}")
            ids = np.frombuffer(raw, dtype=TOKEN_DTYPE)
            low, high = int(ids.min()), int(ids.max())
            if low < 0:
                at = int(np.argmax(ids < 0))
                raise CacheError(path, f"token id {int(ids[at])} at position {done + at}: ids must be >= 0")
            lo, hi = (low, high) if done == 0 else (min(lo, low), max(hi, high))
            done += k
    except OSError as err:
        raise CacheError(path, f"cannot read ({err.strerror})") from err
    finally:
        os.close(fd)
    return lo, hi


def _inspect(path: Path, problems: list[CacheProblem]) -> tuple[NpyHeader, int] | None:
    try:
        return inspect_npy(path)
    except CacheError as err:
        problems.append(CacheProblem(err.path, err.reason))
        return None


def _index_one(
    uid: str, mel: Path, tok: Path, n_mels: int, problems: list[CacheProblem]
) -> tuple[Utterance, tuple[int, int]] | None:
    """The utterance's row and its token ids' (smallest, largest), or ``None`` with its problems appended."""
    mel_info, tok_info = _inspect(mel, problems), _inspect(tok, problems)
    mel_bad = check_mel_header(mel_info[0], n_mels) if mel_info else None
    tok_bad = check_token_header(tok_info[0]) if tok_info else None
    if mel_bad:
        problems.append(CacheProblem(str(mel), mel_bad))
    if tok_bad:
        problems.append(CacheProblem(str(tok), tok_bad))
    if mel_info is None or tok_info is None or mel_bad or tok_bad:
        return None
    (mh, mel_bytes), (th, tok_bytes) = mel_info, tok_info
    try:
        ids = token_range(tok, th)
    except CacheError as err:
        problems.append(CacheProblem(err.path, err.reason))
        return None
    return Utterance(
        uid, mh.shape[0], th.shape[0], _MEL_DTYPE_NAMES[mh.dtype], mh.data_offset, mel_bytes, th.data_offset, tok_bytes
    ), ids


def recorded_features(root: Path, n_mels: int) -> tuple[FeatureItems | None, tuple[str, ...] | None]:
    """The feature parameters and vocabulary ``features.json`` records, checked against ``n_mels``."""
    record = read_feature_record(root)
    if record is None:
        return None, None
    path = root / FEATURES_NAME
    features = parse_features(record.get("features"), path)
    recorded = dict(features or ()).get("n_mels", n_mels)
    if recorded != n_mels:
        raise CacheError(path, f"cache was prepared with n_mels={recorded}, indexing with n_mels={n_mels}")
    return features, parse_vocabulary(record.get("vocabulary"), path)


def build_manifest(
    cache_dir: str | os.PathLike[str],
    n_mels: int = 80,
    progress: Callable[[int, int], None] | None = None,
    kinds: Mapping[str, str] | None = None,
) -> tuple[Manifest, list[CacheProblem]]:
    """Index a cache directory by reading every file's ``.npy`` header, and the token files' ids.

    Args:
        cache_dir: Directory holding ``mels/`` and ``tokens/``.
        n_mels: Required last dimension of every mel file.
        progress: Called as ``progress(done, total)`` after each utterance id.
        kinds: Declared kind of each extra in ``extras/`` (``index --extra NAME:KIND=DIR``); an
            extra not named here keeps the kind the current manifest declares, else gets the kind its
            headers show (``melfeed.shared.cache.extras.infer_kind``).

    Returns:
        ``(manifest, problems)``: the usable utterances (with their ``token_range``), and one
        ``CacheProblem`` per bad or unpaired file (its utterance is left out). An all-bad cache gives
        an empty manifest; the caller decides whether that is fatal.

    Raises:
        CacheError: ``mels/`` or ``tokens/`` is missing, or neither holds any ``.npy`` file,
            or ``features.json`` is malformed or names another ``n_mels``, or an extra cannot be
            declared (bad folder name, files of mixed dtypes, a kind given for no folder).
    """
    root = Path(cache_dir)
    features, vocabulary = recorded_features(root, n_mels)
    mels, toks = _list_npy(root / "mels"), _list_npy(root / "tokens")
    if not mels and not toks:
        raise CacheError(root, "empty cache: no .npy files in mels/ or tokens/")
    ids = sorted(mels.keys() | toks.keys())
    problems: list[CacheProblem] = []
    utterances: list[Utterance] = []
    lows: list[int] = []
    highs: list[int] = []  # each utterance's smallest and largest token id, in utterance order
    for done, uid in enumerate(ids, 1):
        mel, tok = mels.get(uid), toks.get(uid)
        if tok is None and mel is not None:
            problems.append(CacheProblem(str(mel), f"no matching tokens/{uid}.npy"))
        elif mel is None and tok is not None:
            problems.append(CacheProblem(str(tok), f"no matching mels/{uid}.npy"))
        elif mel is not None and tok is not None:
            indexed = _index_one(uid, mel, tok, n_mels, problems)
            if indexed is not None:
                utterances.append(indexed[0])
                lows.append(indexed[1][0])
                highs.append(indexed[1][1])
        if progress is not None:
            progress(done, len(ids))
    keep, extras = _index_extras(root, utterances, kinds or {}, problems)
    ranges = [(lows[i], highs[i]) for i in keep]
    span = (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None
    manifest = Manifest(
        root, n_mels, tuple(utterances[i] for i in keep), features, vocabulary, extras, token_range=span
    )
    log.info(
        "indexed cache=%s utterances=%d problems=%d fingerprint=%s",
        root,
        len(manifest),
        len(problems),
        manifest.fingerprint,
    )
    return manifest, problems


def _declared_kinds(root: Path) -> dict[str, str]:
    """The kinds the current manifest declares (best effort): a re-index keeps them without ``--extra``."""
    try:
        doc = read_json(root / MANIFEST_NAME)  # too deep is a ValueError here, not a RecursionError
        return {
            e["name"]: e["kind"] + (f"/{e.get('divisor', 1)}" if e["kind"] == "matrix" else "")
            for e in doc.get("extras") or []
            if isinstance(e.get("name"), str) and e.get("kind") in KINDS
        }
    except (CacheError, OSError, ValueError, AttributeError, TypeError):
        return {}


def _index_extras(
    root: Path, utterances: list[Utterance], kinds: Mapping[str, str], problems: list[CacheProblem]
) -> tuple[list[int], tuple[ExtraColumn, ...]]:
    """Index ``extras/*``: the indices of the utterances kept (one whose file of any extra is bad or missing
    is left out) and the columns, with a row per kept utterance."""
    folders = extra_dirs(root)
    unknown = sorted(set(kinds) - set(folders))
    kinds = {**_declared_kinds(root), **kinds}
    if unknown:
        raise CacheError(root / "extras", f"no folder for the declared extra {unknown[0]!r}")
    ids = [u.id for u in utterances]
    frames, tokens = [u.frames for u in utterances], [u.tokens for u in utterances]
    columns: list[ExtraColumn] = []
    dropped: set[str] = set()
    for name, folder in folders.items():
        column, bad = index_extra(name, folder, ids, frames, tokens, kinds.get(name))
        problems.extend(CacheProblem(path, reason) for path, reason in bad.values())
        dropped |= bad.keys() if column is not None else set(ids)
        if column is not None:
            columns.append(column)
    keep = [i for i, uid in enumerate(ids) if uid not in dropped]
    return keep, tuple(ExtraColumn(c.spec, c.rows[keep]) for c in columns)
