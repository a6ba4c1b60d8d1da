"""Named scalars of the training step: the contract's normal form and their averages.

Role: a step returns ``{"loss": ..., "mel_l1": ..., ...}`` or a bare scalar loss.
``normalize_outputs`` (called while tracing, so once per program) turns either into a dict of
float32 scalars in a fixed order (``loss`` first, then the others sorted by name); ``read_outputs``
reads them to the host after the step (their means per status interval: consumer/train/meter.py);
``python_at_trace`` keeps such trace-time Python out of AutoGraph's conversion.
Invariants: every normalised mapping holds ``"loss"``; every value is a float32 scalar; a step
that breaks the contract raises ``StepOutputError`` (one line) while tracing, before any update.
Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import tensorflow as tf

__all__ = ["StepOutputError", "normalize_outputs", "python_at_trace", "read_outputs"]

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def python_at_trace(fn: _Fn) -> _Fn:
    """``fn`` kept out of AutoGraph's conversion (``tf.autograph.experimental.do_not_convert``): its Python
    runs as written while a program is traced. Typed, unlike TensorFlow's decorator, so callers keep ``fn``'s
    signature."""
    kept: _Fn = tf.autograph.experimental.do_not_convert(fn)
    return kept


class StepOutputError(TypeError):
    """The step's return value breaks the contract (no ``loss``, a non-scalar, a bad name)."""


@python_at_trace  # plain Python checks on the traced structure
def normalize_outputs(result: Any) -> dict[str, tf.Tensor]:
    """``{"loss": ..., others sorted by name}`` as float32 scalars, from what the step returned.

    Raises:
        StepOutputError: no ``"loss"`` key, a key that is not a non-empty string, or a value that
            is not a scalar number.
    """
    raw = dict(result) if isinstance(result, Mapping) else {"loss": result}
    if "loss" not in raw:
        raise StepOutputError(f"the step returned no 'loss' (names: {', '.join(map(str, raw)) or 'none'})")
    for name in raw:
        if not isinstance(name, str) or not name or any(c in name for c in ' \t\n"{}=,'):
            raise StepOutputError(f"output name {name!r} must be a non-empty word")
    out: dict[str, tf.Tensor] = {}
    for name in ["loss", *sorted(k for k in raw if k != "loss")]:
        try:
            value = tf.convert_to_tensor(raw[name])
        except (TypeError, ValueError) as err:
            raise StepOutputError(f"output {name!r} is not a tensor: {type(raw[name]).__name__}") from err
        if value.shape.rank != 0 or not (value.dtype.is_floating or value.dtype.is_integer):
            raise StepOutputError(
                f"output {name!r} must be a scalar number, got {value.dtype.name} of shape {value.shape}"
            )
        out[name] = tf.cast(value, tf.float32)
    return out


def read_outputs(outputs: Mapping[str, Any]) -> dict[str, float]:
    """The step's named scalars as Python floats (the first read is the host sync)."""
    return {name: float(value) for name, value in outputs.items()}
