"""Config values refused by class (shared/config/checks.py): each refusal is one line naming the key."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.checks import MAX_IPC_PATH_BYTES, check_output_paths, check_ring_bytes, physical_memory_bytes
from melfeed.shared.config.loader import _SECTIONS, config_from_mapping, load_config
from melfeed.shared.errors import ConfigError

_HUGE = 2**63


def _refusal(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(data)
    text = str(info.value)
    assert len(text.splitlines()) == 1, text
    return text


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"model": {"learning_rate": float("nan")}}, "model.learning_rate: must be a finite number, got nan"),
        (
            {"transport": {"lease_timeout_s": float("inf")}},
            "transport.lease_timeout_s: must be a finite number, got inf",
        ),
        ({"features": {"fmax_hz": float("-inf")}}, "features.fmax_hz: must be a finite number, got -inf"),
        ({"consumer": {"status_interval_s": 10**400}}, "consumer.status_interval_s: must be a finite number"),
        ({"model": {"params": {"dropout": [0.1, float("nan")]}}}, "model.params.dropout: must be a finite number"),
        ({"buckets": {"boundaries": [100, float("inf")]}}, "buckets.boundaries: must be a finite number"),
        ({"seed": float("nan")}, "seed: must be an integer, got nan"),
    ],
)
def test_non_finite_numbers_are_refused_wherever_a_float_is_read(data: dict[str, Any], expected: str) -> None:
    assert expected in _refusal(data)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"consumer": {"steps": _HUGE}}, "consumer.steps: must fit in a signed 64-bit integer"),
        (
            {"consumer": {"warmup_steps": 10**5000}},
            "consumer.warmup_steps: must fit in a signed 64-bit integer "
            "(|value| < 2**63), got an integer of about 5000 digits",
        ),
        ({"buckets": {"boundaries": [8, _HUGE]}}, "buckets.boundaries: must fit in a signed 64-bit integer"),
        ({"model": {"params": {"units": -_HUGE - 1}}}, "model.params.units: must fit in a signed 64-bit integer"),
        ({"buckets": {"batch_size": 2**31}}, "buckets.batch_size: must be <= 2147483647 (an int32 on the wire)"),
        ({"buckets": {"max_frames": 2**40}}, "buckets.max_frames: must be <= 2147483647"),
        ({"buckets": {"boundaries": [8, 2**32]}}, "buckets.boundaries: must be <= 2147483647"),
        ({"model": {"vocab_size": 2**31}}, "model.vocab_size: must be <= 2147483647"),
    ],
)
def test_integers_past_what_the_wire_carries_are_refused(data: dict[str, Any], expected: str) -> None:
    assert expected in _refusal(data)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"seed": -1}, "seed: must be an integer in 0..2**63-1, got -1"),
        ({"seed": 2**63}, "seed: must fit in a signed 64-bit integer"),
        ({"model": {"seed": -5}}, "model.seed: must be an integer in 0..2**63-1, got -5"),
    ],
)
def test_seeds_outside_0_to_2_63_are_refused(data: dict[str, Any], expected: str) -> None:
    assert expected in _refusal(data)


def _typed_keys(kind: str) -> list[tuple[str, ...]]:
    """Every key whose annotation starts with ``kind`` (``int``/``float``), as a path."""
    keys: list[tuple[str, ...]] = [
        (f.name,) for f in dataclasses.fields(PipelineConfig) if str(f.type).startswith(kind)
    ]
    for name, cls in _SECTIONS.items():
        keys += [(name, f.name) for f in dataclasses.fields(cls) if str(f.type).startswith(kind)]
    return keys


def _nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    return {path[0]: value} if len(path) == 1 else {path[0]: {path[1]: value}}


@pytest.mark.parametrize("path", _typed_keys("float"), ids=".".join)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_float_key_refuses_non_finite_values(path: tuple[str, ...], value: float) -> None:
    assert _refusal(_nested(path, value)).startswith(f"{'.'.join(path)}: must be a finite number")


@pytest.mark.parametrize("path", _typed_keys("int"), ids=".".join)
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30])
def test_every_int_key_refuses_values_past_64_bits(path: tuple[str, ...], value: int) -> None:
    assert _refusal(_nested(path, value)).startswith(f"{'.'.join(path)}: must fit in a signed 64-bit integer")


def test_the_largest_seed_is_accepted() -> None:
    cfg = config_from_mapping({"seed": 2**63 - 1, "model": {"seed": 2**63 - 1}})
    assert cfg.seed == cfg.model.seed == 2**63 - 1


@pytest.mark.parametrize("value", ["a\x00b", "line\nbreak", "esc\x1b[2J", "tab\there"])
def test_strings_with_control_characters_are_refused(value: str) -> None:
    text = _refusal({"consumer": {"state_dir": value}})
    assert text.startswith("consumer.state_dir: must not contain control characters")


@pytest.mark.parametrize(
    "endpoint, expected",
    [
        ("ipc://", "ipc:// needs a socket path"),
        ("ipc://melfeed.sock", "needs an absolute socket path (ipc:///DIR/NAME.sock)"),
        ("ipc://./run/melfeed.sock", "needs an absolute socket path (ipc:///DIR/NAME.sock)"),
        ("ipc:///" + "d" * MAX_IPC_PATH_BYTES, f"socket path is {MAX_IPC_PATH_BYTES + 1} bytes, longer than the 107"),
        ("tcp://127.0.0.1", "must be tcp://HOST:PORT"),
        ("tcp://:5555", "must be tcp://HOST:PORT"),
        ("tcp://127.0.0.1:0", "port must be in 1..65535"),
        ("tcp://127.0.0.1:65536", "port must be in 1..65535"),
        ("tcp://127.0.0.1:http", "port must be in 1..65535"),
    ],
)
def test_unusable_endpoints_are_refused(endpoint: str, expected: str) -> None:
    text = _refusal({"transport": {"endpoint": endpoint, "insecure": True}})
    assert text.startswith("transport.endpoint: ") and expected in text


def test_usable_endpoints_are_accepted() -> None:
    for endpoint in ("ipc:///run/melfeed/melfeed.sock", "tcp://10.0.0.1:5555", "tcp://[::1]:65535"):
        assert config_from_mapping({"transport": {"endpoint": endpoint}}).transport.endpoint == endpoint


@pytest.mark.parametrize("section, key", [("transport", "endpoint"), ("consumer", "control_endpoint")])
def test_an_abstract_socket_is_refused_unless_the_transport_is_declared_insecure(section: str, key: str) -> None:
    text = _refusal({section: {key: "ipc://@alicefeed"}})
    assert text.startswith(f"{section}.{key}: is an abstract unix socket, which every local user can connect")
    insecure = config_from_mapping(
        {section: {key: "ipc://@alicefeed"}, "transport": {"insecure": True}}
        if section == "consumer"
        else {section: {key: "ipc://@alicefeed", "insecure": True}}
    )
    assert getattr(getattr(insecure, section), key) == "ipc://@alicefeed"


def test_a_yaml_document_with_nan_inf_and_huge_ints_is_refused_line_by_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    for doc, expected in [
        ("model: {learning_rate: .nan}", "model.learning_rate: must be a finite number"),
        ("transport: {heartbeat_interval_s: .inf}", "must be a finite number"),
        ("seed: 99999999999999999999", "seed: must fit in a signed 64-bit integer"),
        ("seed: " + "9" * 5000, "invalid YAML: a value cannot be read"),
        ("cache_dir: 2001-13-45", "invalid YAML: a value cannot be read"),
    ]:
        path.write_text(doc)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert expected in str(info.value) and len(str(info.value).splitlines()) == 1


def test_config_error_text_is_one_line_whatever_the_key_or_value() -> None:
    err = ConfigError("bad\nthing", path=("a\nb", "c\u2028d"), got="x\r\ny" * 500)
    assert len(str(err).splitlines()) == 1 and len(str(err)) < 400
    assert "got a value of type int that cannot be shown" in str(ConfigError("m", got=10**5000))


def test_unknown_key_with_a_newline_is_one_line() -> None:
    assert "evil\\nINFO forged: unknown key" in _refusal({"evil\nINFO forged": 1})


def test_output_paths_need_an_existing_writable_directory(tmp_path: Path) -> None:
    check_output_paths(
        {("consumer", "metrics_file"): str(tmp_path / "m.jsonl"), ("x",): None},
        {("transport", "endpoint"): f"ipc://{tmp_path}/s.sock", ("y",): "tcp://127.0.0.1:5555"},
    )
    with pytest.raises(ConfigError, match=r"^consumer.metrics_file: directory .*/nope does not exist$"):
        check_output_paths({("consumer", "metrics_file"): str(tmp_path / "nope" / "m.jsonl")}, {})
    with pytest.raises(ConfigError, match=r"^transport.endpoint: directory .*/gone does not exist$"):
        check_output_paths({}, {("transport", "endpoint"): f"ipc://{tmp_path}/gone/s.sock"})
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: nothing to refuse
        pytest.skip("running as root")
    with pytest.raises(ConfigError, match=r"^--summary-json: directory .*/ro is not writable$"):
        check_output_paths({("--summary-json",): str(locked / "s.json")}, {})


def test_a_ring_larger_than_memory_is_refused_naming_the_buckets() -> None:
    check_ring_bytes(3, 1 << 20, 1 << 30)
    check_ring_bytes(3, 1 << 40, None)  # the platform does not say: nothing to compare
    with pytest.raises(
        ConfigError,
        match=r"^buckets: a ring of 4 slots x the largest batch \(1073741824 bytes\) "
        r"needs 4294967296 bytes, more than this machine's 1073741824; ",
    ):
        check_ring_bytes(4, 1 << 30, 1 << 30)
    memory = physical_memory_bytes()
    assert memory is None or memory > 0


@pytest.mark.parametrize(
    "section, key",
    [
        ("", "cache_dir"),
        ("consumer", "state_dir"),
        ("consumer", "xla_cache_dir"),
        ("consumer", "metrics_file"),
        ("transport", "shm_dir"),
        ("transport", "curve_allowed_dir"),
        ("transport", "endpoint"),
    ],
)
def test_an_empty_path_is_refused_where_null_means_the_default(section: str, key: str) -> None:
    mapping: dict[str, object] = {key: " "} if not section else {section: {key: ""}}
    text = _refusal(mapping)
    assert text.startswith(f"{section + '.' if section else ''}{key}: must be a path or null"), text
    assert config_from_mapping({"consumer": {"model_gpu": ""}}).consumer.model_gpu == ""  # "" = no GPU: a value


@pytest.mark.parametrize(
    "section, key",
    [
        ("transport", "heartbeat_interval_s"),
        ("transport", "lease_timeout_s"),
        ("consumer", "status_interval_s"),
        ("consumer", "wait_timeout_s"),
    ],
)
def test_a_duration_beyond_a_week_is_refused_by_class(section: str, key: str) -> None:
    assert _refusal({section: {key: 1.0e16}}).startswith(f"{section}.{key}: must be at most 604800 s (a week)")
    assert getattr(getattr(config_from_mapping({section: {key: 3600}}), section), key) == 3600
