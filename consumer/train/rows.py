"""Row inputs of the step: how many rows of a batch are real (``rows``) and which (``row_mask``).

Role: a bucket's last batch of an epoch (``buckets.partial: pad``) has fewer real rows than its B; the
rest are padding rows (all zero, ``mel_len`` 0). A step that averages over rows needs to know how many
are real, so ``CompiledStep`` offers two keyword inputs, derived from the plan by the consumer (never
carried on the wire, not part of the array schema):

    rows      [] int32    real rows; rows ``0 .. rows - 1`` are real, the rest padding
    row_mask  [B] bool    ``True`` for the real rows (``tf.sequence_mask(rows, B)``)

A step receives the ones its ``__call__`` names as parameters (or all of them when it takes
``**kwargs``); a step that names neither is called with the four arrays only.
Invariants:
    * The program's input signature gains one scalar (``rows``) when the step takes either input; the
      mask is built inside the program, so nothing [B]-sized crosses per step and shapes stay fixed.
    * Warm-up runs the all-padding batch with ``rows`` 0; ``CompiledStep.run`` without ``rows`` means
      a full batch (``rows`` = B).
    * A quarantined row (bad cache file, left empty by its producer) is a planned row: inside ``rows``.
Shutdown: nothing to release.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import tensorflow as tf

__all__ = ["ROW_INPUTS", "row_inputs_taken", "row_inputs"]

ROW_INPUTS = ("rows", "row_mask")
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def row_inputs_taken(step: Callable[..., object]) -> tuple[str, ...]:
    """The row inputs ``step`` accepts as keywords, in ``ROW_INPUTS`` order (all with ``**kwargs``).

    A callable whose signature cannot be read (some C-implemented callables) takes none.
    """
    try:
        params = inspect.signature(step).parameters
    except (TypeError, ValueError):
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return ROW_INPUTS
    return tuple(name for name in ROW_INPUTS if name in params and params[name].kind in _KEYWORD_KINDS)


def row_inputs(taken: tuple[str, ...], rows: tf.Tensor, batch_size: int) -> dict[str, tf.Tensor]:
    """The keyword inputs of one step call: ``rows`` [] int32 and/or ``row_mask`` [B] bool (in-graph)."""
    out: dict[str, tf.Tensor] = {}
    if "rows" in taken:
        out["rows"] = rows
    if "row_mask" in taken:
        out["row_mask"] = tf.sequence_mask(rows, batch_size)
    return out
