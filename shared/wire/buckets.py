"""Bucket shapes: the few fixed batch shapes that producers fill and the consumer compiles.

Role: turn per-utterance lengths from the manifest (frames, tokens) and a ``BucketConfig`` into a
``BucketSet``: the bucket shapes plus the bucket of every utterance. Producer and consumer both call
``build_buckets`` on the same manifest and config and compare ``BucketSet.as_wire()`` in the
handshake, so everything here is pure and deterministic (no I/O, clocks or randomness).

Two plans (``grid.is_grid``): configured ``boundaries`` or a set ``num_buckets`` give 1-D buckets
over frames (each L the longest tokens in the bucket, or ``max_tokens``); otherwise the 2-D planner
(``shared/wire/grid.py``) chooses at most ``max_shapes`` (T, L) shapes by padded cost.

Invariants:
    * Buckets are sorted by (T, L) and unique; T is a multiple of ``frame_multiple``; indices are
      0..n-1. In a 1-D plan T is strictly increasing; in a 2-D plan several shapes may share a T.
    * Every bucket holds at least one utterance (empty ones are removed, the rest renumbered).
    * 1-D: ``assignment[i]`` is the first bucket whose ``max_frames`` >= frames[i]. 2-D: it is the
      cheapest bucket that fits utterance i (``grid.assign_cheapest``; ties: the lowest index), and
      each L is the longest tokens among its members.
    * Frames-per-token outliers (``shared/wire/outliers.py``) are set to -1 and counted in
      ``outliers``. An overlong utterance (frames above the largest bucket, or tokens above
      ``max_tokens``) is either kept and counted in ``truncated`` (frames-overlong ones go to the
      largest bucket, or in a 2-D plan to the cheapest of the largest T that fits its tokens), or set
      to -1 and counted in ``dropped``; each utterance is counted at most once.
    * A kept, non-truncated utterance fits its bucket: frames <= T and tokens <= L.

Shutdown: nothing to release; these are values and pure functions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.bucket_dp import as_lengths, derive_boundaries
from melfeed.shared.wire.grid import bucket_count, grid_slots, is_grid, top_frames
from melfeed.shared.wire.layout import ARRAY_DTYPES, MEL_WIRE_DTYPES
from melfeed.shared.wire.messages import LEARN_ROWS
from melfeed.shared.wire.outliers import frames_per_token_outliers
from melfeed.shared.wire.schema import LENGTH_DTYPE, ExtraSchema, ExtraSpec, row_shape

__all__ = [
    "Bucket",
    "BucketSet",
    "derive_boundaries",
    "build_buckets",
    "apply_rows",
    "learns_costs",
    "learns_rows",
    "one_row_settings",
    "with_costs",
]


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

    index: int  # position in BucketSet.buckets
    batch_size: int  # rows B per batch
    max_frames: int  # T, a multiple of frame_multiple
    max_tokens: int  # L
    n_mels: int  # mel channels per frame
    extras: tuple[ExtraSpec, ...] = ()
    seq_lengths: tuple[int, ...] = ()  # S of each sequence extra (declaration order), >= 1
    mel_dtype: str = ARRAY_DTYPES["mel"]  # one of MEL_WIRE_DTYPES

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
        out = {
            "mel": (b, self.max_frames, self.n_mels),
            "mel_len": (b,),
            "tokens": (b, self.max_tokens),
            "tok_len": (b,),
        }
        seq = iter(self.seq_lengths)
        for spec in self.extras:
            out[spec.name] = (
                b,
                *row_shape(spec, self.max_frames, self.max_tokens, next(seq) if spec.length_key else 0),
            )
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
    truncated: int  # overlong utterances cut to fit their bucket
    dropped: int  # overlong utterances left out (overlong == "drop")
    real_frames: int  # frames of kept utterances after truncation (for efficiency)
    outliers: int = 0  # left out by the frames-per-token limits (shared/wire/outliers.py)
    real_tokens: int = 0  # tokens of kept utterances after truncation (for efficiency)

    def __post_init__(self) -> None:
        if [b.index for b in self.buckets] != list(range(len(self.buckets))):
            raise ValueError("bucket indices must be 0..n-1 in order")
        assignment = np.array(self.assignment, dtype=np.int16)  # copy: the caller keeps theirs
        if assignment.ndim != 1 or (
            assignment.size and (assignment.min() < -1 or assignment.max() >= len(self.buckets))
        ):
            raise ValueError("assignment must be 1-D with values in -1..len(buckets)-1")
        assignment.setflags(write=False)
        object.__setattr__(self, "assignment", assignment)

    def _sizes(self) -> npt.NDArray[np.int64]:
        kept = self.assignment[self.assignment >= 0]
        return np.bincount(kept, minlength=len(self.buckets)).astype(np.int64)

    def max_batch_nbytes(self) -> int:
        """Bytes of the largest batch: the unit of the memory bound (docs/design.md, invariant 4)."""
        return max((b.nbytes() for b in self.buckets), default=0)

    def padding_efficiency(self) -> float:
        """Real frames / padded frames over one epoch, in (0, 1].

        Each bucket's final partial batch counts as full B rows, because it is sent padded.
        """
        padded = sum(
            math.ceil(int(n) / b.batch_size) * b.batch_size * b.max_frames for b, n in zip(self.buckets, self._sizes())
        )
        return self.real_frames / padded if padded else 0.0

    def token_padding_efficiency(self) -> float:
        """Real tokens / padded token positions over one epoch, counted like ``padding_efficiency``."""
        padded = sum(
            math.ceil(int(n) / b.batch_size) * b.batch_size * b.max_tokens for b, n in zip(self.buckets, self._sizes())
        )
        return self.real_tokens / padded if padded else 0.0

    def as_wire(self, *, learn_rows: bool = False) -> list[list[int]]:
        """Every bucket's ``as_wire()``, in index order; ``learn_rows``: each B is ``LEARN_ROWS`` (the HELLO of a
        producer that takes the consumer's rows from the WELCOME)."""
        wire = [b.as_wire() for b in self.buckets]
        return [[w[0], LEARN_ROWS, *w[2:]] for w in wire] if learn_rows else wire


def _boundaries(
    frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], considered: npt.NDArray[np.bool_], cfg: BucketConfig
) -> npt.NDArray[np.int64]:
    """1-D bucket frame sizes: the configured ones (capped at max_frames) or the DP's choice."""
    m = cfg.frame_multiple
    if cfg.boundaries is not None:
        cap = _round_up(cfg.max_frames, m) if cfg.max_frames is not None else None
        rounded = {_round_up(b, m) for b in cfg.boundaries}
        return np.array(sorted({min(b, cap) for b in rounded} if cap else rounded), dtype=np.int64)
    top = top_frames(frames[considered], cfg)
    if cfg.overlong == "drop":  # utterances about to be dropped must not claim a bucket
        considered = considered & _fits_limits(frames, tokens, top, cfg)
    return np.array(derive_boundaries(frames[considered], bucket_count(cfg), m, top), dtype=np.int64)


def _fits_limits(
    frames: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], top: int, cfg: BucketConfig
) -> npt.NDArray[np.bool_]:
    keep = frames <= _round_up(top, cfg.frame_multiple)
    if cfg.max_tokens is not None:
        keep &= tokens <= cfg.max_tokens
    return keep


def _assign(
    frames: npt.NDArray[np.int64],
    tokens: npt.NDArray[np.int64],
    bounds: npt.NDArray[np.int64],
    considered: npt.NDArray[np.bool_],
    cfg: BucketConfig,
) -> tuple[npt.NDArray[np.int64], int]:
    """1-D bucket slot per utterance before empty buckets are removed (-1 = left out), and overlong count."""
    slot = np.searchsorted(bounds, frames, side="left")  # first bound >= frames
    frames_over = (slot == bounds.size) & considered
    tokens_over = (tokens > cfg.max_tokens if cfg.max_tokens is not None else np.zeros_like(frames_over)) & considered
    over = frames_over | tokens_over
    n_over = int(over.sum())
    if cfg.overlong == "truncate":
        return np.where(considered, np.minimum(slot, bounds.size - 1), -1), n_over
    if n_over == int(considered.sum()):
        by_frames = bool(frames_over[considered].all()) or not tokens_over[considered].all()
        key = "max_frames" if by_frames else "max_tokens"
        raise ConfigError(
            "drops every utterance", path=("buckets", key), got=int(bounds[-1]) if by_frames else cfg.max_tokens
        )
    return np.where(over | ~considered, -1, slot), n_over


def _check_outliers(ratio: npt.NDArray[np.int8], cfg: BucketConfig) -> None:
    if ratio.size and ratio.all():
        key = "max_frames_per_token" if (ratio == 1).any() else "min_frames_per_token"
        raise ConfigError("leaves every utterance out", path=("buckets", key), got=getattr(cfg, key))


def build_buckets(
    frames: npt.NDArray[np.integer],
    token_counts: npt.NDArray[np.integer],
    n_mels: int,
    cfg: BucketConfig,
    schema: ExtraSchema | None = None,
    *,
    mel_dtype: str = ARRAY_DTYPES["mel"],
) -> BucketSet:
    """Group utterances into a few fixed shapes and assign every utterance to one.

    Args:
        frames: [num_utterances] mel frames per utterance (manifest order).
        token_counts: [num_utterances] token ids per utterance (manifest order).
        n_mels: mel channels per frame.
        cfg: bucket settings (``is_grid``: 2-D shapes or 1-D buckets). Derived shapes end at
            min(max_frames, longest utterance), so a generous cap never adds an empty-tailed shape;
            configured boundaries above ``max_frames`` are lowered to it. Both are rounded up to
            ``frame_multiple``. Frames-per-token outliers never claim a shape.
        schema: the manifest's extras (``Manifest.schema``); a sequence extra's S in a bucket is
            its longest length among the bucket's members. None = no extras.
        mel_dtype: the mel's dtype on the wire and in a slot (``transport.mel_dtype``); it changes
            no shape and no assignment, only the bytes (``Bucket.mel_dtype``).

    Returns:
        The bucket set; identical inputs give an identical set on every host.

    Raises:
        ValueError: mismatched or malformed length arrays, no utterances, or ``n_mels`` < 1.
        ConfigError: the settings leave every utterance out.
    """
    lengths = as_lengths(frames, "frames")
    tokens = as_lengths(token_counts, "token_counts")
    if lengths.size != tokens.size or lengths.size == 0 or n_mels < 1:
        raise ValueError("frames and token_counts must be equally long and non-empty; n_mels >= 1")
    ratio = frames_per_token_outliers(lengths, tokens, cfg)
    _check_outliers(ratio, cfg)
    considered = ratio == 0
    if cfg.cost == "measured":  # the consumer fits the weights; a producer learns them in its handshake
        raise ConfigError(
            "measured: the consumer fits token_cost and attention_cost to its step at start and producers learn "
            "them when they join; give this command the weights it chose (the consumer logs them) with "
            "buckets.cost: formula, or (doctor) the consumer's consumer.state_dir",
            path=("buckets", "cost"),
            got="measured",
        )
    if is_grid(cfg):
        bounds, slot, n_over = grid_slots(lengths, tokens, considered, cfg)
    else:
        bounds = _boundaries(lengths, tokens, considered, cfg)
        slot, n_over = _assign(lengths, tokens, bounds, considered, cfg)
    kept = slot >= 0
    occupied = np.flatnonzero(np.bincount(slot[kept], minlength=bounds.size))
    renumber = np.full(bounds.size, -1, dtype=np.int64)
    renumber[occupied] = np.arange(occupied.size)
    assignment = np.where(kept, renumber[np.maximum(slot, 0)], -1)
    sizes_t = bounds[occupied]
    widths = np.zeros(occupied.size, dtype=np.int64)
    np.maximum.at(widths, assignment[kept], tokens[kept])
    widths = np.full_like(widths, cfg.max_tokens) if cfg.max_tokens is not None else np.maximum(widths, 1)
    extras = schema.extras if schema is not None else ()
    seq = _sequence_lengths(schema, assignment, kept, occupied.size)
    if cfg.rows is not None and len(cfg.rows) != occupied.size:
        raise ConfigError(
            f"must list one row count per bucket ({occupied.size})", path=("buckets", "rows"), got=list(cfg.rows)
        )
    buckets = tuple(
        Bucket(
            index=k,
            batch_size=_batch_size(cfg, int(t), k),
            max_frames=int(t),
            max_tokens=int(widths[k]),
            n_mels=n_mels,
            extras=extras,
            seq_lengths=tuple(int(s[k]) for s in seq),
            mel_dtype=mel_dtype,
        )
        for k, t in enumerate(sizes_t)
    )
    real = int(np.minimum(lengths[kept], sizes_t[assignment[kept]]).sum())
    real_tokens = int(np.minimum(tokens[kept], widths[assignment[kept]]).sum())
    return BucketSet(
        buckets=buckets,
        assignment=assignment.astype(np.int16),
        truncated=0 if cfg.overlong == "drop" else n_over,
        dropped=n_over if cfg.overlong == "drop" else 0,
        real_frames=real,
        outliers=int((~considered).sum()),
        real_tokens=real_tokens,
    )


def _sequence_lengths(
    schema: ExtraSchema | None, assignment: npt.NDArray[np.int64], kept: npt.NDArray[np.bool_], n_buckets: int
) -> list[npt.NDArray[np.int64]]:
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


def apply_rows(buckets: Sequence[Bucket], rows: Sequence[int]) -> tuple[Bucket, ...]:
    """The same shapes with each bucket's rows B from ``rows`` (index order): rows learned in the handshake.

    Raises:
        ValueError: not one row count >= 1 per bucket.
    """
    if len(rows) != len(buckets):
        raise ValueError(f"need one row count per bucket ({len(buckets)}), got {len(rows)}")
    return tuple(dataclasses.replace(b, batch_size=int(r)) for b, r in zip(buckets, rows))


def learns_rows(cfg: BucketConfig) -> bool:
    """``batch_size: auto`` without ``rows``: the rows are the consumer's to measure (consumer/train/auto_rows.py);
    a producer learns them in its handshake (the WELCOME's ``rows``)."""
    return cfg.batch_size == "auto" and cfg.rows is None


def learns_costs(cfg: BucketConfig) -> bool:
    """``cost: measured``: the 2-D planner's weights are the consumer's to fit (consumer/train/measured_costs.py);
    a producer learns them in its handshake (the WELCOME's ``costs``), then plans as with ``cost: formula``."""
    return cfg.cost == "measured"


def with_costs(cfg: BucketConfig, token_cost: float, attention_cost: float) -> BucketConfig:
    """``cfg`` planned with these weights (``cost: formula``): what a measured or learned fit turns into."""
    return dataclasses.replace(cfg, cost="formula", token_cost=token_cost, attention_cost=attention_cost)


def one_row_settings(cfg: BucketConfig) -> BucketConfig:
    """``cfg`` with one row per bucket and no ``rows``: the same shapes and assignment (the planner's shapes do not
    depend on rows under ``auto`` or ``rows``: ``grid.batch_rows``), for a process that sets the rows afterwards."""
    return dataclasses.replace(cfg, batch_size=1, rows=None)


def _batch_size(cfg: BucketConfig, max_frames: int, index: int) -> int:
    """The bucket's rows from ``rows``, fixed rows, or as many rows as fit the frame budget (never fewer than one)."""
    if cfg.rows is not None:
        return cfg.rows[index]
    if cfg.batch_size == "auto":  # the consumer measures them; a producer learns them in its handshake
        raise ConfigError(
            "auto: the consumer picks each bucket's rows at start and producers learn them when they join; "
            "give this command the rows it chose as buckets.rows (the consumer logs them)",
            path=("buckets", "batch_size"),
            got="auto",
        )
    if cfg.batch_size is not None:
        return cfg.batch_size
    budget = cfg.frame_budget or 0  # BucketConfig guarantees it is set when batch_size is not
    return max(1, budget // max_frames)
