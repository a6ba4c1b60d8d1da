"""Parse ``.npy`` headers without numpy's loader.

Role: the indexer reads every cache file's header once, and the producer then reads data
straight into batch rows at the recorded ``data_offset``. Both need the header parsed exactly,
never assuming numpy's usual 128-byte header (long shapes and format 2.0/3.0 change its length).

Invariants:
- ``parse_npy_header`` is pure: bytes in, ``NpyHeader`` out, no I/O.
- Header text is never ``eval``-ed. The exact layout numpy writes is matched by a strict regex
  (about 10x cheaper than ``ast.literal_eval``, which dominated index time); anything else,
  including every unusual-but-valid header, goes through ``ast.literal_eval``. The regex only
  accepts text that ``literal_eval`` reads identically (tests check both paths agree).
- Every rejection raises ``CacheError(path, reason)``: one line that names the file.
- Accepted headers describe a plain (non-structured, non-object) C-ordered array, so the data
  is ``nbytes`` contiguous bytes starting at ``data_offset``.
Shutdown: nothing to shut down; every file opened here is closed before returning.
"""

from __future__ import annotations

import ast
import logging
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from melfeed.shared.cache.filekind import open_regular
from melfeed.shared.errors import CacheError

__all__ = ["NPY_MAGIC", "NpyHeader", "parse_npy_header", "inspect_npy"]

log = logging.getLogger(__name__)

NPY_MAGIC = b"\x93NUMPY"
_PREAMBLE_BYTES = 12  # magic(6) + version(2) + header length (2 for v1.0, 4 for v2.0/3.0)
_HEADER_KEYS = frozenset({"descr", "fortran_order", "shape"})
# version -> (bytes of the header-length field, text encoding of the header dict)
_VERSIONS: dict[tuple[int, int], tuple[int, str]] = {
    (1, 0): (2, "latin1"),
    (2, 0): (4, "latin1"),
    (3, 0): (4, "utf8"),
}

_DIM = r"(?:0|[1-9][0-9]*)"  # literal_eval rejects leading zeros, so the fast path must too
# The dict exactly as numpy's ``_write_array_header`` formats it, padded with spaces and "\n".
_CANONICAL = re.compile(
    r"\{'descr': '([<>|=]?[A-Za-z][0-9]*)', 'fortran_order': (False|True), "
    rf"'shape': \((|{_DIM},|{_DIM}(?:, {_DIM})+)\), \}} *\n?"
)


@dataclass(frozen=True, slots=True)
class NpyHeader:
    """What a ``.npy`` header says about the array that follows it."""

    version: tuple[int, int]  # (major, minor) format version
    dtype: np.dtype  # from the header ``descr``; never structured or object
    shape: tuple[int, ...]  # every dim >= 0
    fortran_order: bool  # always False for accepted headers
    data_offset: int  # byte offset of the first data byte

    @property
    def nbytes(self) -> int:
        """Size of the array data in bytes: ``prod(shape) * itemsize``."""
        return math.prod(self.shape) * self.dtype.itemsize


def _header_span(prefix: bytes, path: str | os.PathLike[str]) -> tuple[tuple[int, int], int, int]:
    """Decode magic, version and header length from the file's first bytes.

    Returns:
        ``(version, text_start, data_offset)``; the header text is
        ``prefix[text_start:data_offset]``.
    """
    if len(prefix) < 8:
        raise CacheError(path, "truncated header")
    if prefix[:6] != NPY_MAGIC:
        raise CacheError(path, "not a .npy file (bad magic)")
    version = (prefix[6], prefix[7])
    spec = _VERSIONS.get(version)
    if spec is None:
        raise CacheError(path, f"unsupported .npy format version {version[0]}.{version[1]}")
    len_bytes = spec[0]
    text_start = 8 + len_bytes
    if len(prefix) < text_start:
        raise CacheError(path, "truncated header")
    header_len = int.from_bytes(prefix[8:text_start], "little")
    return version, text_start, text_start + header_len


def _parse_dict(text: str, path: str | os.PathLike[str]) -> dict[str, object]:
    match = _CANONICAL.fullmatch(text)
    if match is not None:
        descr, fortran, dims = match.groups()
        shape = tuple(int(d) for d in dims.rstrip(",").split(", ")) if dims else ()
        return {"descr": descr, "fortran_order": fortran == "True", "shape": shape}
    return _literal_dict(text, path)


def _literal_dict(text: str, path: str | os.PathLike[str]) -> dict[str, object]:
    try:
        value = ast.literal_eval(text.strip())
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as err:
        raise CacheError(path, f"malformed header ({type(err).__name__})") from err
    if not isinstance(value, dict):
        raise CacheError(path, f"malformed header (a {type(value).__name__}, not a dict)")
    if set(value) != _HEADER_KEYS:
        keys = sorted(map(str, value))
        raise CacheError(path, f"malformed header (keys {keys}, expected descr/fortran_order/shape)")
    return value


def _parse_dtype(descr: object, path: str | os.PathLike[str]) -> np.dtype:
    if not isinstance(descr, str):
        raise CacheError(path, f"structured dtype not allowed (descr is a {type(descr).__name__})")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError) as err:
        raise CacheError(path, f"bad dtype descr {descr!r}") from err
    if dtype.hasobject:
        raise CacheError(path, "object dtype not allowed")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise CacheError(path, f"structured dtype not allowed ({descr!r})")
    return dtype


def _parse_shape(shape: object, path: str | os.PathLike[str]) -> tuple[int, ...]:
    if not isinstance(shape, tuple):
        raise CacheError(path, f"shape must be a tuple, got {shape!r}")
    for dim in shape:
        # bool is an int subclass; a shape of (True,) is as malformed as ("3",).
        if type(dim) is not int:
            raise CacheError(path, f"shape dims must be ints, got {shape!r}")
        if dim < 0:
            raise CacheError(path, f"negative dimension in shape {shape!r}")
    return shape


def parse_npy_header(prefix: bytes, path: str | os.PathLike[str]) -> NpyHeader:
    """Parse a ``.npy`` header from the first bytes of a file.

    Args:
        prefix: The file's first bytes; at least ``data_offset`` of them (more is fine).
        path: The file the bytes came from; used only in error messages.

    Returns:
        The parsed header.

    Raises:
        CacheError: Bad magic, unsupported version, too few bytes, a malformed header dict,
            structured or object dtype, Fortran order, or a bad shape.
    """
    version, text_start, data_offset = _header_span(prefix, path)
    if len(prefix) < data_offset:
        raise CacheError(path, "truncated header")
    encoding = _VERSIONS[version][1]
    try:
        text = bytes(prefix[text_start:data_offset]).decode(encoding)
    except UnicodeDecodeError as err:
        raise CacheError(path, f"header is not valid {encoding}") from err
    header = _parse_dict(text, path)
    dtype = _parse_dtype(header["descr"], path)
    fortran_order = header["fortran_order"]
    if not isinstance(fortran_order, bool):
        raise CacheError(path, f"fortran_order must be a bool, got {fortran_order!r}")
    if fortran_order:
        raise CacheError(path, "Fortran order not supported")
    shape = _parse_shape(header["shape"], path)
    return NpyHeader(version, dtype, shape, fortran_order, data_offset)


def inspect_npy(path: str | os.PathLike[str]) -> tuple[NpyHeader, int]:
    """Read a ``.npy`` file's header (and only its header) and check the data is all there.

    Two reads: the 12-byte preamble, then exactly the header bytes.

    Args:
        path: The ``.npy`` file.

    Returns:
        ``(header, file_bytes)``: the parsed header and the file's size in bytes.

    Raises:
        CacheError: The header is bad, or the file is shorter than ``data_offset + nbytes``.
            Also raised (chained) when the file is missing or cannot be read, and for an entry
            that is not a regular file (``not a regular file (fifo)``; see ``melfeed.shared.cache.filekind``).
    """
    try:
        fd, st = open_regular(path)  # never blocks on a FIFO; refuses devices and directories
    except OSError as err:
        raise CacheError(path, f"cannot open ({err.strerror})") from err
    try:
        preamble = os.pread(fd, _PREAMBLE_BYTES, 0)
        _, _, data_offset = _header_span(preamble, path)
        prefix = os.pread(fd, data_offset, 0) if data_offset > len(preamble) else preamble
        header = parse_npy_header(prefix, path)
        file_bytes = st.st_size
    except OSError as err:
        raise CacheError(path, f"cannot read ({err.strerror})") from err
    finally:
        os.close(fd)
    have = file_bytes - header.data_offset
    if have < header.nbytes:
        raise CacheError(path, f"truncated: {have} data bytes, expected {header.nbytes}")
    return header, file_bytes
