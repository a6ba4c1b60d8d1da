"""Which batch arrays a step receives, their TensorFlow dtypes, and whether the step object can take them.

Role: the step gets the base arrays positionally (``mel, mel_len, tokens, tok_len``) and each extra
array of the batch schema (``shared/wire/schema.py``) as a keyword argument, but only those its
``__call__`` names, or all of them with ``**extras``. Decided once per step from its signature, so a step
written for the four base arrays runs unchanged on a cache with extras. ``mel`` comes in the wire's
dtype (``transport.mel_dtype``, ``StepSpec.mel_dtype``): float16 is cast by the step, inside its program.
``check_step`` and ``check_call`` refuse, before anything compiles, a factory result that is no step (no
``__call__`` or ``variables()``) and a ``__call__`` that cannot take what it will be given (a wrong
signature, or a parameter the batch does not hold): one line naming ``model.step`` (exit 78).
Invariants: the base arrays are never passed by keyword; extras keep the batch's order.
Shutdown: nothing to release; pure functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence

import tensorflow as tf

from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.layout import ARRAY_DTYPES, ARRAY_KEYS
from melfeed.shared.wire.schema import LENGTH_DTYPE, ExtraSpec

__all__ = ["Shapes", "accepted_extras", "bucket_key", "check_call", "check_step", "input_dtypes", "unlisted_variables"]

_CONTRACT = "the TrainStep protocol, consumer/train/model.py"

Shapes = tuple[tuple[int, ...], ...]  # shapes in argument order (base, then passed extras): one program's key


def accepted_extras(step: object, extras: Sequence[ExtraSpec]) -> tuple[str, ...]:
    """Batch keys of ``extras`` (a sequence's ``<name>_len`` included) that ``step.__call__`` takes by keyword."""
    keys = [k for e in extras for k in (e.name, e.length_key) if k is not None]
    try:
        params = inspect.signature(step).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin or C callable: pass none
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return tuple(keys)
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return tuple(k for k in keys if k in named and k not in ARRAY_KEYS)


def bucket_key(shapes: Mapping[str, Sequence[int]], passed: Sequence[str] = ()) -> Shapes:
    """Validate one bucket's shapes and return them in argument order (base keys, then ``passed`` extras)."""
    if not set(ARRAY_KEYS) <= set(shapes) or not set(passed) <= set(shapes):
        raise ValueError(f"bucket shapes need keys {sorted({*ARRAY_KEYS, *passed})}, got {sorted(shapes)}")
    out = tuple(tuple(int(d) for d in shapes[k]) for k in (*ARRAY_KEYS, *passed))
    mel, mel_len, tokens, tok_len = out[:4]
    batch = mel[0] if len(mel) == 3 else -1
    if not (
        len(mel) == 3
        and mel_len == (batch,)
        and len(tokens) == 2
        and tokens[0] == batch
        and tok_len == (batch,)
        and min(mel + tokens) >= 1
    ):
        raise ValueError(
            f"inconsistent bucket shapes {dict(zip(ARRAY_KEYS, out))}: "
            "want mel [B,T,M], mel_len [B], tokens [B,L], tok_len [B], all >= 1"
        )
    return out


def input_dtypes(extras: Sequence[ExtraSpec], mel_dtype: str = ARRAY_DTYPES["mel"]) -> dict[str, tf.DType]:
    """TensorFlow dtype of every array a batch may hold: the base arrays (mel in ``transport.mel_dtype``),
    each extra and its length."""
    out = {name: tf.as_dtype(dtype) for name, dtype in {**ARRAY_DTYPES, "mel": mel_dtype}.items()}
    for spec in extras:
        out[spec.name] = tf.as_dtype(spec.dtype)
        if spec.length_key is not None:
            out[spec.length_key] = tf.as_dtype(LENGTH_DTYPE)
    return out


def check_step(step: object, factory: str) -> list[object]:
    """``step.variables()``, after checking that the factory returned a step.

    Raises:
        ConfigError: ``model.step``: not callable, no callable ``variables``, or it does not return a list of
            variables (objects with ``assign`` and ``numpy``); one line naming the factory.
    """

    def fail(reason: str) -> ConfigError:
        return ConfigError(f"{reason} ({_CONTRACT})", path=("model", "step"), got=factory)

    what = type(step).__name__
    if not callable(step) or not callable(getattr(step, "variables", None)):
        returned = "None" if step is None else f"a {what}"
        raise fail(
            f"the factory returned {returned}, not a step: it needs __call__(mel, mel_len, tokens, tok_len) "
            "and variables()"
        )
    try:
        variables = step.variables()  # type: ignore[attr-defined]
    except Exception as err:  # user code: told in one line, like the factory's own failure
        raise fail(f"{what}.variables() raised {type(err).__name__}: {err}") from err
    if not isinstance(variables, (list, tuple)):
        raise fail(f"{what}.variables() returned {type(variables).__name__}, not a list of variables")
    bad = [v for v in variables if not (callable(getattr(v, "assign", None)) and callable(getattr(v, "numpy", None)))]
    if bad:
        raise fail(
            f"{what}.variables() holds {type(bad[0]).__name__}, not a variable (every model and optimizer "
            "tf.Variable or keras.Variable)"
        )
    return list(variables)


def check_call(
    step: object, factory: str, passed: Sequence[str], row_names: Sequence[str], available: Sequence[str]
) -> None:
    """Refuse a ``__call__`` that cannot take ``step(mel, mel_len, tokens, tok_len, **passed, **rows)``.

    Args:
        passed: the extras it will get by keyword (``accepted_extras``); row_names: the row inputs it takes.
        available: every name the batch could give it (the extras' keys and the row inputs), for the message.

    Raises:
        ConfigError: ``model.step``: too many or too few positional parameters, or a required parameter
            that nothing supplies (e.g. an extra the cache does not have).
    """
    try:
        signature = inspect.signature(step)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin or C callable: its call will tell
        return
    try:
        signature.bind(*ARRAY_KEYS, **dict.fromkeys((*passed, *row_names)))
        return
    except TypeError as err:
        why = str(err)
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][len(ARRAY_KEYS) :]
    missing = [
        p.name
        for p in [*positional, *(p for p in params if p.kind is p.KEYWORD_ONLY)]
        if p.default is p.empty and p.name not in (*passed, *row_names)
    ]
    holds = ", ".join([*ARRAY_KEYS, *available])
    if missing:
        why = f"needs {', '.join(map(repr, missing))}, which the batch does not hold (it holds {holds})"
    bare = signature.replace(
        parameters=[p.replace(annotation=p.empty) for p in params], return_annotation=signature.empty
    )  # annotations would only lengthen the line
    raise ConfigError(
        f"{type(step).__name__}.__call__{bare} cannot take the batch: {why}; it is called "
        "as step(mel, mel_len, tokens, tok_len) plus, by keyword, the extras and row inputs it names "
        '(docs/guide/your-model.md, "A step in the built-in loop")',
        path=("model", "step"),
        got=factory,
    )


def unlisted_variables(used: Iterable[object], before: Iterable[object], after: Iterable[object]) -> str | None:
    """What is wrong with the variables the compiled programs capture (``used``), in one phrase, or None.

    ``before`` and ``after`` are the step's ``variables()`` before and after warm-up: a used variable in neither
    is left out of ``variables()``; one only in ``after`` was created while tracing (an optimizer built on its
    first ``apply``). Either way warm-up changed it without putting it back. A Keras variable counts as its
    ``tf.Variable``, a mirrored one as its parts.
    """

    def handles(v: object) -> list[int]:
        inner = getattr(v, "value", None)
        base = inner if inner is not None and not callable(inner) else v  # keras.Variable -> tf.Variable
        return [id(v), id(base), *map(id, getattr(base, "values", ()))]

    def names(vs: Iterable[object]) -> str:
        found = sorted({str(getattr(v, "name", "?")) for v in vs})
        return f"{len(found)} variable(s) ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''})"

    known_before = {h for v in before for h in handles(v)}
    known_after = {h for v in after for h in handles(v)}
    created = [v for v in used if id(v) not in known_before and id(v) in known_after]
    left_out = [v for v in used if id(v) not in known_before and id(v) not in known_after]
    parts = (
        [
            f"{names(created)} were created while the step was traced, after the factory returned (build them "
            "in the factory: optimizer.build(model.trainable_variables))"
        ]
        if created
        else []
    ) + (
        [
            f"variables() leaves out {names(left_out)} its step uses (return every model and optimizer variable; "
            "without checkpoint_items() checkpoints do not hold them, so a resumed run is not exact)"
        ]
        if left_out
        else []
    )
    return "; ".join(parts) or None
