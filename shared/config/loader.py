"""Config loading: a YAML file or a parsed mapping -> a validated ``PipelineConfig``, and back.

Role: the only place that knows YAML and the mapping form of a config: ``load_config`` (a file),
``config_from_mapping`` (a parsed mapping, e.g. a child's hand-off), ``config_to_mapping`` (the
inverse, for writing an effective config) and ``with_overrides`` (dotted CLI keys). The meaning,
defaults and ranges of each setting live with the dataclasses in ``shared/config/__init__.py``.
Invariants: an unknown key, a value of the wrong type or an invalid value raises ``ConfigError``
naming its key path; ``config_from_mapping(config_to_mapping(cfg)) == cfg``.
Shutdown: nothing to release.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from melfeed.shared.config import (
    BucketConfig,
    ConsumerConfig,
    FeatureConfig,
    ModelConfig,
    PipelineConfig,
    ProducerConfig,
    TransportConfig,
)
from melfeed.shared.config.checks import check_number, check_text
from melfeed.shared.errors import ConfigError
from melfeed.shared.yaml_safe import read_config_file

__all__ = ["load_config", "config_from_mapping", "config_to_mapping", "with_overrides"]

_SECTIONS: dict[str, type] = {
    "buckets": BucketConfig,
    "transport": TransportConfig,
    "consumer": ConsumerConfig,
    "producer": ProducerConfig,
    "model": ModelConfig,
    "features": FeatureConfig,
}


MAX_DURATION_S = 7 * 24 * 3600  # every *_s key: beyond a week is a typo, and 1e16 s overflows a poll timeout
_PATH_KEYS = ("_dir", "_file", "_key", "endpoint")  # optional paths and endpoints: null means the default


def _coerce(value: Any, annotation: str, path: tuple[str, ...]) -> Any:
    """Type-check one scalar against the dataclass annotation string.

    Every number is checked by class here (finite, fits in 64 bits) and every string (one printable
    line), whatever its key (shared/config/checks.py); the per-key ranges are in the dataclasses.
    """
    if value is None:
        if "None" in annotation:
            return None
        raise ConfigError("must not be null", path=path, got=value)
    if annotation.startswith("tuple"):
        if not isinstance(value, (list, tuple)):
            raise ConfigError("must be a list", path=path, got=value)
        for item in value:
            check_number(item, path)
        return tuple(value)
    base = annotation.split("|")[0].strip()
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError("must be true or false", path=path, got=value)
    elif base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError("must be an integer", path=path, got=value)
    elif base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str) and _looks_numeric(value):  # YAML 1.1 reads 1e-2 as a string
                hint = " (YAML 1.1 reads it as a string: write it with a dot and a signed exponent, 1.0e-2, or plainly)"
            raise ConfigError("must be a number" + hint, path=path, got=value)
        try:
            value = float(value)
        except OverflowError:  # an integer past 1.8e308
            raise ConfigError("must be a finite number", path=path, got=value) from None
    elif base == "str":
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on/yes/no as a boolean
            raise ConfigError(
                'must be a string (YAML read a bare off/on/yes/no as a boolean: quote it, e.g. "off")',
                path=path,
                got=value,
            )
        if not isinstance(value, str):
            raise ConfigError("must be a string", path=path, got=value)
        check_text(value, path)
        if "None" in annotation and path[-1].endswith(_PATH_KEYS) and not value.strip():
            raise ConfigError(
                "must be a path or null (an empty one would mean the current directory)", path=path, got=value
            )
    check_number(value, path)  # also where the annotation is not a plain type (e.g. model.jit_compile)
    if path[-1].endswith("_s") and isinstance(value, (int, float)) and value > MAX_DURATION_S:
        raise ConfigError(
            f"must be at most {MAX_DURATION_S} s (a week): a timer this long never fires, and "
            "some overflow the C types they reach",
            path=path,
            got=value,
        )
    return value


def _build(cls: type, data: Any, path: tuple[str, ...]) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError("must be a mapping", path=path, got=data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"unknown key (known: {', '.join(sorted(fields))})", path=path + (str(key),))
        if key in _SECTIONS and cls is PipelineConfig:
            kwargs[key] = _build(_SECTIONS[key], value if value is not None else {}, path + (key,))
        else:
            kwargs[key] = _coerce(value, str(fields[key].type), path + (key,))
    return cls(**kwargs)


def config_from_mapping(data: Mapping[str, Any] | None) -> PipelineConfig:
    """Build a validated config from a parsed YAML mapping (``None`` = all defaults)."""
    try:
        config: PipelineConfig = _build(PipelineConfig, data or {}, ())
        return config
    except RecursionError:  # model.params nested past the interpreter's limit (a mapping built in code)
        raise ConfigError("nested too deeply", path=("model", "params")) from None


def load_config(path: str | os.PathLike[str] | None) -> PipelineConfig:
    """Read and validate a YAML config file; ``None`` gives the defaults.

    Raises:
        ConfigError: unreadable, oversized, non-UTF-8 or non-regular file, bad YAML, an alias, a
            top level that is no mapping, unknown key or bad value (one line, names the file or key).
    """
    if path is None:
        return PipelineConfig()
    data = read_config_file(path)  # bounded, UTF-8 only, no aliases, a mapping (shared/yaml_safe.py)
    return config_from_mapping(data)


def config_to_mapping(cfg: PipelineConfig) -> dict[str, Any]:
    """Plain dict (lists, not tuples) that ``config_from_mapping`` turns back into ``cfg``."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return plain(cfg)  # type: ignore[no-any-return]


def with_overrides(cfg: PipelineConfig, overrides: Mapping[str, Any]) -> PipelineConfig:
    """Apply dotted-key overrides (``{"producer.count": 4}``), skipping ``None`` values.

    The result is validated like a loaded file, so a bad CLI value names its key too.
    """
    data = config_to_mapping(cfg)
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config_from_mapping(data)


def _looks_numeric(text: str) -> bool:
    """``1e-2``, ``5E3``, ``1.0e2``: a number YAML 1.1 reads as a string (its floats need a dot and a signed
    exponent)."""
    return re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", text.strip()) is not None
