"""Tests for melfeed.shared.cache.npyfile: header parsing across versions and every rejection reason."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from melfeed.shared.cache import npyfile
from melfeed.shared.cache.npyfile import NpyHeader, inspect_npy, parse_npy_header
from melfeed.shared.errors import CacheError


def _write_array(path: Path, arr: np.ndarray, version: tuple[int, int] | None) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, arr, version=version)


def _hand_built(
    text: str, version: tuple[int, int] = (1, 0), pad_to: int | None = None, encoding: str = "latin1"
) -> bytes:
    """A .npy preamble + header with ``text`` padded to exactly ``pad_to`` header bytes."""
    body = text.encode(encoding)
    if pad_to is not None:
        assert pad_to > len(body), "pad_to must leave room for the newline"
        body = body + b" " * (pad_to - len(body) - 1) + b"\n"
    width = 2 if version == (1, 0) else 4
    return b"\x93NUMPY" + bytes(version) + len(body).to_bytes(width, "little") + body


def _expect(path: Path, match: str) -> pytest.ExceptionInfo[CacheError]:
    with pytest.raises(CacheError, match=match) as info:
        inspect_npy(path)[0]
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)
    return info


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_reads_header_of_each_format_version(tmp_path: Path, version: tuple[int, int]) -> None:
    arr = np.arange(24, dtype=np.float32).reshape(6, 4)
    path = tmp_path / "a.npy"
    _write_array(path, arr, version)
    header, file_bytes = inspect_npy(path)
    assert header == NpyHeader(version, np.dtype("<f4"), (6, 4), False, file_bytes - arr.nbytes)
    assert header.nbytes == arr.nbytes
    raw = path.read_bytes()
    np.testing.assert_array_equal(np.frombuffer(raw[header.data_offset :], "<f4").reshape(6, 4), arr)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_long_shape_gives_header_longer_than_128(tmp_path: Path, version: tuple[int, int]) -> None:
    arr = np.zeros((1,) * 30 + (3,), dtype=np.int32)
    path = tmp_path / "long.npy"
    _write_array(path, arr, version)
    header = inspect_npy(path)[0]
    assert header.data_offset > 128
    assert header.shape == arr.shape
    assert header.data_offset == path.stat().st_size - arr.nbytes


@pytest.mark.parametrize("header_bytes", [59, 77, 128, 301])
@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_hand_built_header_of_odd_length(tmp_path: Path, version: tuple[int, int], header_bytes: int) -> None:
    text = "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }"
    data = np.array([7, 8, 9], dtype="<i4").tobytes()
    path = tmp_path / "odd.npy"
    path.write_bytes(_hand_built(text, version, header_bytes) + data)
    header = inspect_npy(path)[0]
    assert header.data_offset == (10 if version == (1, 0) else 12) + header_bytes
    assert (header.shape, header.dtype) == ((3,), np.dtype("<i4"))
    np.testing.assert_array_equal(np.load(path), [7, 8, 9])  # numpy agrees on the layout


def test_version3_header_is_utf8(tmp_path: Path) -> None:
    bad = _hand_built("{'descr': '<i4', 'fortran_order': False, 'shape': (0,), }", (3, 0))
    path = tmp_path / "v3.npy"
    path.write_bytes(bad[:-3] + b"\xff\xfe}")
    _expect(path, "header is not valid utf8")


def test_prefix_longer_than_header_is_fine(tmp_path: Path) -> None:
    buf = io.BytesIO()
    np.save(buf, np.ones((5, 3), dtype=np.float16))
    header = parse_npy_header(buf.getvalue(), "mem.npy")
    assert (header.shape, header.dtype, header.nbytes) == ((5, 3), np.dtype("<f2"), 30)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (570, 80), (3, 0, 2), (10**12,)])
@pytest.mark.parametrize("dtype", ["<f4", ">f8", "<f2", "|u1", "|b1", "<U3", "|S2", "<c16", "<i8"])
def test_fast_path_agrees_with_literal_eval(shape: tuple[int, ...], dtype: str) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    text = buf.getvalue()[10:].decode("latin1")
    assert npyfile._CANONICAL.fullmatch(text), text
    assert npyfile._parse_dict(text, "x") == npyfile._literal_dict(text, "x")


@pytest.mark.parametrize(
    "text",
    [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (570), }",  # an int, not a tuple
        "{'descr': '<f4', 'fortran_order': False, 'shape': (007,), }",  # leading zero
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2), 'x': 1}",
    ],
)
def test_fast_path_declines_non_canonical_text(text: str) -> None:
    assert npyfile._CANONICAL.fullmatch(text) is None


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"", "truncated header"),
        (b"\x93NUM", "truncated header"),
        (b"\x93NUMPY\x01", "truncated header"),
        (b"\x93NUMPY\x02\x00\x10", "truncated header"),
        (b"PK\x03\x04" + b"\x00" * 200, r"not a \.npy file \(bad magic\)"),
        (b"\x93NUMPY\x04\x00" + b"\x00" * 200, r"unsupported \.npy format version 4\.0"),
        (b"\x93NUMPY\x01\x01" + b"\x00" * 200, r"unsupported \.npy format version 1\.1"),
        (b"\x93NUMPY\x01\x00\x80\x00{'descr'", "truncated header"),
    ],
)
def test_rejects_broken_preamble(tmp_path: Path, raw: bytes, match: str) -> None:
    path = tmp_path / "bad.npy"
    path.write_bytes(raw)
    _expect(path, match)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("__import__('os').system('true')", r"malformed header \(ValueError\)"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (3,)", r"malformed header \(SyntaxError\)"),
        ("['descr', 'fortran_order', 'shape']", "a list, not a dict"),
        ("{'descr': '<f4', 'shape': (3,), }", r"malformed header \(keys"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x': 1}", r"malformed header \(keys"),
        ("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }", "structured dtype not allowed"),
        ("{'descr': '(2,)<f4', 'fortran_order': False, 'shape': (3,), }", "structured dtype not allowed"),
        ("{'descr': '|O', 'fortran_order': False, 'shape': (3,), }", "object dtype not allowed"),
        ("{'descr': 'nonsense', 'fortran_order': False, 'shape': (3,), }", "bad dtype descr"),
        ("{'descr': '<f4', 'fortran_order': True, 'shape': (3,), }", "Fortran order not supported"),
        ("{'descr': '<f4', 'fortran_order': 0, 'shape': (3,), }", "fortran_order must be a bool"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': [3], }", "shape must be a tuple"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (3), }", "shape must be a tuple"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (3, -1), }", "negative dimension"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (True,), }", "shape dims must be ints"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,), }", "shape dims must be ints"),
    ],
)
def test_rejects_bad_header_dict(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.npy"
    path.write_bytes(_hand_built(text, pad_to=118) + b"\x00" * 64)
    _expect(path, match)


def test_rejects_numpy_saved_structured_object_and_fortran(tmp_path: Path) -> None:
    np.save(tmp_path / "s.npy", np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")]))
    np.save(tmp_path / "o.npy", np.array([None, 1], dtype=object), allow_pickle=True)
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((3, 4), dtype=np.float32)))
    _expect(tmp_path / "s.npy", "structured dtype not allowed")
    _expect(tmp_path / "o.npy", "object dtype not allowed")
    _expect(tmp_path / "f.npy", "Fortran order not supported")


def test_rejects_truncated_data(tmp_path: Path) -> None:
    path = tmp_path / "t.npy"
    np.save(path, np.zeros((10, 4), dtype=np.float32))
    path.write_bytes(path.read_bytes()[:-9])
    _expect(path, "truncated: 151 data bytes, expected 160")


def test_missing_file_is_a_cache_error(tmp_path: Path) -> None:
    _expect(tmp_path / "nope.npy", "missing")


def test_nbytes_of_empty_and_scalar_arrays() -> None:
    assert NpyHeader((1, 0), np.dtype("<f4"), (0, 80), False, 128).nbytes == 0
    assert NpyHeader((1, 0), np.dtype("<f8"), (), False, 128).nbytes == 8
