"""HalfCaster: float32 -> float16 bit for bit as numpy's cast, over the whole float32 range."""

from __future__ import annotations

import numpy as np
import pytest

from melfeed.shared.wire.half_cast import HalfCaster

# float32 bit patterns where the result changes kind: 2**-25 (rounds to 0 or the least subnormal), 2**-14
# (least normal), 65520 (rounds to inf), 65536, inf; and 2**-24 (the least subnormal).
_THRESHOLDS = (0x3300_0000, 0x3380_0000, 0x3880_0000, 0x477F_F000, 0x4780_0000, 0x7F80_0000)


def _numpy(src: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return src.astype(np.float16)


def _check(bits: np.ndarray) -> None:
    src = bits.astype(np.uint32).view(np.float32)
    src = src[~np.isnan(src)]  # NaN payloads: refused as non-finite either way
    dst = np.empty(src.shape, np.float16)
    HalfCaster().cast(src, dst)
    want = _numpy(src)
    bad = np.flatnonzero(dst.view(np.uint16) != want.view(np.uint16))
    assert bad.size == 0, [(float(src[i]), float(dst[i]), float(want[i])) for i in bad[:5]]


def test_a_million_bit_patterns_spread_over_all_of_float32_round_as_numpy_does() -> None:
    _check(np.arange(0, 2**32, 4093, dtype=np.uint64))


@pytest.mark.parametrize("sign", [0, 0x8000_0000])
def test_every_pattern_near_each_threshold_rounds_as_numpy_does(sign: int) -> None:
    near = np.concatenate([np.arange(t - 4096, t + 4096, dtype=np.int64) for t in _THRESHOLDS])
    _check(near | sign)


def test_rows_of_any_shape_reuse_the_scratch_and_never_touch_other_rows() -> None:
    rng = np.random.default_rng(1)
    caster = HalfCaster()
    batch = np.full((3, 40, 6), 7.0, np.float16)
    for frames in (40, 3, 17):
        src = (rng.standard_normal((frames, 6)) * 9).astype(np.float32)
        caster.cast(src, batch[1, :frames])
        assert batch[1, :frames].tobytes() == _numpy(src).tobytes()
    assert (batch[0] == 7.0).all() and (batch[2] == 7.0).all()
