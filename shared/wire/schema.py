"""The batch schema: the extra per-utterance arrays a cache may carry beside mel and tokens.

Role: the one definition of an extra array's declaration (name, dtype, kind, trailing shape), of
the shape it takes in a bucket, of the keys and dtypes it adds to a batch, and of how one row is
padded. The manifest declares the extras (``shared/cache/extras.py``); both sides build the same
``Bucket`` shapes from it (``shared/wire/buckets.py``), so the layout of a slot, the payload frames
and the step's inputs all follow the manifest.

Kinds (``T``, ``L``: the bucket's padded frames and tokens; ``S``: the bucket's padded length of
that sequence; ``r``: a matrix's frame divisor; ``k...``: the declared trailing ``shape``):

========== ======================= ============================ ======================================
kind       file ``<id>.npy``       batch array                  padding
========== ======================= ============================ ======================================
frame      ``[frames, k...]``      ``[B, T, k...]``             cut to ``T`` with the mel, zeros after
token      ``[tokens, k...]``      ``[B, L, k...]``             cut to ``L`` with the tokens, zeros after
utterance  ``[k...]``              ``[B, k...]``                none (padding rows are zeros)
sequence   ``[n, k...]``           ``[B, S, k...]`` and         zeros after ``n``; ``S`` = the longest
                                   ``<name>_len`` ``[B]``       ``n`` in the bucket; ``<name>_len`` = n
matrix     ``[tokens,              ``[B, L, ceil(T/r), k...]``  both axes cut with the tokens and the
           ceil(frames/r), k...]``                              mel, zeros after (guided attention)
========== ======================= ============================ ======================================

Invariants: batch keys are the base keys (``ARRAY_KEYS``) then each extra in declaration order
(a sequence followed by its ``<name>_len``); names never collide with a base key, a derived input
(``frames``, ``batch_id``, ``rows``, ``row_mask``) or another extra's length key. A padding row and
a quarantined row are zeros in every extra.
Shutdown: nothing to release; values and pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.shared.wire.layout import ARRAY_KEYS

__all__ = [
    "KINDS",
    "EXTRA_DTYPES",
    "RESERVED_NAMES",
    "LENGTH_DTYPE",
    "ExtraSpec",
    "ExtraSchema",
    "check_declaration",
    "check_schema",
    "parse_kind",
    "row_shape",
    "pad_row",
]

KINDS = ("frame", "token", "utterance", "sequence", "matrix")
EXTRA_DTYPES = ("float32", "float16", "int64", "int32", "int16", "int8", "uint8")  # little-endian in files
RESERVED_NAMES = frozenset({*ARRAY_KEYS, "frames", "batch_id", "rows", "row_mask"})  # derived inputs too
LENGTH_DTYPE = "int32"  # of a sequence's ``<name>_len``, like mel_len and tok_len
_NAME = re.compile(r"\A[a-z][a-z0-9_]{0,39}\Z")  # a Python identifier: a step takes it as a keyword
_MAX_TRAILING_DIMS = 3
_MAX_DIM = 1 << 16


@dataclass(frozen=True, slots=True)
class ExtraSpec:
    """One declared extra array (see the module table for what each kind means)."""

    name: str
    kind: str  # one of KINDS
    dtype: str  # one of EXTRA_DTYPES; the file's dtype and the batch's
    shape: tuple[int, ...] = ()  # trailing dims of one element (a frame, token, step; or the whole value)
    divisor: int = 1  # matrix only: frames per column r (a reduction factor), columns ceil(frames/r)

    @property
    def length_key(self) -> str | None:
        """``<name>_len`` for a sequence (its own length per row), else ``None``."""
        return f"{self.name}_len" if self.kind == "sequence" else None

    @property
    def has_length(self) -> bool:
        """Whether the file's first axis is a length (every kind but ``utterance``; a matrix's: its tokens)."""
        return self.kind != "utterance"

    @property
    def lead_dims(self) -> int:
        """Axes of the file before the trailing ``shape``: 0 (utterance), 2 (matrix) or 1."""
        return {"utterance": 0, "matrix": 2}.get(self.kind, 1)

    @property
    def kind_text(self) -> str:
        """The kind as ``index --extra NAME:KIND=DIR`` writes it (``matrix/3`` for a divisor of 3)."""
        return f"{self.kind}/{self.divisor}" if self.kind == "matrix" and self.divisor != 1 else self.kind

    def columns(self, frames: int) -> int:
        """A matrix's columns for ``frames`` mel frames: ``ceil(frames / divisor)``."""
        return -(-frames // self.divisor)

    def file_shape(self, length: int, frames: int = 0) -> tuple[int, ...]:
        """Shape of the ``.npy`` file of an utterance whose first axis is ``length`` long (a matrix: of
        ``frames`` mel frames too)."""
        if self.kind == "matrix":
            return (length, self.columns(frames), *self.shape)
        return (length, *self.shape) if self.has_length else self.shape

    def as_json(self) -> dict[str, Any]:
        out = {"name": self.name, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}
        return {**out, "divisor": self.divisor} if self.kind == "matrix" else out  # other kinds have no divisor


@dataclass(frozen=True, eq=False)
class ExtraSchema:
    """The extras of one manifest, with the per-utterance lengths that size sequence buckets.

    ``sequence_lengths[name]`` is an int64 [N] array (manifest order) for every sequence extra.
    """

    extras: tuple[ExtraSpec, ...] = ()
    sequence_lengths: Mapping[str, npt.NDArray[np.int64]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.extras)


def parse_kind(text: str) -> tuple[str, int] | None:
    """``KIND`` or ``matrix/R`` (``index --extra NAME:KIND=DIR``) as (kind, divisor); None if malformed."""
    kind, sep, divisor = text.partition("/")
    if not sep:
        return (kind, 1) if kind in KINDS else None
    if kind != "matrix" or not divisor.isdigit() or not 1 <= int(divisor) <= _MAX_DIM:
        return None
    return kind, int(divisor)


def check_declaration(name: Any, kind: Any, dtype: Any, shape: Any, divisor: Any = 1) -> tuple[str, str] | None:
    """Why one declaration is unusable, as ``(key, reason)``, or ``None`` when it is fine."""
    if not isinstance(name, str) or not _NAME.match(name):
        return "name", f"must be a lower-case identifier (a-z, 0-9, _; <= 40 chars), got {name!r}"
    if name in RESERVED_NAMES:
        return "name", f"{name!r} is reserved (base arrays and derived inputs: {sorted(RESERVED_NAMES)})"
    if kind not in KINDS:
        return "kind", f"must be one of {list(KINDS)}, got {kind!r}"
    if dtype not in EXTRA_DTYPES:
        return "dtype", f"must be one of {list(EXTRA_DTYPES)}, got {dtype!r}"
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > _MAX_TRAILING_DIMS
        or not all(type(d) is int and 1 <= d <= _MAX_DIM for d in shape)
    ):
        return "shape", f"must be a list of at most {_MAX_TRAILING_DIMS} dims in 1..{_MAX_DIM}, got {shape!r}"
    if type(divisor) is not int or not 1 <= divisor <= _MAX_DIM or (kind != "matrix" and divisor != 1):
        return "divisor", f"must be an integer in 1..{_MAX_DIM} (a matrix's frames per column), got {divisor!r}"
    return None


def check_schema(extras: Sequence[ExtraSpec]) -> tuple[int, str, str] | None:
    """Why a list of (individually valid) declarations clashes, as ``(index, key, reason)``."""
    taken: set[str] = set()
    for i, spec in enumerate(extras):
        for key in (spec.name, spec.length_key):
            if key is None:
                continue
            if key in taken or key in RESERVED_NAMES:
                return i, "name", f"{key!r} is declared twice (a sequence also owns <name>_len)"
            taken.add(key)
    return None


def row_shape(spec: ExtraSpec, max_frames: int, max_tokens: int, seq_len: int) -> tuple[int, ...]:
    """Shape of one row of ``spec`` in a bucket of ``max_frames`` x ``max_tokens`` (``seq_len``: its S)."""
    lead = {
        "frame": (max_frames,),
        "token": (max_tokens,),
        "utterance": (),
        "sequence": (seq_len,),
        "matrix": (max_tokens, spec.columns(max_frames)),
    }[spec.kind]
    return (*lead, *spec.shape)


def pad_row(spec: ExtraSpec, values: npt.NDArray[Any], dst: npt.NDArray[Any]) -> int:
    """Copy one utterance's ``values`` into its batch row ``dst``, cut and zero-padded by kind.

    Pure reference of what a producer does (it reads the file straight into ``dst`` instead).

    Args:
        spec: the declaration.
        values: the file's array, ``spec.file_shape(n, frames)``.
        dst: the row, ``row_shape(spec, ...)``; its dtype is ``spec.dtype``.

    Returns:
        Elements along the first axis kept (``min(n, dst.shape[0])``; a matrix: tokens, its columns cut
        likewise); 1 for an utterance value.

    Raises:
        ValueError: ``values`` does not have the declared trailing shape or dtype.
    """
    if (
        values.ndim < spec.lead_dims
        or values.shape[spec.lead_dims :] != spec.shape
        or values.dtype != np.dtype(spec.dtype)
    ):
        raise ValueError(
            f"extra {spec.name!r}: got {values.dtype} {values.shape}, declared {spec.dtype} "
            f"{spec.kind_text} [{', '.join(['n'] * spec.lead_dims + [str(d) for d in spec.shape])}]"
        )
    if not spec.has_length:
        dst[...] = values
        return 1
    n = min(int(values.shape[0]), int(dst.shape[0]))
    if spec.kind == "matrix":
        c = min(int(values.shape[1]), int(dst.shape[1]))
        dst[:n, :c] = values[:n, :c]
        dst[:n, c:] = 0
    else:
        dst[:n] = values[:n]
    dst[n:] = 0
    return n
