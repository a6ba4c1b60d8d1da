"""The cache manifest: one JSON file listing every usable utterance and where its bytes are.

Cache layout::

    CACHE/mels/<id>.npy     float32 (float16 accepted), shape [frames, n_mels]
    CACHE/tokens/<id>.npy   int32, shape [tokens]
    CACHE/manifest.json     written by ``write_manifest``

Role: ``build_manifest`` reads only the ``.npy`` headers (never the data) and records each
file's data offset and size, so producers can ``preadv`` data straight into batch rows and
detect a file changed since indexing.

Invariants:
- ``Manifest.utterances`` is sorted by id, ids are unique, and every listed utterance has a
  valid mel and token file (as of indexing); bad files become ``CacheProblem``s and are left out.
- ``fingerprint`` covers the format version, ``n_mels`` and every utterance row, not
  ``cache_dir``: a copied cache keeps its fingerprint; any changed file changes it.
- ``write_manifest`` is atomic (temp file, fsync, ``os.replace``): readers see old or new,
  never half a file.
- ``load_manifest`` trusts nothing: exact JSON types, safe ids, sizes that fit, fingerprint.
Shutdown: nothing to shut down; every file opened here is closed before returning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from shared.errors import CacheError
from shared.npyfile import NpyHeader, inspect_npy

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "Utterance",
    "CacheProblem",
    "Manifest",
    "build_manifest",
    "write_manifest",
    "load_manifest",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1  # bump when the columns or their meaning change
_COLUMNS = ("id", "frames", "tokens", "mel_dtype", "mel_offset", "mel_file_bytes",
            "tok_offset", "tok_file_bytes")
_ROW_TYPES = (str, int, int, str, int, int, int, int)  # exact types, so JSON true/1.0 are rejected
_BAD_ID = re.compile(r"\A(?:\.|\Z)|[/\\\x00]")  # empty, hidden/"..", or a path separator or NUL
_MEL_DTYPES = {np.dtype("<f4"): "float32", np.dtype("<f2"): "float16"}
_MEL_ITEMSIZE = {"float32": 4, "float16": 2}
_TOKEN_DTYPE = np.dtype("<i4")


class Utterance(NamedTuple):
    """One indexed utterance: its lengths and where its data starts in each file.

    A NamedTuple, not a frozen dataclass: building 13k frozen dataclasses alone costs ~40 ms
    (one ``object.__setattr__`` per field), a third of the load budget; ``_make`` costs ~0.5 us.
    """

    id: str  # file stem shared by mels/<id>.npy and tokens/<id>.npy
    frames: int  # mel frames (rows), >= 1
    tokens: int  # token count, >= 1
    mel_dtype: str  # "float32" or "float16" (little-endian)
    mel_offset: int  # byte offset of the first mel data byte
    mel_file_bytes: int  # mel file size in bytes at index time
    tok_offset: int  # byte offset of the first token data byte
    tok_file_bytes: int  # token file size in bytes at index time


@dataclass(frozen=True, slots=True)
class CacheProblem:
    """A cache file that was left out of the manifest, and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def _fingerprint(n_mels: int, ids: tuple[str, ...], mel_dtypes: tuple[str, ...],
                 ints: npt.NDArray[np.int64]) -> str:
    """16 hex chars of sha256 over everything but ``cache_dir``.

    Hashes raw columns (ids and dtypes NUL-joined, NUL being the one character no file name
    holds; integer columns as little-endian int64) rather than JSON: 13k rows hash in ~2 ms.
    """
    h = hashlib.sha256(f"melfeed-manifest/{MANIFEST_FORMAT}/{n_mels}\0".encode())
    for text in ("\0".join(ids), "\0".join(mel_dtypes)):
        h.update(text.encode("utf-8", "surrogatepass"))  # undecodable file names survive
        h.update(b"\1")
    h.update(ints.astype("<i8", copy=False).tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Manifest:
    """The usable utterances of one cache directory.

    ``frames`` and ``token_counts`` are read-only int64 arrays [N], built once in
    ``__post_init__`` (no ``slots``: a frozen slots class cannot cache derived arrays as simply).
    """

    cache_dir: Path
    n_mels: int
    utterances: tuple[Utterance, ...] = field(repr=False)  # sorted by id, ids unique
    fingerprint: str = field(init=False)  # 16 hex chars; computed, never passed in
    # [6, N] int64, read-only: frames, tokens, mel_offset, mel_file_bytes, tok_offset, tok_file_bytes
    _ints: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.utterances)
        columns = list(zip(*self.utterances)) if n else [()] * len(_COLUMNS)
        ids, mel_dtypes = columns[0], columns[3]
        if any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError("utterances must be sorted by id with no duplicates")
        ints = np.array([columns[i] for i in (1, 2, 4, 5, 6, 7)], dtype=np.int64).reshape(6, n)
        ints.setflags(write=False)
        object.__setattr__(self, "_ints", ints)
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        object.__setattr__(self, "fingerprint", _fingerprint(self.n_mels, ids, mel_dtypes, ints))

    def __len__(self) -> int:
        return len(self.utterances)

    @property
    def frames(self) -> npt.NDArray[np.int64]:
        """Mel frames per utterance, int64 [N], read-only."""
        frames: npt.NDArray[np.int64] = self._ints[0]
        return frames

    @property
    def token_counts(self) -> npt.NDArray[np.int64]:
        """Tokens per utterance, int64 [N], read-only."""
        counts: npt.NDArray[np.int64] = self._ints[1]
        return counts

    def mel_path(self, i: int) -> Path:
        """Path of utterance ``i``'s mel file."""
        return self.cache_dir / "mels" / f"{self.utterances[i].id}.npy"

    def tokens_path(self, i: int) -> Path:
        """Path of utterance ``i``'s token file."""
        return self.cache_dir / "tokens" / f"{self.utterances[i].id}.npy"


def _list_npy(directory: Path) -> dict[str, Path]:
    if not directory.is_dir():
        raise CacheError(directory, "missing directory")
    with os.scandir(directory) as entries:
        return {e.name[:-4]: Path(e.path) for e in entries
                if e.name.endswith(".npy") and len(e.name) > 4 and e.is_file()}


def _check_mel(header: NpyHeader, n_mels: int) -> str | None:
    if len(header.shape) != 2:
        return f"expected rank 2 [frames, n_mels], got shape {header.shape}"
    if header.shape[1] != n_mels:
        return f"expected n_mels={n_mels} in shape [frames, n_mels], got shape {header.shape}"
    if header.dtype not in _MEL_DTYPES:
        return f"mel dtype {header.dtype.str} not allowed (little-endian float32 or float16)"
    if header.shape[0] == 0:
        return "zero frames"
    return None


def _check_tokens(header: NpyHeader) -> str | None:
    if len(header.shape) != 1:
        return f"expected rank 1 [tokens], got shape {header.shape}"
    if header.dtype != _TOKEN_DTYPE:
        return f"token dtype {header.dtype.str} not allowed (little-endian int32)"
    if header.shape[0] == 0:
        return "zero tokens"
    return None


def _inspect(path: Path, problems: list[CacheProblem]) -> tuple[NpyHeader, int] | None:
    try:
        return inspect_npy(path)
    except CacheError as err:
        problems.append(CacheProblem(err.path, err.reason))
        return None


def _index_one(uid: str, mel: Path, tok: Path, n_mels: int,
               problems: list[CacheProblem]) -> Utterance | None:
    mel_info, tok_info = _inspect(mel, problems), _inspect(tok, problems)
    mel_bad = _check_mel(mel_info[0], n_mels) if mel_info else None
    tok_bad = _check_tokens(tok_info[0]) if tok_info else None
    if mel_bad:
        problems.append(CacheProblem(str(mel), mel_bad))
    if tok_bad:
        problems.append(CacheProblem(str(tok), tok_bad))
    if mel_info is None or tok_info is None or mel_bad or tok_bad:
        return None
    (mh, mel_bytes), (th, tok_bytes) = mel_info, tok_info
    return Utterance(uid, mh.shape[0], th.shape[0], _MEL_DTYPES[mh.dtype],
                     mh.data_offset, mel_bytes, th.data_offset, tok_bytes)


def build_manifest(
    cache_dir: str | os.PathLike[str],
    n_mels: int = 80,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Manifest, list[CacheProblem]]:
    """Index a cache directory by reading every file's ``.npy`` header (never its data).

    Args:
        cache_dir: Directory holding ``mels/`` and ``tokens/``.
        n_mels: Required last dimension of every mel file.
        progress: Called as ``progress(done, total)`` after each utterance id.

    Returns:
        ``(manifest, problems)``: the usable utterances, and one ``CacheProblem`` per bad or
        unpaired file (its utterance is left out). An all-bad cache gives an empty manifest;
        the caller decides whether that is fatal.

    Raises:
        CacheError: ``mels/`` or ``tokens/`` is missing, or neither holds any ``.npy`` file.
    """
    root = Path(cache_dir)
    mels, toks = _list_npy(root / "mels"), _list_npy(root / "tokens")
    if not mels and not toks:
        raise CacheError(root, "empty cache: no .npy files in mels/ or tokens/")
    ids = sorted(mels.keys() | toks.keys())
    problems: list[CacheProblem] = []
    utterances: list[Utterance] = []
    for done, uid in enumerate(ids, 1):
        mel, tok = mels.get(uid), toks.get(uid)
        if tok is None and mel is not None:
            problems.append(CacheProblem(str(mel), f"no matching tokens/{uid}.npy"))
        elif mel is None and tok is not None:
            problems.append(CacheProblem(str(tok), f"no matching mels/{uid}.npy"))
        elif mel is not None and tok is not None:
            utt = _index_one(uid, mel, tok, n_mels, problems)
            if utt is not None:
                utterances.append(utt)
        if progress is not None:
            progress(done, len(ids))
    manifest = Manifest(root, n_mels, tuple(utterances))
    log.info("indexed cache=%s utterances=%d problems=%d fingerprint=%s",
             root, len(utterances), len(problems), manifest.fingerprint)
    return manifest, problems


def write_manifest(manifest: Manifest) -> Path:
    """Write ``CACHE/manifest.json`` atomically (temp file in the same dir, fsync, rename).

    Returns:
        The manifest's path.
    """
    path = manifest.cache_dir / MANIFEST_NAME
    doc = {
        "format": MANIFEST_FORMAT,
        "n_mels": manifest.n_mels,
        "fingerprint": manifest.fingerprint,
        "columns": list(_COLUMNS),
        "utterances": manifest.utterances,  # NamedTuples encode as JSON arrays
    }
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=manifest.cache_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(manifest.cache_dir, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def _check_column_types(rows: list[Any], path: Path) -> list[tuple[Any, ...]]:
    """Check every row is a list of 8 values of the column's exact type; return the columns."""
    width = len(_COLUMNS)
    if set(map(type, rows)) - {list} or set(map(len, rows)) - {width}:
        raise CacheError(path, f"malformed manifest: each utterance must be a list of {width}")
    columns = list(zip(*rows)) if rows else [()] * len(_COLUMNS)
    for name, column, want in zip(_COLUMNS, columns, _ROW_TYPES):
        if set(map(type, column)) - {want}:
            raise CacheError(
                path, f"malformed manifest: column {name} must hold only {want.__name__}")
    return columns


def _check_ids(ids: tuple[str, ...], mel_dtypes: tuple[str, ...], path: Path) -> None:
    bad_id = next(filter(_BAD_ID.search, ids), None)  # ids become file names: no traversal
    if bad_id is not None:
        raise CacheError(path, f"bad utterance id {bad_id!r}")
    if set(mel_dtypes) - _MEL_ITEMSIZE.keys():
        raise CacheError(path, "malformed manifest: mel_dtype must be float32 or float16")


def _check_sizes(manifest: Manifest, rows: list[Any], path: Path) -> None:
    """Lengths >= 1, offsets >= 0, each file big enough for its data; vectorised over all rows."""
    frames, tokens, mel_off, mel_bytes, tok_off, tok_bytes = manifest._ints
    itemsize = np.array([_MEL_ITEMSIZE[u.mel_dtype] for u in manifest.utterances], dtype=np.int64)
    ok = ((frames >= 1) & (tokens >= 1) & (mel_off >= 0) & (tok_off >= 0)
          & (mel_bytes >= mel_off + frames * manifest.n_mels * itemsize)
          & (tok_bytes >= tok_off + tokens * 4))
    if not ok.all():
        raise CacheError(path, f"malformed manifest row {str(rows[int(np.argmin(ok))])[:80]}")


def _parse_doc(doc: Any, path: Path) -> tuple[int, list[Any], str]:
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise CacheError(path, f"unsupported manifest format {got!r}, expected {MANIFEST_FORMAT}")
    if doc.get("columns") != list(_COLUMNS):
        raise CacheError(path, "malformed manifest: unexpected columns")
    n_mels, rows, stored = doc.get("n_mels"), doc.get("utterances"), doc.get("fingerprint")
    if type(n_mels) is not int or n_mels < 1:
        raise CacheError(path, f"malformed manifest: n_mels={n_mels!r}")
    if not isinstance(rows, list) or not isinstance(stored, str):
        raise CacheError(path, "malformed manifest: missing utterances or fingerprint")
    return n_mels, rows, stored


def load_manifest(cache_dir: str | os.PathLike[str], n_mels: int | None = None) -> Manifest:
    """Load and verify ``CACHE/manifest.json``.

    Args:
        cache_dir: The cache directory; the manifest's paths resolve against it (so a copied
            cache works without re-indexing).
        n_mels: If given, the manifest must have been built with this ``n_mels``.

    Raises:
        CacheError: No manifest, malformed JSON or rows, a fingerprint that does not match the
            rows, or a different ``n_mels``.
    """
    root = Path(cache_dir)
    path = root / MANIFEST_NAME
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError as err:
        raise CacheError(path, "no manifest; run `python run_pipeline.py index DIR` first") from err
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CacheError(path, f"malformed manifest: {err}".replace("\n", " ")) from err
    file_n_mels, rows, stored = _parse_doc(doc, path)
    columns = _check_column_types(rows, path)
    _check_ids(columns[0], columns[3], path)
    try:
        manifest = Manifest(root, file_n_mels, tuple(map(Utterance._make, rows)))
    except OverflowError as err:
        raise CacheError(path, "malformed manifest: integer out of range") from err
    except ValueError as err:
        raise CacheError(path, f"malformed manifest: {err}") from err
    _check_sizes(manifest, rows, path)
    if manifest.fingerprint != stored:
        raise CacheError(path, "fingerprint mismatch (manifest edited?)")
    if n_mels is not None and n_mels != file_n_mels:
        raise CacheError(path, f"manifest has n_mels={file_n_mels}, config says {n_mels}")
    return manifest
