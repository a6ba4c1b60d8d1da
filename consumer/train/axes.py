"""What a step object declares about its batch axes: the token axis it wants and the multiple its frames need.

Role: two optional class attributes of the step (the ``TrainStep`` the factory returns), read once before
anything compiles (the cut is also ``as_dataset(token_axis="longest")``'s, consumer/dataset.py):

* ``token_axis``: ``"bucket"`` (default) = ``tokens`` is ``[B, L]``, the bucket's width; ``"longest"`` =
  ``tokens`` and every token-kind and matrix extra are cut to the batch's longest row (``max(tok_len)``),
  each sequence extra to its longest (``max(<name>_len)``), inside the compiled program after the batch is
  unpacked (``cut_to_longest``), what dynamic padding gives a model that masks with
  ``tf.sequence_mask(tok_len, maxlen=tf.reduce_max(tok_len))``. The step is traced once per bucket with
  that axis unknown (``None``), so no batch retraces it. Graph mode only: XLA needs every shape fixed, so
  an XLA program gets the bucket's width (under ``jit_compile: auto`` a step that needs the cut usually
  fails XLA and trains in graph mode).
* ``frame_multiple``: an int >= 1 (default 1), the multiple the frame axis must be (a decoder's
  reduction factor: r frames per decoder step). A plan whose bucket frame sizes are not all multiples of
  it is refused before compiling, naming ``buckets.frame_multiple`` (``check_frame_multiple``).

A value of the wrong type or outside its range is one line naming ``model.step`` (exit 78).
Invariants: the cut never widens an axis; its width is exactly the longest length (the ``maxlen`` of that mask
idiom, so the two agree; an all-padding batch gets width 0); every other array is left as it is.
Shutdown: nothing to release; pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import tensorflow as tf

from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.schema import ExtraSpec

__all__ = [
    "TOKEN_AXES",
    "token_axis_of",
    "frame_multiple_of",
    "check_frame_multiple",
    "program_inputs",
    "cut_names",
    "cut_to_longest",
]

TOKEN_AXES = ("bucket", "longest")
_CUT_BY_TOKENS = ("token", "matrix")  # extra kinds whose first axis (after B) is the tokens'


def token_axis_of(step: object, factory: str) -> str:
    """The step's ``token_axis`` ("bucket" when it declares none).

    Raises:
        ConfigError: ``model.step``: not one of ``TOKEN_AXES``.
    """
    value = getattr(step, "token_axis", "bucket")
    if value not in TOKEN_AXES:
        raise ConfigError(
            f"{type(step).__name__}.token_axis must be one of {list(TOKEN_AXES)}, got {value!r}",
            path=("model", "step"),
            got=factory,
        )
    return str(value)


def frame_multiple_of(step: object, factory: str) -> int:
    """The step's ``frame_multiple`` (1 when it declares none).

    Raises:
        ConfigError: ``model.step``: not an int >= 1.
    """
    value = getattr(step, "frame_multiple", 1)
    if type(value) is not int or value < 1:
        raise ConfigError(
            f"{type(step).__name__}.frame_multiple must be an integer >= 1, got {value!r}",
            path=("model", "step"),
            got=factory,
        )
    return value


def check_frame_multiple(step: object, factory: str, frame_sizes: Sequence[int], configured: int) -> None:
    """Refuse buckets whose frame sizes are not multiples of the step's ``frame_multiple``.

    Args:
        frame_sizes: each bucket's T, bucket order. configured: ``buckets.frame_multiple``.

    Raises:
        ConfigError: ``buckets.frame_multiple``: one line with the value the step needs and the bad sizes.
    """
    need = frame_multiple_of(step, factory)
    bad = [t for t in frame_sizes if t % need]
    if bad:
        fit = math.lcm(configured, need)
        raise ConfigError(
            f"the step ({factory}) needs bucket frame sizes that are multiples of {need} "
            f"(its frame_multiple), these are not: {bad}; set buckets.frame_multiple: {need} "
            f"(or a multiple of it, e.g. {fit})",
            path=("buckets", "frame_multiple"),
            got=configured,
        )


def program_inputs(passed: Sequence[str], extras: Sequence[ExtraSpec], token_axis: str) -> tuple[str, ...]:
    """Extra keys a program takes: those the step takes (``passed``), and with "longest" the ``<name>_len`` of
    each sequence it takes but whose length it does not (the cut needs it; the step is not given it)."""
    if token_axis != "longest":
        return tuple(passed)
    lengths = [e.length_key for e in extras if e.name in passed and e.length_key and e.length_key not in passed]
    return (*passed, *(k for k in lengths if k is not None))


def cut_names(extras: Sequence[ExtraSpec]) -> tuple[str, ...]:
    """The arrays whose second axis (after B) ``cut_to_longest`` cuts: ``tokens``, then ``extras``' cut ones."""
    return ("tokens", *(e.name for e in extras if e.kind in _CUT_BY_TOKENS or e.length_key is not None))


def cut_to_longest(arrays: Mapping[str, tf.Tensor], extras: Sequence[ExtraSpec]) -> dict[str, tf.Tensor]:
    """``arrays`` with the token axis cut to the batch's longest row (traced; see the module docstring).

    ``arrays`` holds ``tok_len``, any of the other base arrays and any of ``extras`` (with a sequence's
    ``<name>_len``); an array that is not there is skipped, a sequence without its length keeps its width.
    """
    out = dict(arrays)
    longest = _longest(arrays["tok_len"])
    if "tokens" in arrays:
        out["tokens"] = arrays["tokens"][:, :longest]
    for spec in extras:
        if spec.name not in arrays:
            continue
        if spec.kind in _CUT_BY_TOKENS:
            out[spec.name] = arrays[spec.name][:, :longest]
        elif spec.length_key is not None and spec.length_key in arrays:
            out[spec.name] = arrays[spec.name][:, : _longest(arrays[spec.length_key])]
    return out


def _longest(lengths: tf.Tensor) -> tf.Tensor:
    """The longest of ``lengths`` [B] int32 (a scalar int32 tensor)."""
    return tf.reduce_max(lengths)
