"""Which batch arrays a step receives, and their TensorFlow dtypes.

Role: the step gets the base arrays positionally (``mel, mel_len, tokens, tok_len``) and each extra
array of the batch schema (``shared/wire/schema.py``) as a keyword argument, but only those its
``__call__`` names, or all of them with ``**extras``. Decided once per step from its signature, so a step
written for the four base arrays runs unchanged on a cache with extras. ``mel`` comes in the wire's
dtype (``transport.mel_dtype``, ``StepSpec.mel_dtype``): float16 is cast by the step, inside its program.
Invariants: the base arrays are never passed by keyword; extras keep the batch's order.
Shutdown: nothing to release; pure functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import tensorflow as tf

from shared.wire.layout import ARRAY_DTYPES, ARRAY_KEYS
from shared.wire.schema import LENGTH_DTYPE, ExtraSpec

__all__ = ["accepted_extras", "input_dtypes"]


def accepted_extras(step: object, extras: Sequence[ExtraSpec]) -> tuple[str, ...]:
    """Batch keys of ``extras`` (a sequence's ``<name>_len`` included) that ``step.__call__`` takes by keyword."""
    keys = [k for e in extras for k in (e.name, e.length_key) if k is not None]
    try:
        params = inspect.signature(step).parameters      # type: ignore[arg-type]
    except (TypeError, ValueError):                      # a builtin or C callable: pass none
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return tuple(keys)
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return tuple(k for k in keys if k in named and k not in ARRAY_KEYS)


def input_dtypes(extras: Sequence[ExtraSpec], mel_dtype: str = ARRAY_DTYPES["mel"]) -> dict[str, tf.DType]:
    """TensorFlow dtype of every array a batch may hold: the base arrays (mel in ``transport.mel_dtype``),
    each extra and its length."""
    out = {name: tf.as_dtype(dtype) for name, dtype in {**ARRAY_DTYPES, "mel": mel_dtype}.items()}
    for spec in extras:
        out[spec.name] = tf.as_dtype(spec.dtype)
        if spec.length_key is not None:
            out[spec.length_key] = tf.as_dtype(LENGTH_DTYPE)
    return out
