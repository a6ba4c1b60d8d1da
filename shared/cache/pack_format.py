"""The packed cache: every utterance's arrays back to back in one file, a row read in one piece.

Role: the per-file cache costs a producer four ``preadv`` (mel, tokens, each extra), an open-file
lookup and a header compare per file of every row, plus an ``open``/``fstat`` and a NaN/Inf scan the
first time a process meets a file. ``melfeed pack`` (``shared/cache/pack_write.py``) copies a
cache's data, checked once, into ``CACHE/melfeed-<mel_dtype>.pack``; a producer then reads a whole row
(mel, tokens and extras) out of one mapping of it, or with one ``preadv`` (``producer/pack/reader.py``).

File layout (all integers little-endian):
- bytes 0..24: ``MAGIC`` (8 bytes), then the JSON header's offset and length (two uint64);
- from ``DATA_OFFSET``: one record per manifest utterance, in manifest order, with no gaps. A record is
  the utterance's mel data (``frames x n_mels`` of the pack's ``mel_dtype``), its token ids (int32), then
  each extra's data in manifest order (the ``.npy`` file's data bytes). Record sizes follow from the
  manifest alone (``PackLayout``), so no per-record index is stored;
- after the records: the JSON header (``PackHeader``): format version, the manifest's fingerprint, the
  mel dtype, the data size, a digest of every source file's size and mtime (``sources_digest``) and the
  rows that failed their checks at pack time (``bad``: index -> [path, reason]), whose records are zeros.

Invariants:
- A pack is usable only for the manifest it was written from (same fingerprint) and only while no
  source file changed since (same sources digest, checked by ``open_pack`` at producer start); then
  its bytes are the source files' data exactly (a float16 pack: the float32 values rounded as numpy
  casts them). Anything else is ``PackUnusable`` naming the reason; the caller reads the ``.npy`` files.
- Changes to the source files after a producer opened the pack are not seen by that producer (a
  new ``pack`` replaces the file by rename: open readers keep the old, consistent one).
Shutdown: ``PackFile.close()`` closes the descriptor; idempotent.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.shared.cache.filekind import open_regular
from melfeed.shared.cache.manifest import MEL_DTYPES, TOKEN_DTYPE, Manifest

__all__ = [
    "MAGIC",
    "DATA_OFFSET",
    "FORMAT_VERSION",
    "PackLayout",
    "PackHeader",
    "PackFile",
    "PackUnusable",
    "pack_path",
    "source_paths",
    "stat_source",
    "sources_digest",
    "open_pack",
]

MAGIC = b"MELPACK\x01"
FORMAT_VERSION = 1
DATA_OFFSET = 4096  # records start page-aligned
_PREAMBLE = struct.Struct("<8sQQ")  # magic, header offset, header length
_MAX_HEADER_BYTES = 64 << 20  # a header beyond this is not ours (bad rows of a huge cache fit)


class PackUnusable(Exception):
    """The pack cannot serve this manifest (missing, stale, foreign or damaged); ``str`` says why."""


def pack_path(cache_dir: str | os.PathLike[str], mel_dtype: str) -> Path:
    """Where a cache's pack of ``mel_dtype`` mels lives: ``CACHE/melfeed-<mel_dtype>.pack``."""
    return Path(cache_dir) / f"melfeed-{mel_dtype}.pack"


@dataclass(frozen=True, slots=True)
class PackLayout:
    """Byte sizes of every record's parts, from the manifest: ``parts[i]`` = (mel, tokens, *extras)."""

    mel_dtype: str
    parts: npt.NDArray[np.int64]  # [N, 2 + extras]
    offsets: npt.NDArray[np.int64]  # [N] absolute file offset of each record
    data_bytes: int

    @staticmethod
    def of(manifest: Manifest, mel_dtype: str) -> PackLayout:
        n = len(manifest)
        columns = [
            manifest.frames * (manifest.n_mels * MEL_DTYPES[mel_dtype].itemsize),
            manifest.token_counts * TOKEN_DTYPE.itemsize,
        ]
        columns += [c.rows[:, 2] - c.rows[:, 1] for c in manifest.extras]  # file bytes - data offset
        parts = np.stack(columns, axis=1).astype(np.int64) if n else np.zeros((0, len(columns)), np.int64)
        sizes = parts.sum(axis=1)
        offsets = DATA_OFFSET + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if n else sizes
        return PackLayout(mel_dtype, parts, offsets, int(sizes.sum()))


def source_paths(manifest: Manifest, index: int) -> list[str]:
    """The files utterance ``index``'s record is made of, in record order."""
    paths = [str(manifest.mel_path(index)), str(manifest.tokens_path(index))]
    return paths + [str(manifest.extra_path(c.spec.name, index)) for c in manifest.extras]


def sources_digest(stats: list[tuple[int, int]]) -> str:
    """Digest of every source file's (size, mtime_ns), in record order: any rewrite changes it."""
    h = hashlib.sha256()
    for size, mtime_ns in stats:
        h.update(b"%d:%d\n" % (size, mtime_ns))
    return h.hexdigest()


def stat_source(path: str) -> tuple[int, int]:
    """A source file's (size, mtime_ns) for the digest; (-1, -1) when it cannot be stat'ed (missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)  # a bad row's missing file: its appearing later changes the digest
    return st.st_size, st.st_mtime_ns


def _stat_sources(manifest: Manifest) -> list[tuple[int, int]]:
    return [stat_source(path) for i in range(len(manifest)) for path in source_paths(manifest, i)]


@dataclass(frozen=True, slots=True)
class PackHeader:
    """The pack's JSON header (see the module docstring)."""

    fingerprint: str
    mel_dtype: str
    data_bytes: int
    sources: str
    bad: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (source path, reason)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "mel_dtype": self.mel_dtype,
                "data_bytes": self.data_bytes,
                "sources": self.sources,
                "bad": {str(i): list(v) for i, v in sorted(self.bad.items())},
            }
        ).encode()

    @staticmethod
    def from_json(raw: bytes) -> PackHeader:
        try:
            doc: Any = json.loads(raw)
            if doc["version"] != FORMAT_VERSION:
                raise PackUnusable(f"format version {doc['version']}, this melfeed reads {FORMAT_VERSION}")
            bad = {int(i): (str(v[0]), str(v[1])) for i, v in doc["bad"].items()}
            return PackHeader(
                str(doc["fingerprint"]), str(doc["mel_dtype"]), int(doc["data_bytes"]), str(doc["sources"]), bad
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as err:
            raise PackUnusable(f"malformed header ({type(err).__name__})") from err


def preamble(header_bytes: int, data_bytes: int) -> bytes:
    """The first bytes of a pack whose header (``header_bytes`` long) follows ``data_bytes`` of records."""
    return _PREAMBLE.pack(MAGIC, DATA_OFFSET + data_bytes, header_bytes)


@dataclass(slots=True)
class PackFile:
    """An open pack checked against its manifest: descriptor, path, header and layout."""

    fd: int
    path: Path
    header: PackHeader
    layout: PackLayout

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_pack(manifest: Manifest, mel_dtype: str, path: Path | None = None) -> PackFile:
    """Open ``path`` (default ``pack_path``) and check it serves ``manifest`` with ``mel_dtype`` mels.

    Raises:
        PackUnusable: missing, not a regular file, not a pack, damaged, of another manifest or mel
            dtype, or a source file changed since it was written (the reason says which).
    """
    from melfeed.shared.errors import CacheError

    path = path if path is not None else pack_path(manifest.cache_dir, mel_dtype)
    try:
        fd, st = open_regular(path)
    except (CacheError, OSError) as err:
        raise PackUnusable(getattr(err, "reason", None) or str(err)) from err
    try:
        header = _read_header(fd, st.st_size)
        layout = PackLayout.of(manifest, mel_dtype)
        if header.fingerprint != manifest.fingerprint:
            raise PackUnusable(
                f"written for another manifest (fingerprint {header.fingerprint}, the cache's is "
                f"{manifest.fingerprint}): re-run pack"
            )
        if header.mel_dtype != mel_dtype:
            raise PackUnusable(f"holds {header.mel_dtype} mels, transport.mel_dtype is {mel_dtype}")
        if header.data_bytes != layout.data_bytes:
            raise PackUnusable(f"holds {header.data_bytes} data bytes, the manifest needs {layout.data_bytes}")
        if sources_digest(_stat_sources(manifest)) != header.sources:
            raise PackUnusable("a cache file changed since it was written (size or mtime): re-run pack")
        return PackFile(fd, path, header, layout)
    except BaseException:
        os.close(fd)
        raise


def _read_header(fd: int, size: int) -> PackHeader:
    head = os.pread(fd, _PREAMBLE.size, 0)
    if len(head) < _PREAMBLE.size:
        raise PackUnusable("too short to be a pack")
    magic, offset, length = _PREAMBLE.unpack(head)
    if magic != MAGIC:
        raise PackUnusable("not a melfeed pack (bad magic)")
    if length > _MAX_HEADER_BYTES or offset < DATA_OFFSET or offset + length != size:
        raise PackUnusable(f"damaged (header at {offset}+{length}, file is {size} bytes): re-run pack")
    raw = os.pread(fd, length, offset)
    if len(raw) != length:
        raise PackUnusable("damaged (short header read): re-run pack")
    header = PackHeader.from_json(raw)
    if DATA_OFFSET + header.data_bytes != offset:
        raise PackUnusable(f"damaged (data ends at {DATA_OFFSET + header.data_bytes}, header at {offset})")
    return header
