"""Extra per-utterance arrays in a cache: their files, their manifest rows and their checks.

Cache layout: ``CACHE/extras/<name>/<id>.npy``, one folder per extra (``index --extra NAME=DIR``
links an existing folder there). The manifest declares each extra and records, per utterance,
where its data is::

    "extras": [{"name": "energy", "kind": "frame", "dtype": "float32", "shape": [],
                "rows": [[length, data_offset, file_bytes], ...]}, ...]     # one row per utterance

``length`` is the file's first axis (``frames`` for a frame extra, ``tokens`` for a token or a
matrix extra, its own length for a sequence) and 0 for an utterance extra. A matrix declares its
frame divisor too (``"divisor": r``: the file is ``[tokens, ceil(frames / r), k...]``); no other kind
has the key. Kinds, shapes and padding: ``shared/wire/schema.py``.

Role: parse and check the ``extras`` of a manifest (one-line errors naming the manifest and the
key, e.g. ``extras[1].kind``), write it, hash it into the fingerprint, and the header rule that
``index`` and ``verify-cache`` share (``check_extra_header``). Indexing an extras folder (with the
kind inferred from the headers when not given) is here too.
Invariants: every manifest utterance has a valid file for every declared extra (as of indexing);
a cache without extras has no ``extras`` key, so its manifest and fingerprint are unchanged.
Shutdown: nothing to shut down; every file opened here is closed before returning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.shared.cache.npyfile import NpyHeader, inspect_npy
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.schema import ExtraSpec, check_declaration, check_schema, parse_kind

__all__ = [
    "EXTRAS_DIR",
    "ExtraColumn",
    "parse_extras",
    "extras_json",
    "extras_digest",
    "check_extra_sizes",
    "check_extra_header",
    "infer_kind",
    "fits_no_kind",
    "index_extra",
    "extra_dirs",
]

EXTRAS_DIR = "extras"
_ROW_WIDTH = 3  # length, data offset, file bytes
_KEYS = {"name", "kind", "dtype", "shape", "rows"}
_MAX_GUESSED_DIVISOR = 16  # divisors tried when suggesting a matrix declaration (reduction factors are small)


@dataclass(frozen=True, eq=False)
class ExtraColumn:
    """One declared extra and its per-utterance rows: int64 [N, 3] (length, data offset, file bytes), read-only."""

    spec: ExtraSpec
    rows: npt.NDArray[np.int64]

    def __post_init__(self) -> None:
        rows = np.array(self.rows, dtype=np.int64).reshape(-1, _ROW_WIDTH)
        rows.setflags(write=False)
        object.__setattr__(self, "rows", rows)


def extra_dirs(root: Path) -> dict[str, Path]:
    """``{name: folder}`` of ``CACHE/extras/*`` (sorted by name); empty when there is none."""
    base = root / EXTRAS_DIR
    if not base.is_dir():
        return {}
    return {p.name: p for p in sorted(base.iterdir()) if p.is_dir()}


def _fail(path: Path, index: int, key: str, reason: str) -> CacheError:
    return CacheError(path, f"malformed manifest: extras[{index}].{key}: {reason}")


def parse_extras(value: Any, n_utterances: int, path: Path) -> tuple[ExtraColumn, ...]:
    """The ``extras`` of a manifest document, checked (declarations, names, row types and count).

    Raises:
        CacheError: one line naming ``path`` and the key (``extras[i].kind`` ...).
    """
    if value is None:
        return ()
    if not isinstance(value, list):
        raise CacheError(path, "malformed manifest: extras: must be a list of declarations")
    specs: list[ExtraSpec] = []
    columns: list[ExtraColumn] = []
    for i, item in enumerate(value):
        is_matrix = isinstance(item, dict) and item.get("kind") == "matrix"
        if not isinstance(item, dict) or set(item) != (_KEYS | {"divisor"} if is_matrix else _KEYS):
            raise CacheError(
                path,
                f"malformed manifest: extras[{i}]: must be a map of exactly "
                "name, kind, dtype, shape, rows (and divisor for a matrix)",
            )
        bad = check_declaration(item["name"], item["kind"], item["dtype"], item["shape"], item.get("divisor", 1))
        if bad is not None:
            raise _fail(path, i, *bad)
        spec = ExtraSpec(item["name"], item["kind"], item["dtype"], tuple(item["shape"]), item.get("divisor", 1))
        rows = item["rows"]
        if not isinstance(rows, list) or len(rows) != n_utterances:
            raise _fail(path, i, "rows", f"must list one row per utterance ({n_utterances})")
        if any(type(r) is not list or len(r) != _ROW_WIDTH or any(type(x) is not int for x in r) for r in rows):
            raise _fail(path, i, "rows", "each row must be [length, data_offset, file_bytes] integers")
        try:
            columns.append(ExtraColumn(spec, np.array(rows, dtype=np.int64).reshape(-1, _ROW_WIDTH)))
        except OverflowError as err:
            raise _fail(path, i, "rows", "integer out of range") from err
        specs.append(spec)
    clash = check_schema(specs)
    if clash is not None:
        raise _fail(path, *clash)
    return tuple(columns)


def extras_json(columns: Sequence[ExtraColumn]) -> list[dict[str, Any]]:
    """The manifest's ``extras`` value (see the module docstring)."""
    return [{**c.spec.as_json(), "rows": c.rows.tolist()} for c in columns]


def extras_digest(columns: Sequence[ExtraColumn]) -> bytes | None:
    """Bytes the fingerprint covers for the extras (declarations + rows); None without extras."""
    if not columns:
        return None
    head = json.dumps([c.spec.as_json() for c in columns], sort_keys=True, separators=(",", ":")).encode()
    return head + b"".join(c.rows.astype("<i8").tobytes() for c in columns)


def check_extra_sizes(
    columns: Sequence[ExtraColumn], frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], path: Path
) -> None:
    """Every row consistent with its kind and the utterance's lengths, and its file big enough."""
    for i, c in enumerate(columns):
        length, offset, nbytes = c.rows.T
        spec = c.spec
        item = int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
        # bytes per first-axis row: a matrix's row is one token's ceil(frames / r) columns
        per_row = item * (-(-frames // spec.divisor)) if spec.kind == "matrix" else np.full_like(length, item)
        want = {"frame": frames, "token": tokens, "utterance": np.zeros_like(length), "matrix": tokens}.get(spec.kind)
        ok = (offset >= 0) & (nbytes >= offset + np.maximum(length, 1) * per_row)
        ok &= (length >= 1) if want is None else (length == want)
        if not ok.all():
            row = int(np.argmin(ok))
            raise _fail(
                path,
                i,
                "rows",
                f"row {row} {c.rows[row].tolist()} does not fit a {spec.kind} extra "
                f"(utterance frames {int(frames[row])}, tokens {int(tokens[row])})",
            )


def check_extra_header(spec: ExtraSpec, header: NpyHeader, frames: int, tokens: int) -> str | None:
    """Why an extra's ``.npy`` header does not fit its declaration and utterance (one line), or None."""
    if header.dtype != np.dtype(spec.dtype).newbyteorder("<"):
        return f"dtype {header.dtype.str}, declared {spec.dtype} (little-endian)"
    shape = header.shape
    if spec.kind == "matrix":
        want_shape = spec.file_shape(tokens, frames)
        if shape != want_shape:
            return (
                f"shape {shape}, a matrix of this utterance is {want_shape} ({tokens} tokens, "
                f"ceil({frames} frames / {spec.divisor}) columns)"
            )
        return None
    if spec.has_length and (len(shape) != 1 + len(spec.shape) or shape[1:] != spec.shape):
        return f"shape {shape}, declared [n, {', '.join(map(str, spec.shape))}]".replace(", ]", "]")
    if not spec.has_length and shape != spec.shape:
        return f"shape {shape}, declared {list(spec.shape)} (one value per utterance)"
    want = {"frame": ("frames", frames), "token": ("tokens", tokens)}.get(spec.kind)
    if want is not None and shape[0] != want[1]:
        return f"{spec.kind} extra has {shape[0]} rows, the utterance has {want[1]} {want[0]}"
    if spec.kind == "sequence" and shape[0] == 0:
        return "empty sequence"
    return None


def infer_kind(headers: Sequence[NpyHeader], frames: Sequence[int], tokens: Sequence[int]) -> str:
    """The kind a set of headers says: frame, token, utterance (one shape everywhere) or sequence."""
    shapes = [h.shape for h in headers]
    lead = [s[0] if s else -1 for s in shapes]
    if all(s for s in shapes) and len({s[1:] for s in shapes}) == 1:
        if lead == list(frames):
            return "frame"
        if lead == list(tokens):
            return "token"
    if len(set(shapes)) == 1:
        return "utterance"
    return "sequence"


def fits_no_kind(name: str, headers: Sequence[NpyHeader], frames: Sequence[int], tokens: Sequence[int]) -> str | None:
    """One line when inferred files are matrices (two ragged axes), naming the declaration that fits; else None.

    A matrix (``[tokens, ceil(frames / r), ...]``) has two ragged axes, so no 1-axis kind holds it and every file
    would be listed as bad: this says so once. Files count as such when each one's rows are its utterance's tokens
    and the second axis is ``ceil(frames / r)`` for one ``r`` up to 16, or varies in most files (a few files
    with another trailing shape are still listed one by one, as bad files of a 1-axis kind).
    """
    shapes = [h.shape for h in headers]
    if not all(len(s) >= 2 and s[0] == t for s, t in zip(shapes, tokens)) or len({s[2:] for s in shapes}) != 1:
        return None
    if len({s[1] for s in shapes}) == 1:
        return None  # one trailing shape: a token extra
    fit = next(
        (r for r in range(1, _MAX_GUESSED_DIVISOR + 1) if all(s[1] == -(-f // r) for s, f in zip(shapes, frames))), None
    )
    if fit is None and len({s[1] for s in shapes}) <= len(shapes) // 2:
        return None
    kind = "matrix" if fit == 1 else f"matrix/{fit}" if fit else "matrix/R"
    return (
        f"extra {name!r}: {shapes[0]} has two ragged axes (rows = the utterance's tokens, columns vary with its "
        f"frames), which no 1-axis kind holds: declare it --extra {name}:{kind}=DIR"
        + ("" if fit else " (R = frames per column: ceil(frames / R) columns)")
    )


def index_extra(
    name: str, folder: Path, ids: Sequence[str], frames: Sequence[int], tokens: Sequence[int], kind: str | None
) -> tuple[ExtraColumn | None, dict[str, tuple[str, str]]]:
    """Index one extras folder for the utterances ``ids``.

    Args:
        kind: the declared kind (``matrix/R`` with a divisor); None = infer it from the headers (``infer_kind``;
            matrices, which no inferred kind fits, are one ``CacheError`` line, ``fits_no_kind``).

    Returns:
        ``(column, problems)``: the column (None when no file is usable or the declaration is bad)
        and ``{utterance id: (path, reason)}`` for each utterance whose file is bad or missing.

    Raises:
        CacheError: the folder's name or its files' common dtype/shape cannot be declared.
    """
    problems: dict[str, tuple[str, str]] = {}
    found: dict[str, tuple[NpyHeader, int]] = {}
    for uid in ids:
        path = folder / f"{uid}.npy"
        try:
            found[uid] = inspect_npy(path)
        except CacheError as err:
            problems[uid] = (str(err.path), err.reason)
    pos = {uid: i for i, uid in enumerate(ids)}
    heads = [found[u][0] for u in ids if u in found]
    if not heads:
        return None, problems
    dtypes = {h.dtype.str for h in heads}
    first = heads[0]
    divisor = 1
    if kind is None:
        present = [pos[u] for u in ids if u in found]
        f_present, t_present = [frames[i] for i in present], [tokens[i] for i in present]
        no_kind = fits_no_kind(name, heads, f_present, t_present)
        if no_kind is not None:
            raise CacheError(folder, no_kind)
        kind = infer_kind(heads, f_present, t_present)
    else:
        kind, divisor = parse_kind(kind) or (kind, 1)  # a bad kind is named by check_declaration below
    lead = {"utterance": 0, "matrix": 2}.get(kind, 1)
    trailing = first.shape[lead:]
    dtype = np.dtype(first.dtype).name if first.dtype.byteorder in "<|=" else first.dtype.str
    bad = check_declaration(name, kind, dtype, list(trailing), divisor)
    if bad is not None or len(dtypes) > 1:
        why = f"{bad[0]} {bad[1]}" if bad is not None else f"files disagree on dtype: {sorted(dtypes)}"
        raise CacheError(folder, f"extra {name!r} cannot be declared: {why}")
    spec = ExtraSpec(name, kind, dtype, tuple(trailing), divisor)
    rows = np.zeros((len(ids), _ROW_WIDTH), dtype=np.int64)
    for uid, (header, nbytes) in found.items():
        i = pos[uid]
        reason = check_extra_header(spec, header, frames[i], tokens[i])
        if reason is not None:
            problems[uid] = (str(folder / f"{uid}.npy"), reason)
            continue
        rows[i] = (header.shape[0] if spec.has_length else 0, header.data_offset, nbytes)
    return ExtraColumn(spec, rows), problems
