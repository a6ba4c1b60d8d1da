"""Hostile config files: other encodings, alias bombs, huge or special files, non-mapping documents.

Every refusal is one ``ConfigError`` line naming the file; bounded by a timeout so a blocking open
(a FIFO) or an expanding alias bomb fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from melfeed.shared.config.loader import load_config
from melfeed.shared.errors import ConfigError
from melfeed.shared.yaml_safe import MAX_CONFIG_BYTES, read_config_file

REPO = Path(__file__).resolve().parents[3]
_BOUND_S = 20

BILLION_LAUGHS = "\n".join(
    ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)]
    + ["seed: *i", ""]
)


def _refused(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    return text[len(f"{path}: ") :]


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "melfeed.yaml"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data", "offset", "byte"),
    [
        ("seed: 3\ncache_dir: /data/caf\xe9\n".encode("latin-1"), 28, 0xE9),  # Latin-1 e-acute
        ("seed: 3\n".encode("utf-16"), 0, 0xFF),  # UTF-16 with its BOM
        (b"seed: 3\n\x00\x9c\x12\xffjunk", 9, 0x9C),  # binary junk
    ],
)
def test_a_file_that_is_not_utf8_names_the_offset_of_the_first_bad_byte(
    tmp_path: Path, data: bytes, offset: int, byte: int
) -> None:
    why = _refused(_write(tmp_path, data))
    assert why.startswith(f"not UTF-8: byte 0x{byte:02x} at byte offset {offset}"), why


def test_utf16_says_so_and_a_utf8_bom_is_fine(tmp_path: Path) -> None:
    bom_le = b"\xff\xfe" + "seed: 3\n".encode("utf-16-le")
    assert "(a UTF-16 little-endian byte-order mark)" in _refused(_write(tmp_path, bom_le))
    assert load_config(_write(tmp_path, "\ufeffseed: 4\ncache_dir: /data/café\n".encode())).seed == 4


def test_a_control_character_names_its_byte_offset(tmp_path: Path) -> None:
    why = _refused(_write(tmp_path, "cache_dir: /é\x00\n".encode()))
    assert why == "invalid YAML: character U+0000 at byte offset 14 is not allowed"


@pytest.mark.timeout(_BOUND_S)
def test_an_alias_bomb_is_refused_at_the_first_alias_without_expanding(tmp_path: Path) -> None:
    why = _refused(_write(tmp_path, BILLION_LAUGHS.encode()))
    assert why.startswith("YAML alias *a at line 2: anchors and aliases are not allowed"), why


def test_a_merge_key_alias_is_refused_too(tmp_path: Path) -> None:
    text = "base: &b {seed: 1}\nproducer:\n  count: 2\nconsumer:\n  <<: *b\n"
    assert _refused(_write(tmp_path, text.encode())).startswith("YAML alias *b at line 5:")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "buckets: {batch_size: -1, bogus: 1}\nbuckets: {num_buckets: 2}\n",
            "key 'buckets' at line 2 repeats the one at line 1",
        ),
        ("consumer:\n  steps: 3\n  ring_slots: 4\n  steps: 4\n", "key 'steps' at line 4 repeats the one at line 2"),
        ("consumer: {steps: 3, steps: 4}\n", "key 'steps' at line 1 repeats the one at line 1"),
        ("seed: 5\nseed: 7\n", "key 'seed' at line 2 repeats the one at line 1"),
    ],
)
def test_a_key_written_twice_in_one_mapping_is_refused_with_both_lines(tmp_path: Path, text: str, where: str) -> None:
    assert _refused(_write(tmp_path, text.encode())) == f"{where} of the same mapping: write each key once"


def test_the_same_key_in_two_mappings_is_fine(tmp_path: Path) -> None:
    path = _write(tmp_path, b"consumer: {steps: 3}\nproducer: {count: 2}\nmodel: {params: {steps: 1}}\n")
    assert read_config_file(path) == {
        "consumer": {"steps": 3},
        "producer": {"count": 2},
        "model": {"params": {"steps": 1}},
    }


@pytest.mark.parametrize(("text", "kind"), [("- seed\n- 3\n", "list"), ("just a string\n", "str"), ("42\n", "int")])
def test_the_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    why = _refused(_write(tmp_path, text.encode()))
    assert why == f"the top level must be a mapping (key: value lines), got a value of type {kind}"


def test_an_empty_file_still_means_all_defaults(tmp_path: Path) -> None:
    assert read_config_file(_write(tmp_path, b"# nothing set\n")) is None


def test_a_file_larger_than_the_bound_is_refused_unread(tmp_path: Path) -> None:
    path = _write(tmp_path, b"seed: 1\n" + b"#" * MAX_CONFIG_BYTES + b"\n")
    assert _refused(path) == f"config file is {MAX_CONFIG_BYTES + 9} bytes, larger than the {MAX_CONFIG_BYTES} allowed"


def test_deep_nesting_is_one_line_not_a_recursion_traceback(tmp_path: Path) -> None:
    assert (
        _refused(_write(tmp_path, b"seed: " + b"[" * 50_000 + b"]" * 50_000 + b"\n"))
        == "invalid YAML: nested too deeply"
    )


@pytest.mark.timeout(_BOUND_S)
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_a_config_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "melfeed.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    want = {"fifo": "fifo", "dev_zero": "character device", "directory": "directory"}[kind]
    assert _refused(path) == f"not a regular file ({want})"


@pytest.mark.timeout(3 * _BOUND_S)
@pytest.mark.parametrize("case", ["latin1", "alias_bomb", "list"])
def test_cli_exits_78_with_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    data = {
        "latin1": "cache_dir: /caf\xe9\n".encode("latin-1"),
        "alias_bomb": BILLION_LAUGHS.encode(),
        "list": b"- 1\n",
    }[case]
    path = _write(tmp_path, data)
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed", "consumer", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=2 * _BOUND_S,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 78, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"melfeed consumer: {path}: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_configs_melfeed_writes_for_its_children_load_back(tmp_path: Path) -> None:
    """Guard: the effective config handed to producers (safe_dump of config_to_mapping) has no aliases."""
    import yaml

    from melfeed.shared.config.loader import config_from_mapping, config_to_mapping

    cfg = config_from_mapping(
        {"cache_dir": "/data/caché", "buckets": {"boundaries": [400, 800]}, "producer": {"count": 2}}
    )
    path = _write(tmp_path, yaml.safe_dump(config_to_mapping(cfg), sort_keys=False).encode())
    assert load_config(path) == cfg
