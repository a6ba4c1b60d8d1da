"""The pieces every command's parser is built from: option groups, value types, defaults read from the schema.

Invariant: a config-backed flag has no argparse default (``None``: the YAML value stands unless the flag is
given) and its help names its key and the schema's default, read from the dataclass field when the parser is
built (``config_help``); every other option with a default shows it (``HelpFormatter``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.flag_checks import check_number
from melfeed.shared.yaml_safe import read_value

__all__ = ["GROUPS", "HelpFormatter", "config_help", "delay_ms", "groups", "path", "schema_default", "setting", "shown"]

GROUPS = ("common", "data", "transport", "training", "observability", "advanced")
_MAX_DEBUG_DELAY_MS = 3_600_000.0  # an hour per batch: far past any test; a larger sleep can overflow


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option whose help does not give its default; a switch (``store_true``)
    has none to give: it is off unless named."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 or "default" in text:
            return text
        return f"{text} (default: %(default)s)"

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        if action.type is int:
            return "N"
        if action.type is float:
            return "S" if action.dest.endswith("_s") else "X"
        return "DIR" if action.dest.endswith("_dir") else action.dest.upper()


def groups(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The six option groups of a command, in this order in its ``--help`` (an empty one is not shown)."""
    return {name: parser.add_argument_group(name) for name in GROUPS}


def schema_default(key: str) -> Any:
    """The default of the dotted config key ``key`` (``consumer.ring_slots``), from the dataclass fields."""
    cls: Any = PipelineConfig
    *sections, leaf = key.split(".")
    for name in sections:
        cls = _field(cls, name).default_factory
    field: Any = _field(cls, leaf)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _field(cls: Any, name: str) -> dataclasses.Field[Any]:
    found = {f.name: f for f in dataclasses.fields(cls)}
    if name not in found:
        raise ValueError(f"{name!r} is no field of {cls.__name__}")
    return found[name]


def shown(value: Any) -> str:
    """A default as the YAML file would spell it (``null``, ``true``, ``3``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def config_help(text: str, key: str, meaning: str = "") -> str:
    """``text (consumer.ring_slots, default 3)``; ``meaning`` says what the default does (``= off``)."""
    return f"{text} ({key}, default {shown(schema_default(key))}{meaning})"


def path(text: str) -> str:
    """A file or directory argument: "" (or only blanks) would quietly mean the current directory (``keys ""``
    wrote the keys there, ``demo-data --cache-dir ""`` a whole cache), so it is refused by name."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"must be a path (an empty one would mean the current directory), got {text!r}"
        )
    return text


def delay_ms(text: str) -> float:
    """``--debug-delay-ms``: a sleep per batch or utterance, so finite, >= 0 and at most an hour; a NaN or
    negative sleep would crash every producer, restarted by its supervisor for ever."""
    try:
        return check_number(float(text), "--debug-delay-ms", ceiling=_MAX_DEBUG_DELAY_MS)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds, got {text!r}") from None
    except ConfigError as err:
        raise argparse.ArgumentTypeError(f"{err.reason}, got {text!r}") from None


def setting(text: str) -> tuple[str, Any]:
    """``--set KEY=VALUE``: the dotted key and the value read as a YAML scalar or flow (``null``, ``16``,
    ``"0"``, ``[1, 2]``); the config schema types and checks it when applied."""
    key, has_value, value = text.partition("=")
    if not has_value or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE (e.g. consumer.steps=100), got {text!r}")
    try:
        return key.strip(), read_value(value, key.strip())
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
