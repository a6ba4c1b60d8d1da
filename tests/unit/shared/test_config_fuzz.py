"""Any document, any value: a config loads into a valid ``PipelineConfig`` or fails with one ``ConfigError``
line, never another exception and never a hang (docs/reference/exit-codes.md, shared/config/checks.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import _SECTIONS, config_from_mapping, config_to_mapping, load_config
from melfeed.shared.errors import ConfigError

_ROOT_KEYS = [f.name for f in dataclasses.fields(PipelineConfig)]
_SECTION_KEYS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in _SECTIONS.items()}
_ALL_KEYS = sorted({*_ROOT_KEYS, *(k for keys in _SECTION_KEYS.values() for k in keys)})

# Real key names most of the time, junk (control characters included) otherwise.
_keys = st.sampled_from(_ALL_KEYS) | st.text(st.characters(codec="utf-8"), max_size=12)
_ints = st.integers() | st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**400, -1, 0])
_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, -0.0, 5e-324])
_texts = st.text(st.characters(codec="utf-8"), max_size=20) | st.sampled_from(
    [
        "ipc://",
        "ipc:///" + "x" * 120,
        "tcp://127.0.0.1",
        "tcp://h:0",
        "tcp://h:99999",
        "tcp://127.0.0.1:5555",
        "ipc:///tmp/a.sock",
        "ipc://@x",
        "auto",
        "shm",
        "zmq",
        "truncate",
        "drop",
        "a:b",
        "0,1",
        "a\x00b",
        "line\nbreak",
    ]
)
_scalars = st.none() | st.booleans() | _ints | _floats | _texts
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4), max_leaves=12
)


def _section(name: str) -> st.SearchStrategy[dict[str, Any]]:
    keys = st.sampled_from(_SECTION_KEYS[name]) | _keys
    return st.dictionaries(keys, _scalars | _values, max_size=5)


# Shaped like a config (sections of real keys) so the checks behind the type checks are reached too.
_documents = st.fixed_dictionaries(
    {},
    optional={
        **{name: _section(name) | _values for name in _SECTIONS},
        **{k: _scalars for k in _ROOT_KEYS if k not in _SECTIONS},
    },
) | st.dictionaries(_keys, _values, max_size=6)


def _assert_valid_or_one_line(call: Any, arg: Any) -> None:
    try:
        cfg = call(arg)
    except ConfigError as err:
        assert len(str(err).splitlines()) == 1, str(err)
        return
    assert isinstance(cfg, PipelineConfig)
    assert config_from_mapping(config_to_mapping(cfg)) == cfg
    for section in (cfg.transport, cfg.consumer, cfg.model, cfg.features):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            assert not isinstance(value, float) or math.isfinite(value), (f.name, value)
            assert not isinstance(value, int) or -(2**63) <= value < 2**63, (f.name, value)


@settings(max_examples=300, deadline=2000)
@given(_documents)
def test_any_mapping_gives_a_valid_config_or_one_config_error_line(doc: dict[str, Any]) -> None:
    _assert_valid_or_one_line(config_from_mapping, doc)


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_documents)
def test_any_yaml_file_gives_a_valid_config_or_one_config_error_line(tmp_path: Path, doc: dict[str, Any]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    _assert_valid_or_one_line(load_config, path)


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_any_file_content_gives_a_valid_config_or_one_config_error_line(tmp_path: Path, content: str | bytes) -> None:
    path = tmp_path / "c.yaml"
    if isinstance(content, str):
        path.write_bytes(content.encode("utf-8", errors="surrogatepass"))
    else:
        path.write_bytes(content)
    _assert_valid_or_one_line(load_config, path)
