"""CacheReader into float16 rows (``transport.mel_dtype: float16``): exact casts, overflow and NaN refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from melfeed.producer.reader import CacheReader
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.errors import CacheError

N_MELS = 6
# float32 values at float16's edges: its largest (65504), the largest that still rounds to it, a tie that
# rounds to even, the smallest normal and subnormals, values that round to zero, negative zero.
_EDGES = np.array(
    [
        65504.0,
        65519.996,
        -65519.996,
        1.0009765625 + 2.0**-11,
        6.1035156e-05,
        5.96e-08,
        2.0e-08,
        1.0e-30,
        -0.0,
        0.0,
        3.14159265,
        -2.71828183,
    ],
    dtype=np.float32,
)


@pytest.fixture
def manifest(tmp_path: Path) -> Manifest:
    rng = np.random.default_rng(3)
    (tmp_path / "mels").mkdir()
    (tmp_path / "tokens").mkdir()
    for uid, frames, dtype in (("a", 9, "<f4"), ("b", 5, "<f2"), ("c", 12, "<f4")):
        mel = (rng.normal(size=(frames, N_MELS)) * 4).astype(dtype)
        if uid == "c":
            mel.reshape(-1)[: _EDGES.size] = _EDGES
        np.save(tmp_path / "mels" / f"{uid}.npy", mel)
        np.save(tmp_path / "tokens" / f"{uid}.npy", np.arange(1, 4, dtype=np.int32))
    built, problems = build_manifest(tmp_path, N_MELS)
    assert problems == []
    return built


def test_a_reader_takes_rows_of_its_own_mel_dtype_only(manifest: Manifest) -> None:
    with pytest.raises(ValueError, match="float16"):
        CacheReader(manifest, mel_dtype="float16").read_mel_into(0, np.empty((16, N_MELS), np.float32))
    with pytest.raises(ValueError, match="float32"):
        CacheReader(manifest).read_mel_into(0, np.empty((16, N_MELS), np.float16))
    with pytest.raises(ValueError, match="mel_dtype"):
        CacheReader(manifest, mel_dtype="bfloat16")


def _poke(path: Path, frame: int, col: int, value: float) -> None:
    mel = np.load(path)
    mel[frame, col] = value
    np.save(path, mel)


@pytest.mark.parametrize("index", [0, 1, 2])  # float32 cast, float16 read as is, float32 at the edges
def test_float16_rows_equal_numpy_astype_bit_for_bit_with_a_zeroed_tail(manifest: Manifest, index: int) -> None:
    reader = CacheReader(manifest, mel_dtype="float16")
    batch = np.full((2, 16, N_MELS), np.nan, dtype=np.float16)
    for _ in range(2):  # the second read skips the finite check: same bytes
        n = reader.read_mel_into(index, batch[1])
        want = np.load(manifest.mel_path(index)).astype(np.float16)
        assert n == len(want)
        assert batch[1, :n].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
        assert not batch[1, n:].any() and np.isnan(batch[0]).all()


def test_a_float16_file_is_read_into_a_float16_row_without_staging(manifest: Manifest) -> None:
    reader = CacheReader(manifest, mel_dtype="float16")
    reader.read_mel_into(1, np.empty((16, N_MELS), np.float16))
    assert reader._scratch.size == 0  # straight into the row: no conversion at all


@pytest.mark.parametrize("value", [65520.0, 70000.0, -1.0e6, 3.0e38])
def test_a_float32_value_beyond_float16_range_is_refused_naming_the_file(manifest: Manifest, value: float) -> None:
    path = manifest.mel_path(0)
    _poke(path, 4, 1, value)
    _poke(path, 6, 2, 65504.0)  # representable: fine
    reader = CacheReader(manifest, mel_dtype="float16")
    with pytest.raises(CacheError) as info:
        reader.read_mel_into(0, np.empty((16, N_MELS), np.float16))
    assert info.value.path == str(path)
    assert info.value.reason.startswith("1 values beyond float16's range (largest |x| ")
    assert "first at frame 4:" in info.value.reason and "transport.mel_dtype float16" in info.value.reason
    assert CacheReader(manifest).read_mel_into(0, np.empty((16, N_MELS), np.float32)) == 9  # float32 carries it
    with pytest.raises(CacheError, match="beyond float16's range"):  # refused again, never cached as good
        reader.read_mel_into(0, np.empty((16, N_MELS), np.float16))


@pytest.mark.parametrize("index", [0, 1])  # float32 file cast, float16 file as is
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_on_a_float16_wire(manifest: Manifest, index: int, value: float) -> None:
    path = manifest.mel_path(index)
    _poke(path, 3, 2, value)
    _poke(path, 4, 0, 1.0e6 if index == 0 else 1.0)  # an overflow beside a NaN: the file's own fault first
    with pytest.raises(CacheError) as info:
        CacheReader(manifest, mel_dtype="float16").read_mel_into(index, np.empty((16, N_MELS), np.float16))
    assert info.value.path == str(path)
    assert info.value.reason.startswith(f"{2 if index == 0 else 1} non-finite values (NaN/Inf) in the first ")
    assert "first at frame 3;" in info.value.reason
