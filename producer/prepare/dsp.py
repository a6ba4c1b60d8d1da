"""The log-mel definition ``prepare`` computes and the resampler before it (version: ``melfeed.shared.cache.features``).

Definition ``melfeed-logmel/1`` for mono audio ``x`` at ``sample_rate_hz`` (``FeatureConfig``):

1. Pad ``x`` by ``p = win_samples // 2`` samples on each side by reflection (the edge sample is
   not repeated: ``[x2, x1, x0, x1, x2, ...]``), so frame ``t`` is centred on sample ``t * hop``.
2. Frame ``t`` is ``padded[t*hop : t*hop + win]`` for ``t = 0 .. 1 + (n + 2p - win) // hop - 1``
   (``1 + n // hop`` frames for an even window), times a periodic Hann window
   ``w[k] = 0.5 - 0.5 cos(2 pi k / win)``, zero-padded at the end to ``n_fft`` samples.
3. ``S = |rfft(frame)| ** power`` over ``n_fft // 2 + 1`` bins at ``f_k = k * sr / n_fft``.
4. Mel bands on the HTK scale ``mel(f) = 1127 ln(1 + f / 700)``: ``n_mels + 2`` edges evenly
   spaced in mel from ``fmin_hz`` to ``fmax_hz``; band ``m`` is a triangle in mel with weight
   ``max(0, min((mel(f) - e_m) / (e_{m+1} - e_m), (e_{m+2} - mel(f)) / (e_{m+2} - e_{m+1})))``,
   peak 1 (no area normalisation); the DC bin has weight 0. This is exactly
   ``tf.signal.linear_to_mel_weight_matrix``.
5. ``logmel = ln(max(S @ W, log_floor))``, float32 [frames, n_mels].

Steps 1-5 run as TensorFlow ops (``tf.signal.stft``) on the device the caller picks; one
``tf.function`` with a ``[None]`` signature serves every clip length (no retracing).

Resampling (``resample``): Kaiser-windowed sinc, polyphase over the reduced ratio
``up / down = to_hz / from_hz``, 32 zero crossings per side, beta 9.0, cutoff 0.95 x the lower
Nyquist frequency, computed in float64 with NumPy. Accuracy (tests/unit/shared/cache/test_features.py):
sines up to 0.8 x the lower Nyquist come out within 5e-5 of full scale of the exact signal
(measured 2.4e-5; away from the first and last 40 ms) for 8, 16, 44.1 and 48 kHz -> 22.05 kHz.
Cost: ~70 taps per output sample (16 kHz -> 22.05 kHz: ~10 ms per second of audio).

Invariants: everything here is deterministic (same input, same bytes on the same device and
thread count). TensorFlow is imported only when a ``LogMel`` is built, never at module import.
Shutdown: nothing to shut down.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.shared.config import FeatureConfig

__all__ = ["frame_count", "resample", "LogMel"]

_ZERO_CROSSINGS = 32  # per side; more = sharper transition band, proportionally slower
_KAISER_BETA = 9.0  # ~90 dB sidelobe attenuation of the window
_ROLLOFF = 0.95  # cutoff as a fraction of the lower Nyquist frequency: keeps aliasing out
_BLOCK_OUTPUTS = 16384  # outputs per gather block: bounds temporary memory to a few MB


def frame_count(n_samples: int, features: FeatureConfig) -> int:
    """Mel frames for a clip of ``n_samples`` (at ``sample_rate_hz``); 0 if too short to pad.

    Reflection padding needs more than ``win_samples // 2`` samples.
    """
    pad = features.win_samples // 2
    if n_samples <= pad:
        return 0
    return 1 + (n_samples + 2 * pad - features.win_samples) // features.hop_samples


def _kaiser_sinc(t: npt.NDArray[np.float64], cutoff: float, half_width: float) -> npt.NDArray[np.float64]:
    """Low-pass kernel at offsets ``t`` (input samples): unit DC gain, zero beyond ``half_width``."""
    inside = np.abs(t) < half_width
    ratio = np.where(inside, t / half_width, 0.0)
    window = np.i0(_KAISER_BETA * np.sqrt(1.0 - ratio * ratio)) / np.i0(_KAISER_BETA)
    return np.where(inside, 2.0 * cutoff * np.sinc(2.0 * cutoff * t) * window, 0.0)


@functools.lru_cache(maxsize=8)
def _filter_bank(up: int, down: int) -> tuple[npt.NDArray[np.float64], int]:
    """Polyphase table [up, taps] and the index of tap 0 relative to the output's base sample."""
    cutoff = 0.5 * min(1.0, up / down) * _ROLLOFF  # cycles per input sample
    half_width = _ZERO_CROSSINGS / (2.0 * cutoff)  # input samples
    reach = math.ceil(half_width)
    taps = np.arange(-reach, reach + 2)  # input samples base + j around each output
    phases = np.arange(up)[:, None] / up  # fractional position of each output
    table = _kaiser_sinc(phases - taps[None, :], cutoff, half_width)
    table.setflags(write=False)
    return table, -reach


def resample(x: npt.NDArray[np.float64], from_hz: int, to_hz: int) -> npt.NDArray[np.float64]:
    """Band-limited resampling of a mono signal (see the module docstring for the filter).

    Args:
        x: Samples [n] at ``from_hz``.
        from_hz, to_hz: Integer sample rates.

    Returns:
        float64 [ceil(n * to_hz / from_hz)]; output sample ``i`` is the signal at time
        ``i / to_hz``. ``x`` itself (as float64) when the rates are equal.
    """
    x = np.asarray(x, dtype=np.float64)
    if from_hz == to_hz:
        return x
    g = math.gcd(from_hz, to_hz)
    up, down = to_hz // g, from_hz // g
    table, first_tap = _filter_bank(up, down)
    n_taps = table.shape[1]
    n_out = -(-x.shape[0] * up // down)
    margin = n_taps + 1  # zeros beyond both ends: the signal is taken as silent there
    padded = np.concatenate([np.zeros(margin), x, np.zeros(margin)])
    out = np.empty(n_out, dtype=np.float64)
    offsets = np.arange(n_taps)
    for start in range(0, n_out, _BLOCK_OUTPUTS):
        pos = np.arange(start, min(start + _BLOCK_OUTPUTS, n_out), dtype=np.int64) * down
        base, phase = pos // up, pos % up
        window = padded[(base + first_tap + margin)[:, None] + offsets[None, :]]
        out[start : start + pos.shape[0]] = np.einsum("nk,nk->n", window, table[phase])
    return out


class LogMel:
    """Steps 1-5 of the definition as one compiled TensorFlow function on one device."""

    def __init__(self, features: FeatureConfig, n_mels: int, device: str = "/CPU:0") -> None:
        import tensorflow as tf  # only here: the parent process of prepare never imports it

        self._features = features
        self._device = device
        self._tf = tf
        with tf.device(device):
            self._weights = tf.signal.linear_to_mel_weight_matrix(
                n_mels,
                features.n_fft // 2 + 1,
                features.sample_rate_hz,
                features.fmin_hz,
                features.top_hz,
                dtype=tf.float32,
            )
        self._compiled = tf.function(self._logmel, input_signature=[tf.TensorSpec([None], tf.float32)])

    def _logmel(self, audio: Any) -> Any:
        tf, f = self._tf, self._features
        pad = f.win_samples // 2
        padded = tf.pad(audio, [[pad, pad]], mode="REFLECT")
        spectrum = tf.abs(
            tf.signal.stft(
                padded,
                frame_length=f.win_samples,
                frame_step=f.hop_samples,
                fft_length=f.n_fft,
                window_fn=tf.signal.hann_window,
            )
        )
        if f.power == 2.0:
            spectrum = tf.square(spectrum)
        return tf.math.log(tf.maximum(tf.matmul(spectrum, self._weights), f.log_floor))

    def __call__(self, audio: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float32]:
        """Log-mel of mono ``audio`` [n] at ``sample_rate_hz``: float32 [frame_count(n), n_mels].

        Raises:
            ValueError: The clip is too short for one padded window (``frame_count`` is 0).
        """
        if frame_count(audio.shape[0], self._features) == 0:
            raise ValueError(f"{audio.shape[0]} samples is too short for a {self._features.win_samples}-sample window")
        with self._tf.device(self._device):
            mel = self._compiled(self._tf.constant(audio, dtype=self._tf.float32))
        return np.ascontiguousarray(mel.numpy(), dtype=np.float32)
