"""float32 -> float16 rounding for a float16 wire (``transport.mel_dtype: float16``), faster than numpy's cast.

Role: ``HalfCaster.cast`` writes exactly what ``src.astype(np.float16)`` gives (round to nearest, ties to
even; inf beyond float16's range), in less CPU than numpy's cast (docs/guide/caches.md, "Steps"): numpy converts
one element at a time, while this is a dozen vectorised integer passes over the bits (the
classic rebias-and-round: add the exponent bias difference and a rounding bias whose last bit is the
result's mantissa parity, then shift), in reused scratch buffers. Elements whose result is not a
normal float16 (zero, subnormal, inf, NaN: |x| < 2**-14 or >= 65536) are few in log-mels and are
redone with numpy's own cast, so every element is exact by construction on both branches.
Invariant: ``cast(src, dst)`` == ``np.copyto(dst, src)`` bit for bit (tests/unit/shared/wire/test_half_cast.py
checks a million bit patterns spread over all of float32 and every pattern near each threshold).
Not thread-safe (shared scratch); one per reader. Shutdown: nothing to release.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["HalfCaster"]

_ABS = np.uint32(0x7FFF_FFFF)
_REBIAS_AND_ROUND = np.uint32(0xC800_0FFF)  # (15 - 127) << 23, wrapped, plus 0xFFF: ties go to the parity bit
_MANTISSA_SHIFT = np.uint32(13)  # 23 - 10 mantissa bits
_ONE = np.uint32(1)
_MIN_NORMAL = np.uint32(0x3880_0000)  # 2**-14 as float32 bits: below it the result is subnormal or 0
_NORMAL_SPAN = np.uint32(0x4780_0000 - 0x3880_0000)  # up to 65536: at or above it, inf or NaN
_SIGN_SHIFT = np.uint32(16)
_SIGN16 = np.uint32(0x8000)


class HalfCaster:
    """Reusable scratch for ``cast`` (grown on demand, bounded by the largest row cast)."""

    def __init__(self) -> None:
        self._a = np.empty(0, np.uint32)
        self._b = np.empty(0, np.uint32)
        self._outside = np.empty(0, bool)

    def cast(self, src: npt.NDArray[np.float32], dst: npt.NDArray[np.float16]) -> None:
        """``dst[...] = src`` rounded to float16, as numpy rounds; both C-contiguous, of one shape."""
        bits = src.reshape(-1).view(np.uint32)
        n = bits.size
        if self._a.size < n:
            self._a, self._b, self._outside = np.empty(n, np.uint32), np.empty(n, np.uint32), np.empty(n, bool)
        mag = np.bitwise_and(bits, _ABS, out=self._a[:n])
        out = np.right_shift(mag, _MANTISSA_SHIFT, out=self._b[:n])
        np.bitwise_and(out, _ONE, out=out)  # the result's mantissa parity
        np.add(out, mag, out=out)
        np.add(out, _REBIAS_AND_ROUND, out=out)  # wraps modulo 2**32 like the C original
        np.right_shift(out, _MANTISSA_SHIFT, out=out)
        np.subtract(mag, _MIN_NORMAL, out=mag)  # wraps: below 2**-14 becomes huge
        outside = np.greater_equal(mag, _NORMAL_SPAN, out=self._outside[:n])
        sign = np.right_shift(bits, _SIGN_SHIFT, out=mag)
        np.bitwise_and(sign, _SIGN16, out=sign)
        np.bitwise_or(out, sign, out=out)
        flat = dst.reshape(-1).view(np.uint16)
        np.copyto(flat, out, casting="unsafe")  # the low 16 bits: the float16's
        if outside.any():
            where = np.flatnonzero(outside)
            with np.errstate(over="ignore"):  # beyond range -> inf: the reader refuses it
                flat[where] = src.reshape(-1)[where].astype(np.float16).view(np.uint16)
