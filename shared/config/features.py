"""The ``features`` section: how ``melfeed prepare`` turns audio into log-mels.

Role: the analysis settings a prepared cache records in its manifest (``shared/cache/features.py``
compares them at start). Invariant: every ``FeatureConfig`` that exists is valid; a bad value raises
``ConfigError`` naming ``features.<key>`` and the value. Shutdown: nothing to release.
"""

from __future__ import annotations

from dataclasses import dataclass

from melfeed.shared.config.checks import require as _check

__all__ = ["FeatureConfig"]


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    """How ``melfeed prepare`` turns audio into log-mels (the bin count is root ``n_mels``).

    A prepared cache records every field but the duration limits in its manifest; a producer or
    consumer whose config differs refuses to start, naming the key (see ``shared/cache/features.py``).
    """

    sample_rate_hz: int = 22050  # audio is resampled to this rate before analysis
    n_fft: int = 1024  # FFT size in samples: n_fft // 2 + 1 linear bins
    hop_samples: int = 256  # frame step; frames = 1 + samples // hop_samples (even window)
    win_samples: int = 1024  # periodic Hann window length, <= n_fft (zero-padded to n_fft)
    fmin_hz: float = 0.0  # lower edge of the lowest mel band
    fmax_hz: float | None = 8000.0  # upper edge of the highest mel band; None = sample_rate_hz / 2
    power: float = 1.0  # 1 = magnitude (Tacotron 2 style), 2 = power spectrogram
    log_floor: float = 1e-5  # log(max(mel, log_floor)): silence reads -11.51
    min_duration_s: float = 0.5  # shorter clips are skipped and counted; 0 = no lower limit
    max_duration_s: float | None = 15.0  # longer clips are skipped and counted; None = no limit

    def __post_init__(self) -> None:
        p = ("features",)
        _check(
            1000 <= self.sample_rate_hz <= 384000,
            "must be in 1000..384000",
            p + ("sample_rate_hz",),
            self.sample_rate_hz,
        )
        _check(16 <= self.n_fft <= 65536, "must be in 16..65536", p + ("n_fft",), self.n_fft)
        _check(self.hop_samples >= 1, "must be >= 1", p + ("hop_samples",), self.hop_samples)
        _check(2 <= self.win_samples <= self.n_fft, "must be in 2..n_fft", p + ("win_samples",), self.win_samples)
        nyquist_hz = self.sample_rate_hz / 2
        _check(0.0 <= self.fmin_hz < self.top_hz, "must be >= 0 and below fmax_hz", p + ("fmin_hz",), self.fmin_hz)
        _check(
            self.top_hz <= nyquist_hz, f"must be <= sample_rate_hz / 2 ({nyquist_hz})", p + ("fmax_hz",), self.fmax_hz
        )
        _check(self.power in (1.0, 2.0), "must be 1.0 (magnitude) or 2.0 (power)", p + ("power",), self.power)
        _check(self.log_floor > 0, "must be > 0", p + ("log_floor",), self.log_floor)
        _check(self.min_duration_s >= 0, "must be >= 0", p + ("min_duration_s",), self.min_duration_s)
        if self.max_duration_s is not None:
            _check(
                self.max_duration_s > self.min_duration_s,
                "must be > min_duration_s",
                p + ("max_duration_s",),
                self.max_duration_s,
            )

    @property
    def top_hz(self) -> float:
        """The resolved upper mel edge: ``fmax_hz``, or the Nyquist frequency when it is None."""
        return self.sample_rate_hz / 2 if self.fmax_hz is None else self.fmax_hz
