"""Tests for melfeed.producer.prepare.wav: every supported encoding decodes exactly, every malformed file is one line
naming it."""

from __future__ import annotations

import os
import struct
import wave
from pathlib import Path

import numpy as np
import pytest

from melfeed.producer.prepare.wav import parse_wav, read_wav
from melfeed.shared.errors import CacheError

_INTS = np.array([0, 1, -1, 1000, -1000, 32767, -32768, 12345], dtype=np.int64)
_KS_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"


def _fmt(tag: int, channels: int, rate: int, bits: int, extensible_tag: int | None = None) -> bytes:
    block = channels * bits // 8
    base = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    if extensible_tag is None:
        return base
    return base + struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", extensible_tag) + _KS_TAIL


def _riff(*chunks: tuple[bytes, bytes]) -> bytes:
    body = b"WAVE" + b"".join(
        cid + struct.pack("<I", len(data)) + data + b"\0" * (len(data) & 1) for cid, data in chunks
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _wave_module(path: Path, width: int, channels: int, raw: bytes, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


@pytest.mark.parametrize(("width", "scale"), [(2, 2**15), (3, 2**23), (4, 2**31)])
def test_pcm_written_by_the_wave_module_decodes_exactly(tmp_path: Path, width: int, scale: int) -> None:
    ints = _INTS * (scale // 2**15)
    raw = b"".join(int(v).to_bytes(width, "little", signed=True) for v in ints)
    _wave_module(tmp_path / "a.wav", width, 1, raw)
    samples, info = read_wav(tmp_path / "a.wav")
    assert (info.sample_rate_hz, info.channels, info.bits, info.is_float, info.frames) == (
        16000,
        1,
        8 * width,
        False,
        8,
    )
    np.testing.assert_array_equal(samples, ints / scale)
    assert samples.dtype == np.float64 and info.duration_s == 8 / 16000


def test_8_bit_pcm_is_unsigned(tmp_path: Path) -> None:
    _wave_module(tmp_path / "a.wav", 1, 1, bytes([128, 255, 0, 64]))
    samples, _ = read_wav(tmp_path / "a.wav")
    np.testing.assert_array_equal(samples, [0.0, 127 / 128, -1.0, -0.5])


def test_channels_are_mixed_down_by_their_mean(tmp_path: Path) -> None:
    frames = np.array([[1000, 3000, -2000], [-300, 300, 0]], dtype="<i2")  # 2 frames x 3 channels
    _wave_module(tmp_path / "a.wav", 2, 3, frames.tobytes())
    samples, info = read_wav(tmp_path / "a.wav")
    assert info.channels == 3 and info.frames == 2
    np.testing.assert_allclose(samples, frames.mean(axis=1) / 2**15, rtol=0, atol=1e-15)


@pytest.mark.parametrize("bits", [32, 64])
def test_ieee_float_passes_through_unscaled(bits: int) -> None:
    values = np.array([0.0, 0.5, -0.25, 1.5, -1.0])
    dtype = "<f4" if bits == 32 else "<f8"
    data = _riff((b"fmt ", _fmt(3, 1, 22050, bits)), (b"data", values.astype(dtype).tobytes()))
    samples, info = parse_wav(data, "f.wav")
    assert info.is_float and info.bits == bits and info.sample_rate_hz == 22050
    np.testing.assert_array_equal(samples, values)


@pytest.mark.parametrize(
    ("sub_tag", "bits", "payload", "expected"),
    [
        (1, 24, b"\x00\x00\x40" + b"\x00\x00\xc0", [0.5, -0.5]),
        (3, 32, np.array([0.25, -0.75], "<f4").tobytes(), [0.25, -0.75]),
    ],
)
def test_wave_format_extensible(sub_tag: int, bits: int, payload: bytes, expected: list[float]) -> None:
    data = _riff((b"fmt ", _fmt(0xFFFE, 1, 48000, bits, extensible_tag=sub_tag)), (b"data", payload))
    samples, info = parse_wav(data, "x.wav")
    np.testing.assert_array_equal(samples, expected)
    assert info.is_float == (sub_tag == 3)


def test_unknown_chunks_odd_padding_and_chunk_order_are_handled() -> None:
    pcm = np.array([100, -100, 7], "<i2").tobytes()
    data = _riff((b"LIST", b"abc"), (b"data", pcm), (b"fmt ", _fmt(1, 1, 8000, 16)), (b"cue ", b"12345"))
    samples, _ = parse_wav(data, "odd.wav")
    np.testing.assert_array_equal(samples, np.array([100, -100, 7]) / 2**15)


_PCM16 = _fmt(1, 1, 16000, 16)
_GOOD_DATA = (b"data", b"\x01\x00\x02\x00")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"RIFF", "not a wav file (only 4 bytes)"),
        (b"RIFX" + b"\0" * 8 + b"WAVE", "not a wav file (no RIFF/WAVE header)"),
        (b"RF64" + b"\0" * 12, "RF64 wav files are not supported"),
        (_riff((b"fmt ", _PCM16), _GOOD_DATA)[:-2], "truncated 'data' chunk: declares 4 bytes, file has 2"),
        (_riff(_GOOD_DATA), "no fmt chunk"),
        (_riff((b"fmt ", _PCM16)), "no data chunk"),
        (_riff((b"fmt ", _PCM16[:12]), _GOOD_DATA), "fmt chunk too short (12 bytes)"),
        (_riff((b"fmt ", _fmt(6, 1, 8000, 8)), _GOOD_DATA), "unsupported wav format tag 0x0006"),
        (_riff((b"fmt ", _fmt(1, 1, 8000, 12)), _GOOD_DATA), "unsupported PCM bit depth 12"),
        (_riff((b"fmt ", _fmt(3, 1, 8000, 16)), _GOOD_DATA), "unsupported float bit depth 16"),
        (_riff((b"fmt ", _fmt(1, 0, 8000, 16)), _GOOD_DATA), "bad fmt chunk: channels=0"),
        (_riff((b"fmt ", _PCM16[:12] + b"\x03\x00" + _PCM16[14:]), _GOOD_DATA), "block align 3 != 1 channels x 2"),
        (_riff((b"fmt ", _PCM16), (b"data", b"\x01\x00\x02")), "data chunk of 3 bytes is not a whole number"),
        (_riff((b"fmt ", _PCM16), (b"data", b"")), "no audio samples"),
        (_riff((b"fmt ", _fmt(3, 1, 8000, 32)), (b"data", np.array([np.nan], "<f4").tobytes())), "non-finite"),
        (_riff((b"fmt ", _fmt(0xFFFE, 1, 8000, 16)[:16] + b"\0" * 8), _GOOD_DATA), "extensible fmt chunk too short"),
        (
            _riff((b"fmt ", _fmt(0xFFFE, 1, 8000, 16, extensible_tag=1)[:-1] + b"\0"), _GOOD_DATA),
            "unsupported extensible sub-format GUID",
        ),
    ],
)
def test_malformed_files_raise_one_line_naming_the_file(tmp_path: Path, data: bytes, reason: str) -> None:
    path = tmp_path / "bad.wav"
    path.write_bytes(data)
    with pytest.raises(CacheError) as info:
        read_wav(path)
    assert info.value.path == str(path)
    assert str(info.value).startswith(f"{path}: ") and reason in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_is_a_cache_error(tmp_path: Path) -> None:
    with pytest.raises(CacheError) as info:
        read_wav(tmp_path / "nope.wav")
    assert str(info.value) == f"{tmp_path / 'nope.wav'}: missing"


@pytest.mark.timeout(20)  # a blocking open of the FIFO would hang here instead of failing
def test_a_fifo_among_the_wavs_is_reported_never_blocked_on(tmp_path: Path) -> None:
    fifo = tmp_path / "LJ001-0001.wav"
    os.mkfifo(fifo)
    with pytest.raises(CacheError) as info:
        read_wav(fifo)
    assert str(info.value) == f"{fifo}: not a regular file (fifo)"
