"""The cache manifest: one JSON file listing every usable utterance and where its bytes are.

Cache layout::

    CACHE/mels/<id>.npy     float32 (float16 accepted), shape [frames, n_mels]
    CACHE/tokens/<id>.npy   int32, shape [tokens]
    CACHE/extras/<name>/<id>.npy  optional extra arrays, declared in the manifest (shared/cache/extras.py)
    CACHE/manifest.json     written by ``write_manifest``
    CACHE/features.json     optional, written by ``prepare``: feature parameters + vocabulary
                            (shared/cache/features.py)

Role: the manifest type, its fingerprint, atomic write and distrustful load, and the parsers of the
recorded features and vocabulary. ``shared/cache/index.py`` builds a manifest from the ``.npy`` headers
(never a mel's data) and the token ids, recording each file's data offset and size, so producers can
``preadv`` data straight into batch rows and detect a file changed since indexing.

Invariants:
- ``Manifest.utterances`` is sorted by id, ids are unique, and every listed utterance has a
  valid mel and token file (as of indexing); bad files become ``CacheProblem``s and are left out.
- ``fingerprint`` covers the format version, ``n_mels`` and every utterance row, not
  ``cache_dir``: a copied cache keeps its fingerprint; any changed file changes it. When the
  cache records feature parameters and a vocabulary (``features.json``, copied into the
  manifest by ``cache_index.build_manifest``), the fingerprint covers them too; a cache without them (demo
  data, an adopted cache) hashes without them: its features are unknown and not checked.
  Declared extras (the batch schema) and their rows are covered the same way, only when present, and so
  is ``token_range`` (the smallest and largest token id, which ``index`` records since it reads the
  token files' data): a manifest written before it keeps its fingerprint, and its ids are unchecked.
- ``write_manifest`` is atomic (temp file, fsync, ``os.replace``): readers see old or new,
  never half a file.
- ``load_manifest`` trusts nothing: exact JSON types, safe ids, sizes that fit, int32 token ids, fingerprint.
Shutdown: nothing to shut down; every file opened here is closed before returning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from melfeed.shared.cache.extras import (
    EXTRAS_DIR,
    ExtraColumn,
    check_extra_sizes,
    extras_digest,
    extras_json,
    parse_extras,
)
from melfeed.shared.cache.filekind import read_json, write_atomic
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.schema import ExtraSchema

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "MEL_DTYPES",
    "TOKEN_DTYPE",
    "Utterance",
    "CacheProblem",
    "Manifest",
    "write_manifest",
    "load_manifest",
    "parse_features",
    "parse_vocabulary",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1  # bump when the columns or their meaning change
_COLUMNS = ("id", "frames", "tokens", "mel_dtype", "mel_offset", "mel_file_bytes", "tok_offset", "tok_file_bytes")
_ROW_TYPES = (str, int, int, str, int, int, int, int)  # exact types, so JSON true/1.0 are rejected
_BAD_ID = re.compile(r"\A(?:\.|\Z)|[/\\\x00]")  # empty, hidden/"..", or a path separator or NUL
# The cache's .npy dtypes: a mel file is one of these (by the manifest's mel_dtype), a token file int32.
MEL_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
TOKEN_DTYPE: np.dtype = np.dtype("<i4")
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1  # what a TOKEN_DTYPE id can hold


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


def _fingerprint(
    n_mels: int,
    ids: tuple[str, ...],
    mel_dtypes: tuple[str, ...],
    ints: npt.NDArray[np.int64],
    described: bytes | None,
    extras: bytes | None,
    token_range: tuple[int, int] | None,
) -> str:
    """16 hex chars of sha256 over everything but ``cache_dir``.

    Hashes raw columns (ids and dtypes NUL-joined, NUL being the one character no file name
    holds; integer columns as little-endian int64) rather than JSON: 13k rows hash in ~2 ms.
    ``described`` (canonical JSON of features + vocabulary) is appended only when present, so
    caches without it keep the fingerprint they always had.
    """
    h = hashlib.sha256(f"melfeed-manifest/{MANIFEST_FORMAT}/{n_mels}\0".encode())
    for text in ("\0".join(ids), "\0".join(mel_dtypes)):
        h.update(text.encode("utf-8", "surrogatepass"))  # undecodable file names survive
        h.update(b"\1")
    h.update(ints.astype("<i8", copy=False).tobytes())
    if described is not None:
        h.update(b"\2" + described)
    if extras is not None:
        h.update(b"\3" + extras)
    if token_range is not None:
        h.update(b"\4" + np.array(token_range, dtype="<i8").tobytes())
    return h.hexdigest()[:16]


FeatureItems = tuple[tuple[str, "int | float | str"], ...]


def _describe(features: FeatureItems | None, vocabulary: tuple[str, ...] | None) -> bytes | None:
    if features is None and vocabulary is None:
        return None
    doc = {
        "features": dict(features) if features is not None else None,
        "vocabulary": list(vocabulary) if vocabulary is not None else None,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Manifest:
    """The usable utterances of one cache directory.

    ``frames`` and ``token_counts`` are read-only int64 arrays [N], built once in
    ``__post_init__`` (no ``slots``: a frozen slots class cannot cache derived arrays as simply).
    """

    cache_dir: Path
    n_mels: int
    utterances: tuple[Utterance, ...] = field(repr=False)  # sorted by id, ids unique
    # (name, value) pairs sorted by name (a tuple, so the manifest stays hashable); None = unknown
    features: FeatureItems | None = None
    vocabulary: tuple[str, ...] | None = field(default=None, repr=False)  # index = token id; None = unknown
    extras: tuple[ExtraColumn, ...] = field(default=(), repr=False, compare=False)  # the batch schema's extras
    # (smallest, largest) token id over every utterance, recorded by ``index``; None = not recorded (older manifest)
    token_range: tuple[int, int] | None = None
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
        if self.features is not None:
            items = self.features.items() if isinstance(self.features, Mapping) else self.features
            object.__setattr__(self, "features", tuple(sorted(items)))
        if self.vocabulary is not None:
            object.__setattr__(self, "vocabulary", tuple(self.vocabulary))
        object.__setattr__(self, "extras", tuple(self.extras))
        if self.token_range is not None:
            object.__setattr__(self, "token_range", tuple(self.token_range))
        if any(len(c.rows) != n for c in self.extras):
            raise ValueError("every extra needs one row per utterance")
        object.__setattr__(
            self,
            "fingerprint",
            _fingerprint(
                self.n_mels,
                ids,
                mel_dtypes,
                ints,
                _describe(self.features, self.vocabulary),
                extras_digest(self.extras),
                self.token_range,
            ),
        )

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

    def extra_path(self, name: str, i: int) -> Path:  # utterance i's file of the extra ``name``
        return self.cache_dir / EXTRAS_DIR / name / f"{self.utterances[i].id}.npy"

    @property
    def schema(self) -> ExtraSchema:
        """The declared extras and the lengths that size each sequence extra's buckets."""
        return ExtraSchema(tuple(c.spec for c in self.extras), {c.spec.name: c.rows[:, 0] for c in self.extras})


def parse_features(value: Any, path: Path) -> FeatureItems | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not value or set(map(type, value.values())) - {int, float, str}:
        raise CacheError(path, "malformed features: must map names to numbers or strings")
    return tuple(sorted(value.items()))


def parse_vocabulary(value: Any, path: Path) -> tuple[str, ...] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) < 2
        or set(map(type, value)) - {str}
        or not all(value)
        or len(set(value)) != len(value)
    ):
        raise CacheError(path, "malformed vocabulary: must be a list of >= 2 distinct non-empty strings")
    return tuple(value)


def write_manifest(manifest: Manifest) -> Path:
    """Write ``CACHE/manifest.json`` atomically (temp file in the same dir, fsync, rename).

    Returns:
        The manifest's path.

    Raises:
        CacheError: it cannot be written (read-only cache, a directory named manifest.json, disk full).
    """
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "n_mels": manifest.n_mels,
        "fingerprint": manifest.fingerprint,
        "columns": list(_COLUMNS),
        "utterances": manifest.utterances,  # NamedTuples encode as JSON arrays
    }
    if manifest.features is not None:
        doc["features"] = dict(manifest.features)
    if manifest.vocabulary is not None:
        doc["vocabulary"] = list(manifest.vocabulary)
    if manifest.extras:
        doc["extras"] = extras_json(manifest.extras)
    if manifest.token_range is not None:
        doc["token_range"] = list(manifest.token_range)
    return write_atomic(manifest.cache_dir, MANIFEST_NAME, json.dumps(doc, separators=(",", ":")).encode())


def _check_column_types(rows: list[Any], path: Path) -> list[tuple[Any, ...]]:
    """Check every row is a list of 8 values of the column's exact type; return the columns."""
    width = len(_COLUMNS)
    if set(map(type, rows)) - {list} or set(map(len, rows)) - {width}:
        raise CacheError(path, f"malformed manifest: each utterance must be a list of {width}")
    columns = list(zip(*rows)) if rows else [()] * len(_COLUMNS)
    for name, column, want in zip(_COLUMNS, columns, _ROW_TYPES):
        if set(map(type, column)) - {want}:
            raise CacheError(path, f"malformed manifest: column {name} must hold only {want.__name__}")
    return columns


def _check_ids(ids: tuple[str, ...], mel_dtypes: tuple[str, ...], path: Path) -> None:
    bad_id = next(filter(_BAD_ID.search, ids), None)  # ids become file names: no traversal
    if bad_id is not None:
        raise CacheError(path, f"bad utterance id {bad_id!r}")
    if set(mel_dtypes) - MEL_DTYPES.keys():
        raise CacheError(path, "malformed manifest: mel_dtype must be float32 or float16")


def _check_sizes(manifest: Manifest, rows: list[Any], path: Path) -> None:
    """Lengths >= 1, offsets >= 0, each file big enough for its data; vectorised over all rows."""
    frames, tokens, mel_off, mel_bytes, tok_off, tok_bytes = manifest._ints
    itemsize = np.array([MEL_DTYPES[u.mel_dtype].itemsize for u in manifest.utterances], dtype=np.int64)
    ok = (
        (frames >= 1)
        & (tokens >= 1)
        & (mel_off >= 0)
        & (tok_off >= 0)
        & (mel_bytes >= mel_off + frames * manifest.n_mels * itemsize)
        & (tok_bytes >= tok_off + tokens * TOKEN_DTYPE.itemsize)
    )
    if not ok.all():
        raise CacheError(path, f"malformed manifest row {str(rows[int(np.argmin(ok))])[:80]}")


def _parse_token_range(value: Any, path: Path) -> tuple[int, int] | None:
    """``token_range`` as ``(smallest, largest)``: absent (an older manifest) is None; else two int32s, in order."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or set(map(type, value)) - {int}
        or not _INT32_MIN <= value[0] <= value[1] <= _INT32_MAX
    ):
        raise CacheError(path, "malformed manifest: token_range must be [smallest, largest], two int32 token ids")
    return value[0], value[1]


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

    Feature parameters and vocabulary, when recorded, are loaded (and fingerprinted) but not
    compared with any config here: ``melfeed.shared.cache.features.load_manifest_for`` does that.

    Raises:
        CacheError: No manifest, malformed JSON or rows, a fingerprint that does not match the
            rows, or a different ``n_mels``.
    """
    root = Path(cache_dir)
    path = root / MANIFEST_NAME
    try:
        doc = read_json(path)  # a FIFO or device named manifest.json is refused, never read
    except CacheError as err:
        raise CacheError(
            path, "no manifest; run `melfeed index --cache-dir DIR` first" if err.reason == "missing" else err.reason
        ) from err
    except OSError as err:
        raise CacheError(path, f"cannot read ({err.strerror})") from err
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, "nested too deeply"
        raise CacheError(path, f"malformed manifest: {err}".replace("\n", " ")) from err
    file_n_mels, rows, stored = _parse_doc(doc, path)
    columns = _check_column_types(rows, path)
    _check_ids(columns[0], columns[3], path)
    described = parse_features(doc.get("features"), path), parse_vocabulary(doc.get("vocabulary"), path)
    extras = parse_extras(doc.get("extras"), len(rows), path)
    token_range = _parse_token_range(doc.get("token_range"), path)
    try:
        manifest = Manifest(root, file_n_mels, tuple(map(Utterance._make, rows)), *described, extras, token_range)
    except OverflowError as err:
        raise CacheError(path, "malformed manifest: integer out of range") from err
    except ValueError as err:
        raise CacheError(path, f"malformed manifest: {err}") from err
    _check_sizes(manifest, rows, path)
    check_extra_sizes(manifest.extras, manifest.frames, manifest.token_counts, path)
    if manifest.fingerprint != stored:
        raise CacheError(path, "fingerprint mismatch (manifest edited?)")
    if n_mels is not None and n_mels != file_n_mels:
        raise CacheError(path, f"manifest has n_mels={file_n_mels}, config says {n_mels}")
    return manifest
