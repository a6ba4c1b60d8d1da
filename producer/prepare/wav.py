"""Decode RIFF/WAVE files into mono float64 samples, without the ``wave`` module's limits.

Role: ``prepare`` reads every corpus wav through ``read_wav``. The standard library's ``wave``
reads integer PCM only; corpora also ship IEEE float and WAVE_FORMAT_EXTENSIBLE files, so the
chunks are parsed here.

Supported: PCM 8 (unsigned), 16, 24 and 32 bit; IEEE float 32 and 64 bit; format tag 1
(PCM), 3 (float) or 0xFFFE (extensible, with a PCM or float sub-format); any channel count,
mixed down to mono by the mean of the channels. Not supported (rejected with a reason):
RF64, compressed formats (A-law, mu-law, ADPCM, MP3), 12/20-bit containers.

Invariants:
- Samples come back as float64 in [-1, 1] for integer PCM (full scale = 2**(bits-1)); float
  files are passed through unscaled (values beyond +-1 are kept) but must be finite.
- Every rejection raises ``CacheError(path, reason)``: one line naming the file; nothing else
  escapes for a malformed file (a missing or unreadable file is a ``CacheError`` too).
- The file is read whole (utterances are megabytes at most) and parsed from memory, so chunk
  order and unknown chunks (LIST, fact, cue ...) do not matter.
Shutdown: nothing to shut down; the file is closed before returning.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from melfeed.shared.cache.filekind import open_regular
from melfeed.shared.errors import CacheError

__all__ = ["WavInfo", "read_wav", "parse_wav"]

log = logging.getLogger(__name__)

_PCM, _FLOAT, _EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
# The 14 bytes after the 2-byte format tag in every standard KSDATAFORMAT_SUBTYPE_* GUID.
_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
_FMT_MIN_BYTES = 16  # WAVEFORMAT: tag, channels, rate, byte rate, block align, bits
_EXT_MIN_BYTES = 40  # WAVEFORMATEXTENSIBLE: + cbSize, valid bits, channel mask, GUID
_PCM_DTYPES = {16: "<i2", 32: "<i4"}
_FLOAT_DTYPES = {32: "<f4", 64: "<f8"}


@dataclass(frozen=True, slots=True)
class WavInfo:
    """What the fmt chunk says, plus the frame count of the data chunk."""

    sample_rate_hz: int
    channels: int
    bits: int  # container bits per sample: 8, 16, 24, 32 or 64
    is_float: bool  # IEEE float (True) or integer PCM (False)
    frames: int  # samples per channel

    @property
    def duration_s(self) -> float:
        """Length of the audio in seconds."""
        return self.frames / self.sample_rate_hz


def _chunks(data: bytes, path: str | os.PathLike[str]) -> dict[bytes, tuple[int, int]]:
    """Map chunk id -> (start, size) of its body, first occurrence wins; checks the RIFF header."""
    if len(data) < 12:
        raise CacheError(path, f"not a wav file (only {len(data)} bytes)")
    if data[:4] == b"RF64":
        raise CacheError(path, "RF64 wav files are not supported")
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise CacheError(path, "not a wav file (no RIFF/WAVE header)")
    chunks: dict[bytes, tuple[int, int]] = {}
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        start = pos + 8
        if start + size > len(data):
            raise CacheError(
                path, f"truncated {cid.decode('latin1')!r} chunk: declares {size} bytes, file has {len(data) - start}"
            )
        chunks.setdefault(cid, (start, size))
        pos = start + size + (size & 1)  # chunks are padded to an even size
    return chunks


def _parse_fmt(body: bytes, path: str | os.PathLike[str]) -> tuple[int, int, int, int, int]:
    """(format, channels, rate, block_align, bits) with the extensible sub-format resolved."""
    if len(body) < _FMT_MIN_BYTES:
        raise CacheError(path, f"fmt chunk too short ({len(body)} bytes)")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", body)
    if tag == _EXTENSIBLE:
        if len(body) < _EXT_MIN_BYTES:
            raise CacheError(path, f"extensible fmt chunk too short ({len(body)} bytes)")
        guid = body[24:40]
        if guid[2:] != _GUID_TAIL:
            raise CacheError(path, "unsupported extensible sub-format GUID")
        tag = int.from_bytes(guid[:2], "little")
    return tag, channels, rate, block_align, bits


def _check_format(fmt: tuple[int, int, int, int, int], path: str | os.PathLike[str]) -> None:
    tag, channels, rate, block_align, bits = fmt
    if tag not in (_PCM, _FLOAT):
        raise CacheError(path, f"unsupported wav format tag 0x{tag:04x} (PCM or IEEE float only)")
    if tag == _PCM and bits not in (8, 16, 24, 32):
        raise CacheError(path, f"unsupported PCM bit depth {bits} (8, 16, 24 or 32)")
    if tag == _FLOAT and bits not in _FLOAT_DTYPES:
        raise CacheError(path, f"unsupported float bit depth {bits} (32 or 64)")
    if channels < 1 or rate < 1:
        raise CacheError(path, f"bad fmt chunk: channels={channels} sample rate={rate}")
    if block_align != channels * bits // 8:
        raise CacheError(path, f"bad fmt chunk: block align {block_align} != {channels} channels x {bits // 8} bytes")


def _decode(raw: bytes, is_float: bool, bits: int) -> npt.NDArray[np.float64]:
    """Interleaved samples as float64 (integer PCM scaled to [-1, 1))."""
    if is_float:
        return np.frombuffer(raw, dtype=_FLOAT_DTYPES[bits]).astype(np.float64)
    if bits == 8:  # 8-bit PCM is unsigned with its midpoint at 128
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    if bits == 24:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)  # sign-extend
        return ints.astype(np.float64) / float(1 << 23)
    return np.frombuffer(raw, dtype=_PCM_DTYPES[bits]).astype(np.float64) / float(1 << (bits - 1))


def parse_wav(data: bytes, path: str | os.PathLike[str]) -> tuple[npt.NDArray[np.float64], WavInfo]:
    """Decode a whole wav file held in memory.

    Args:
        data: The file's bytes.
        path: The file they came from; used only in error messages.

    Returns:
        ``(samples, info)``: mono float64 samples [frames] (channels averaged) and the format.

    Raises:
        CacheError: Not RIFF/WAVE, a truncated chunk, no fmt or data chunk, an unsupported
            format, a data size that is not a whole number of frames, no samples, or
            non-finite float samples.
    """
    chunks = _chunks(data, path)
    if b"fmt " not in chunks:
        raise CacheError(path, "no fmt chunk")
    if b"data" not in chunks:
        raise CacheError(path, "no data chunk")
    start, size = chunks[b"fmt "]
    fmt = _parse_fmt(data[start : start + size], path)
    _check_format(fmt, path)
    tag, channels, rate, block_align, bits = fmt
    start, size = chunks[b"data"]
    if size % block_align:
        raise CacheError(path, f"data chunk of {size} bytes is not a whole number of {block_align}-byte frames")
    if size == 0:
        raise CacheError(path, "no audio samples")
    samples = _decode(data[start : start + size], tag == _FLOAT, bits).reshape(-1, channels)
    mono = samples[:, 0] if channels == 1 else samples.mean(axis=1)
    if tag == _FLOAT and not np.isfinite(mono).all():
        raise CacheError(path, "non-finite float samples (NaN or inf)")
    return mono, WavInfo(rate, channels, bits, tag == _FLOAT, mono.shape[0])


def read_wav(path: str | os.PathLike[str]) -> tuple[npt.NDArray[np.float64], WavInfo]:
    """Read and decode a wav file; see ``parse_wav``.

    Raises:
        CacheError: The file is missing, not a regular file, unreadable or malformed (one line naming it).
    """
    try:
        fd, _ = open_regular(path)  # a FIFO or device among the wavs is reported, never blocked on
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    except OSError as err:
        raise CacheError(path, f"cannot read ({err.strerror})") from err
    return parse_wav(data, path)
