"""Bucket shapes: the few fixed batch shapes that producers fill and the consumer compiles.

Role: turn per-utterance lengths from the manifest (frames, tokens) and a ``BucketConfig`` into a
``BucketSet``: the bucket shapes plus the bucket of every utterance. Producer and consumer both call
``build_buckets`` on the same manifest and config and compare ``BucketSet.as_wire()`` in the
handshake, so everything here is pure and deterministic (no I/O, clocks or randomness).

Invariants:
    * Bucket frame sizes are strictly increasing multiples of ``frame_multiple``; indices are 0..n-1.
    * Every bucket holds at least one utterance (empty ones are removed, the rest renumbered).
    * ``assignment[i]`` is the first bucket whose ``max_frames`` >= frames[i]. An overlong utterance
      (frames above the largest bucket, or tokens above ``max_tokens``) is either kept and counted in
      ``truncated`` (frames-overlong ones go to the largest bucket), or set to -1 and counted in
      ``dropped``; each utterance is counted at most once.
    * A kept, non-truncated utterance fits its bucket: frames <= T and tokens <= L.

Shutdown: nothing to release; these are values and pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.layout import ARRAY_DTYPES, MEL_WIRE_DTYPES
from melfeed.shared.wire.schema import LENGTH_DTYPE, ExtraSchema, ExtraSpec, row_shape

__all__ = ["Bucket", "BucketSet", "derive_boundaries", "build_buckets"]

_INF_COST = np.int64(1) << np.int64(62)  # > any real padded-frame total; INF + cost stays < 2**63
_DP_CHUNK_CELLS = 1 << 22  # bounds one DP layer's scratch matrix to ~32 MiB of int64


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Bucket:
    """One fixed batch shape: B rows of up to T mel frames and L tokens, plus the cache's extras.

    ``extras`` is the batch schema beyond the base arrays (``shared/wire/schema.py``);
    ``seq_lengths`` holds the padded length S of each ``sequence`` extra, in declaration order;
    ``mel_dtype`` is the mel's dtype on the wire and in a slot (``transport.mel_dtype``), so every
    layout, size and check that follows ``dtypes()`` follows it (float16: half the mel bytes).
    """

    index: int        # position in BucketSet.buckets
    batch_size: int   # rows B per batch
    max_frames: int   # T, a multiple of frame_multiple
    max_tokens: int   # L
    n_mels: int       # mel channels per frame
    extras: tuple[ExtraSpec, ...] = ()
    seq_lengths: tuple[int, ...] = ()   # S of each sequence extra (declaration order), >= 1
    mel_dtype: str = ARRAY_DTYPES["mel"]   # one of MEL_WIRE_DTYPES

    def __post_init__(self) -> None:
        if self.mel_dtype not in MEL_WIRE_DTYPES:
            raise ValueError(f"bucket mel_dtype must be one of {list(MEL_WIRE_DTYPES)}, got {self.mel_dtype!r}")
        if self.index < 0:
            raise ValueError(f"bucket index must be >= 0, got {self.index}")
        for name in ("batch_size", "max_frames", "max_tokens", "n_mels"):
            if getattr(self, name) < 1:
                raise ValueError(f"bucket {name} must be >= 1, got {getattr(self, name)}")
        n_seq = sum(e.kind == "sequence" for e in self.extras)
        if len(self.seq_lengths) != n_seq or any(s < 1 for s in self.seq_lengths):
            raise ValueError(f"bucket needs one length >= 1 per sequence extra ({n_seq}), got {self.seq_lengths}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Array shapes of one batch, in wire order: mel [B, T, n_mels], mel_len [B], tokens [B, L],
        tok_len [B], then each extra ``[B, *row_shape]`` (a sequence followed by ``<name>_len`` [B])."""
        b = self.batch_size
        out = {"mel": (b, self.max_frames, self.n_mels), "mel_len": (b,),
               "tokens": (b, self.max_tokens), "tok_len": (b,)}
        seq = iter(self.seq_lengths)
        for spec in self.extras:
            out[spec.name] = (b, *row_shape(spec, self.max_frames, self.max_tokens,
                                            next(seq) if spec.length_key else 0))
            if spec.length_key:
                out[spec.length_key] = (b,)
        return out

    def dtypes(self) -> dict[str, str]:
        """NumPy dtype names of the arrays in ``shapes()``, by the same keys and order."""
        out = dict(ARRAY_DTYPES)
        out["mel"] = self.mel_dtype
        for spec in self.extras:
            out[spec.name] = spec.dtype
            if spec.length_key:
                out[spec.length_key] = LENGTH_DTYPE
        return out

    def nbytes(self) -> int:
        """Total bytes of one batch's arrays."""
        dtypes = self.dtypes()
        return sum(math.prod(shape) * np.dtype(dtypes[name]).itemsize for name, shape in self.shapes().items())

    def as_wire(self) -> list[int]:
        """``[index, B, T, L, n_mels, *S]``: compared field by field in the handshake (no S without sequences)."""
        return [self.index, self.batch_size, self.max_frames, self.max_tokens, self.n_mels, *self.seq_lengths]


# eq=False: an ndarray field has no boolean ==; compare as_wire() and assignment explicitly.
@dataclass(frozen=True, eq=False)
class BucketSet:
    """All bucket shapes of a dataset plus the bucket of every utterance.

    ``assignment`` is stored as a read-only copy, so a BucketSet cannot change once built.
    """

    buckets: tuple[Bucket, ...]
    assignment: npt.NDArray[np.int16]  # [num_utterances] bucket index; -1 = dropped
    truncated: int                     # overlong utterances cut to fit their bucket
    dropped: int                       # overlong utterances left out (overlong == "drop")
    real_frames: int                   # frames of kept utterances after truncation (for efficiency)

    def __post_init__(self) -> None:
        if [b.index for b in self.buckets] != list(range(len(self.buckets))):
            raise ValueError("bucket indices must be 0..n-1 in order")
        assignment = np.array(self.assignment, dtype=np.int16)  # copy: the caller keeps theirs
        if assignment.ndim != 1 or (assignment.size and (
                assignment.min() < -1 or assignment.max() >= len(self.buckets))):
            raise ValueError("assignment must be 1-D with values in -1..len(buckets)-1")
        assignment.setflags(write=False)
        object.__setattr__(self, "assignment", assignment)

    def _sizes(self) -> npt.NDArray[np.int64]:
        kept = self.assignment[self.assignment >= 0]
        return np.bincount(kept, minlength=len(self.buckets)).astype(np.int64)

    def max_batch_nbytes(self) -> int:
        """Bytes of the largest batch: the unit of the memory bound (docs/ARCHITECTURE.md, invariant 4)."""
        return max((b.nbytes() for b in self.buckets), default=0)

    def padding_efficiency(self) -> float:
        """Real frames / padded frames over one epoch, in (0, 1].

        Each bucket's final partial batch counts as full B rows, because it is sent padded.
        """
        padded = sum(math.ceil(int(n) / b.batch_size) * b.batch_size * b.max_frames
                     for b, n in zip(self.buckets, self._sizes()))
        return self.real_frames / padded if padded else 0.0

    def as_wire(self) -> list[list[int]]:
        """Every bucket's ``as_wire()``, in index order."""
        return [b.as_wire() for b in self.buckets]


def _as_lengths(values: npt.ArrayLike, name: str) -> npt.NDArray[np.int64]:
    arr = np.asarray(values)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1 or (arr.size and arr.min() < 0):
        raise ValueError(f"{name} must be a 1-D array of non-negative lengths")
    return arr


def derive_boundaries(frames: npt.NDArray[np.integer], num_buckets: int, frame_multiple: int,
                      max_frames: int) -> tuple[int, ...]:
    """Choose bucket upper bounds that minimise the total padded frames of one epoch.

    Cost = sum over utterances of the bound of the bucket they land in (batch padding rows are
    ignored). Candidate bounds are multiples of ``frame_multiple``; an exact dynamic programme over
    the candidates that hold at least one utterance (plus the forced last bound) finds the optimum in
    O(num_buckets * candidates**2) vectorised steps. Utterances above ``max_frames`` count as
    members of the last bucket (they are truncated or dropped later; their cost is then constant).

    Args:
        frames: [num_utterances] frames per utterance, >= 0.
        num_buckets: most buckets to return, >= 1.
        frame_multiple: every bound is a multiple of this, >= 1.
        max_frames: the last bound is this rounded up to ``frame_multiple``, >= 1.

    Returns:
        Strictly increasing bounds in frames, at most ``num_buckets`` of them; fewer when fewer
        distinct candidates are occupied. Ties resolve to the lowest-index split (deterministic).

    Raises:
        ValueError: a bad argument.
    """
    lengths = _as_lengths(frames, "frames")
    if num_buckets < 1 or frame_multiple < 1 or max_frames < 1:
        raise ValueError("num_buckets, frame_multiple and max_frames must be >= 1")
    top = -(-max_frames // frame_multiple)  # candidate k means bound k * frame_multiple
    slot = np.clip(-(-lengths // frame_multiple), 1, top)
    counts = np.bincount(slot, minlength=top + 1)
    cand = np.flatnonzero(counts)  # slot 0 is never used, so every entry is >= 1
    if cand.size == 0 or cand[-1] != top:
        cand = np.append(cand, top)
    bound = np.concatenate(([0], cand * frame_multiple)).astype(np.int64)  # 1-based like cum
    cum = np.concatenate(([0], np.cumsum(counts[cand]))).astype(np.int64)
    n = cand.size
    layers = min(num_buckets, n)  # one more bucket never costs more, so use as many as exist
    best = np.full(n + 1, _INF_COST, dtype=np.int64)
    best[0] = 0
    choices: list[npt.NDArray[np.int64]] = []
    for _ in range(layers):
        best, arg = _dp_layer(best, bound, cum)
        choices.append(arg)
    bounds: list[int] = []
    j = n
    for arg in reversed(choices):
        bounds.append(int(bound[j]))
        j = int(arg[j])
    return tuple(reversed(bounds))


def _dp_layer(prev: npt.NDArray[np.int64], bound: npt.NDArray[np.int64], cum: npt.NDArray[np.int64]
              ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One more bucket: new[j] = min over i < j of prev[i] + bound[j] * (cum[j] - cum[i])."""
    size = prev.size
    new = np.full(size, _INF_COST, dtype=np.int64)
    arg = np.zeros(size, dtype=np.int64)
    i = np.arange(size)
    rows = max(1, _DP_CHUNK_CELLS // size)
    for start in range(1, size, rows):
        j = np.arange(start, min(size, start + rows))
        cost = prev[None, :] + bound[j, None] * (cum[j, None] - cum[None, :])
        cost = np.where((i[None, :] < j[:, None]) & (prev[None, :] < _INF_COST), cost, _INF_COST)
        arg[j] = np.argmin(cost, axis=1)
        new[j] = cost[np.arange(j.size), arg[j]]
    return new, arg


def _boundaries(frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64],
                cfg: BucketConfig) -> npt.NDArray[np.int64]:
    """Bucket frame sizes: the configured ones (capped at max_frames) or the DP's choice."""
    m = cfg.frame_multiple
    if cfg.boundaries is not None:
        cap = _round_up(cfg.max_frames, m) if cfg.max_frames is not None else None
        rounded = {_round_up(b, m) for b in cfg.boundaries}
        return np.array(sorted({min(b, cap) for b in rounded} if cap else rounded), dtype=np.int64)
    longest = int(frames.max())
    top = max(1, min(longest, cfg.max_frames) if cfg.max_frames is not None else longest)
    considered = frames
    if cfg.overlong == "drop":  # utterances about to be dropped must not claim a bucket
        keep = frames <= _round_up(top, m)
        if cfg.max_tokens is not None:
            keep &= tokens <= cfg.max_tokens
        considered = frames[keep]
    return np.array(derive_boundaries(considered, cfg.num_buckets, m, top), dtype=np.int64)


def _assign(frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], bounds: npt.NDArray[np.int64],
            cfg: BucketConfig) -> tuple[npt.NDArray[np.int64], int]:
    """Bucket slot per utterance before empty buckets are removed (-1 = dropped), and overlong count."""
    slot = np.searchsorted(bounds, frames, side="left")  # first bound >= frames
    frames_over = slot == bounds.size
    tokens_over = tokens > cfg.max_tokens if cfg.max_tokens is not None else np.zeros_like(frames_over)
    over = frames_over | tokens_over
    n_over = int(over.sum())
    if cfg.overlong == "truncate":
        return np.minimum(slot, bounds.size - 1), n_over
    if n_over == frames.size:
        by_frames = bool(frames_over.all()) or not tokens_over.all()
        key = "max_frames" if by_frames else "max_tokens"
        raise ConfigError("drops every utterance", path=("buckets", key),
                          got=int(bounds[-1]) if by_frames else cfg.max_tokens)
    return np.where(over, -1, slot), n_over


def build_buckets(frames: npt.NDArray[np.integer], token_counts: npt.NDArray[np.integer],
                  n_mels: int, cfg: BucketConfig, schema: ExtraSchema | None = None, *,
                  mel_dtype: str = ARRAY_DTYPES["mel"]) -> BucketSet:
    """Group utterances into a few fixed shapes and assign every utterance to one.

    Args:
        frames: [num_utterances] mel frames per utterance (manifest order).
        token_counts: [num_utterances] token ids per utterance (manifest order).
        n_mels: mel channels per frame.
        cfg: bucket settings. Derived boundaries end at min(max_frames, longest utterance), so a
            generous cap never adds an empty-tailed shape; configured boundaries above
            ``max_frames`` are lowered to it. Both are rounded up to ``frame_multiple``.
        schema: the manifest's extras (``Manifest.schema``); a sequence extra's S in a bucket is
            its longest length among the bucket's members. None = no extras.
        mel_dtype: the mel's dtype on the wire and in a slot (``transport.mel_dtype``); it changes
            no shape and no assignment, only the bytes (``Bucket.mel_dtype``).

    Returns:
        The bucket set; identical inputs give an identical set on every host.

    Raises:
        ValueError: mismatched or malformed length arrays, no utterances, or ``n_mels`` < 1.
        ConfigError: the settings drop every utterance.
    """
    lengths = _as_lengths(frames, "frames")
    tokens = _as_lengths(token_counts, "token_counts")
    if lengths.size != tokens.size or lengths.size == 0 or n_mels < 1:
        raise ValueError("frames and token_counts must be equally long and non-empty; n_mels >= 1")
    bounds = _boundaries(lengths, tokens, cfg)
    slot, n_over = _assign(lengths, tokens, bounds, cfg)
    kept = slot >= 0
    occupied = np.flatnonzero(np.bincount(slot[kept], minlength=bounds.size))
    renumber = np.full(bounds.size, -1, dtype=np.int64)
    renumber[occupied] = np.arange(occupied.size)
    assignment = np.where(kept, renumber[np.maximum(slot, 0)], -1)
    sizes_t = bounds[occupied]
    longest_tokens = np.zeros(occupied.size, dtype=np.int64)
    np.maximum.at(longest_tokens, assignment[kept], tokens[kept])
    extras = schema.extras if schema is not None else ()
    seq = _sequence_lengths(schema, assignment, kept, occupied.size)
    if cfg.rows is not None and len(cfg.rows) != occupied.size:
        raise ConfigError(f"must list one row count per bucket ({occupied.size})", path=("buckets", "rows"),
                          got=list(cfg.rows))
    buckets = tuple(
        Bucket(index=k, batch_size=_batch_size(cfg, int(t), k), max_frames=int(t),
               max_tokens=cfg.max_tokens if cfg.max_tokens is not None else max(1, int(longest_tokens[k])),
               n_mels=n_mels, extras=extras, seq_lengths=tuple(int(s[k]) for s in seq), mel_dtype=mel_dtype)
        for k, t in enumerate(sizes_t))
    real = int(np.minimum(lengths[kept], sizes_t[assignment[kept]]).sum())
    return BucketSet(buckets=buckets, assignment=assignment.astype(np.int16),
                     truncated=0 if cfg.overlong == "drop" else n_over,
                     dropped=n_over if cfg.overlong == "drop" else 0, real_frames=real)


def _sequence_lengths(schema: ExtraSchema | None, assignment: npt.NDArray[np.int64], kept: npt.NDArray[np.bool_],
                      n_buckets: int) -> list[npt.NDArray[np.int64]]:
    """Per sequence extra (declaration order): its longest length in each bucket, at least 1."""
    out = []
    for spec in schema.extras if schema is not None else ():
        if spec.kind != "sequence":
            continue
        lengths = np.asarray(schema.sequence_lengths[spec.name], dtype=np.int64)  # type: ignore[union-attr]
        if lengths.shape != assignment.shape:
            raise ValueError(f"sequence_lengths[{spec.name!r}] must have one entry per utterance")
        longest = np.ones(n_buckets, dtype=np.int64)
        np.maximum.at(longest, assignment[kept], lengths[kept])
        out.append(longest)
    return out


def _batch_size(cfg: BucketConfig, max_frames: int, index: int) -> int:
    """The bucket's rows from ``rows``, fixed rows, or as many rows as fit the frame budget (never fewer than one)."""
    if cfg.rows is not None:
        return cfg.rows[index]
    if cfg.batch_size == "auto":   # only the consumer measures them (consumer/train/auto_rows.py)
        raise ConfigError("auto: the consumer picks each bucket's rows at start; give this process the rows it "
                          "chose as buckets.rows (the consumer logs them)", path=("buckets", "batch_size"), got="auto")
    if cfg.batch_size is not None:
        return cfg.batch_size
    budget = cfg.frame_budget or 0  # BucketConfig guarantees it is set when batch_size is not
    return max(1, budget // max_frames)
