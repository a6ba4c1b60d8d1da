"""`melfeed prepare` on a small LJSpeech-format corpus generated here: skips reported by
reason and file, interrupt (SIGTERM, then SIGKILL of the whole process group) and resume giving
the same bytes as an uninterrupted run, and prepare -> index -> run end to end."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.conftest import REPO

_WORDS = (
    "the",
    "printing",
    "press",
    "of",
    "gutenberg",
    "changed",
    "how",
    "books",
    "were",
    "made",
    "and",
    "read",
    "across",
    "europe",
    "in",
    "fifteenth",
    "century",
)
# (sample rate, bytes per sample, channels): PCM 8/16/24/32-bit, mono and stereo, five rates.
_FORMATS = ((22050, 2, 1), (16000, 2, 1), (44100, 3, 2), (24000, 4, 1), (8000, 1, 1), (48000, 2, 2))
N_GOOD = 24  # written and expected in the cache
SKIPS = {"bad_wav": 1, "missing_wav": 1, "empty_text": 1, "duration": 1, "metadata": 1}
CONFIG: dict[str, Any] = {
    "features": {"min_duration_s": 0.3, "max_duration_s": 2.0},
    "model": {"vocab_size": 49},
    "buckets": {"num_buckets": 1, "batch_size": 4},
    "producer": {"nice": 3},
}


def _signal(kind: int, n: int, rate: int, rng: random.Random) -> np.ndarray:
    """A tone (with a third harmonic), a linear chirp or noise, 20 ms fades; float64 [n], peak < 0.6."""
    f0, f1 = rng.uniform(100, 400), rng.uniform(500, min(3500, rate / 2.5))
    t = np.arange(n) / rate
    if kind == 0:
        v = np.sin(2 * np.pi * f0 * t) + 0.3 * np.sin(2 * np.pi * 3 * f0 * t)
    elif kind == 1:
        v = np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t * t * rate / (2 * n)))
    else:
        v = np.random.default_rng(rng.getrandbits(32)).normal(0.0, 0.5, n)
    fade = np.minimum(1.0, np.minimum(np.arange(n), n - 1 - np.arange(n)) / (0.02 * rate))
    return np.clip(0.45 * v, -1.0, 1.0) * fade


def write_pcm_wav(path: Path, samples: np.ndarray, rate: int, width: int, channels: int) -> None:
    """Integer PCM with the standard library's ``wave`` (8-bit is unsigned; channel c at 1 - 0.2c)."""
    full = 1 << (8 * width - 1)
    gains = 1.0 - 0.2 * np.arange(channels)
    ints = np.clip(np.round(samples[:, None] * gains * (full - 1)), -full, full - 1).astype("<i4")
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    else:  # the low ``width`` bytes of each little-endian int32
        raw = ints.reshape(-1, 1).view(np.uint8)[:, :width].tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


def write_float_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    """IEEE float 32 mono (format tag 3), which ``wave`` cannot write."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHHH", 3, 1, rate, rate * 4, 4, 32, 0)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def write_corpus(root: Path, n_good: int = N_GOOD, seed: int = 7) -> Path:
    """An LJSpeech-format corpus: ``n_good`` usable clips plus one of each skip reason."""
    rng = random.Random(seed)
    (root / "wavs").mkdir(parents=True)
    lines = []
    for i in range(n_good + 3):
        uid = f"LJ001-{i + 1:04d}"
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
        text = words.capitalize() + rng.choice([".", ",", "?", "!"])
        lines.append(f"{uid}|{text} 1{i}|{text} one {i}")
        rate, width, channels = _FORMATS[i % len(_FORMATS)]
        seconds = 2.5 if i == n_good + 1 else rng.uniform(0.5, 1.4)  # n_good+1: too long
        samples = _signal(i % 3, int(seconds * rate), rate, rng)
        if i % 7 == 3:
            write_float_wav(root / "wavs" / f"{uid}.wav", samples, rate)
        else:
            write_pcm_wav(root / "wavs" / f"{uid}.wav", samples, rate, width, channels)
    bad = root / "wavs" / f"LJ001-{n_good + 1:04d}.wav"  # corrupt: the data chunk is cut short
    bad.write_bytes(bad.read_bytes()[:2000])
    (root / "wavs" / f"LJ001-{n_good + 3:04d}.wav").unlink()  # missing
    lines.append("LJ002-0001|[ ]|[ ]")  # empty once normalised; its wav is never read
    lines.append("a line without any separator")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _argv(corpus: Path, cache: Path, cfg: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "melfeed",
        "prepare",
        "--ljspeech",
        str(corpus),
        "--cache-dir",
        str(cache),
        "--config",
        str(cfg),
        *extra,
    ]


_ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def _prepare(corpus: Path, cache: Path, cfg: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _argv(corpus, cache, cfg, *extra), cwd=REPO, env=_ENV, capture_output=True, text=True, timeout=120
    )


def _start_prepare(corpus: Path, cache: Path, cfg: Path, *extra: str) -> subprocess.Popen[str]:
    """In its own process group, so the test can SIGKILL it with all its workers."""
    return subprocess.Popen(
        _argv(corpus, cache, cfg, *extra),
        cwd=REPO,
        env=_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "LJSpeech-mini")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "melfeed.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.fixture(scope="module")
def prepared(
    corpus: Path, config_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    cache = tmp_path_factory.mktemp("ref") / "cache"
    proc = _prepare(corpus, cache, config_file, "--workers", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cache, proc


def test_prepare_writes_the_cache_and_reports_each_skip_with_its_file(
    corpus: Path, prepared: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    cache, proc = prepared
    assert len(list((cache / "mels").glob("*.npy"))) == N_GOOD
    doc = json.loads((cache / "manifest.json").read_text())
    assert len(doc["utterances"]) == N_GOOD and len(doc["vocabulary"]) == 49
    assert 1 <= doc["token_range"][0] <= doc["token_range"][1] < 49  # ids of the vocabulary; 0 is padding
    assert doc["features"]["hop_samples"] == 256 and doc["features"]["definition"] == "melfeed-logmel/1"
    err = proc.stderr
    assert f"skipped LJ001-{N_GOOD + 1:04d}: {corpus / 'wavs' / f'LJ001-{N_GOOD + 1:04d}.wav'}: truncated" in err
    assert f"skipped LJ001-{N_GOOD + 3:04d}: {corpus / 'wavs' / f'LJ001-{N_GOOD + 3:04d}.wav'}: missing" in err
    assert f"skipped LJ001-{N_GOOD + 2:04d}: " in err and "outside the duration limits 0.3..2 s" in err
    assert f"skipped LJ002-0001: {corpus / 'metadata.csv'}:{N_GOOD + 4}: empty transcript" in err
    assert f"skipped {corpus / 'metadata.csv'}:{N_GOOD + 5}: expected id|text|normalized_text" in err
    assert "Traceback" not in err
    assert "worker prepare-1 ready device=/CPU:0 nice=3" in err  # producer.nice, set before TensorFlow
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(SKIPS.items()))
    assert f"skipped {sum(SKIPS.values())}: {reasons}" in proc.stdout
    assert f"{N_GOOD} utterances done ({N_GOOD} new, 0 from earlier runs)" in proc.stdout


def test_mel_frames_follow_the_audio_length(corpus: Path, prepared: tuple[Path, object]) -> None:
    cache = prepared[0]
    from melfeed.producer.prepare.wav import read_wav

    for mel_path in sorted((cache / "mels").glob("*.npy")):
        _, info = read_wav(corpus / "wavs" / f"{mel_path.stem}.wav")
        n = math.ceil(info.frames * 22050 / info.sample_rate_hz)  # samples after resampling
        mel = np.load(mel_path)
        assert mel.shape == (1 + n // 256, 80) and mel.dtype == np.float32
        assert np.isfinite(mel).all() and mel.min() >= np.log(1e-5) - 1e-6
        tokens = np.load(cache / "tokens" / f"{mel_path.stem}.npy")
        assert tokens.dtype == np.int32 and 1 <= tokens.min() and tokens.max() < 49


def test_interrupted_runs_resume_to_the_same_bytes(
    corpus: Path, config_file: Path, tmp_path: Path, prepared: tuple[Path, object]
) -> None:
    cache = tmp_path / "cache"

    def run_until(n_files: int, sig: int) -> int:
        proc = _start_prepare(corpus, cache, config_file, "--workers", "1", "--debug-delay-ms", "80")
        deadline = time.monotonic() + 60
        while len(list((cache / "mels").glob("*.npy"))) < n_files and proc.poll() is None:
            assert time.monotonic() < deadline, "prepare made no progress"
            time.sleep(0.02)
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)  # the whole group, workers too: like a power cut
        else:
            proc.send_signal(sig)  # the parent only: it stops its workers itself
        _, err = proc.communicate(timeout=60)
        if sig == signal.SIGTERM:
            assert proc.returncode == 143 and "interrupted: run the same command again to resume" in err, err
        return len(list((cache / "mels").glob("*.npy")))

    first = run_until(3, signal.SIGTERM)
    assert 3 <= first < N_GOOD
    assert not (cache / "manifest.json").exists()
    second = run_until(first + 3, signal.SIGKILL)
    assert first < second < N_GOOD
    done = _prepare(corpus, cache, config_file, "--workers", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"({N_GOOD - second} new, {second} from earlier runs)" in done.stdout
    assert _tree(cache) == _tree(prepared[0])  # every mel, token file, features.json, manifest.json


def test_prepare_refuses_to_mix_features_into_a_cache(
    corpus: Path, prepared: tuple[Path, object], tmp_path: Path
) -> None:
    other = tmp_path / "other.yaml"
    other.write_text(
        yaml.safe_dump({**CONFIG, "features": {"min_duration_s": 0.3, "max_duration_s": 2.0, "hop_samples": 275}})
    )
    proc = _prepare(corpus, prepared[0], other)
    assert proc.returncode == 78
    assert proc.stderr.strip().splitlines()[-1] == (
        f"melfeed prepare: features.hop_samples: cache {prepared[0]} was prepared with 256, "
        "this config has 275; use another --cache-dir or the same settings"
    )


def test_prepare_index_run_end_to_end(prepared: tuple[Path, object], tmp_path: Path) -> None:
    cache = prepared[0]
    before = (cache / "manifest.json").read_bytes()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    index = subprocess.run(
        [sys.executable, "-m", "melfeed", "index", "--cache-dir", str(cache)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert index.returncode == 0 and f"indexed {N_GOOD} utterances" in index.stdout, index.stderr
    assert (cache / "manifest.json").read_bytes() == before  # index keeps features and vocabulary
    cfg = tmp_path / "run.yaml"
    run_config = {**CONFIG, "model": {**CONFIG["model"], "jit_compile": False}}  # graph mode: the data is the subject
    cfg.write_text(yaml.safe_dump({**run_config, "consumer": {"warmup_steps": 1, "status_interval_s": 1.0}}))
    summary = tmp_path / "summary.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "run",
            "--config",
            str(cfg),
            "--cache-dir",
            str(cache),
            "--steps",
            "3",
            "--producers",
            "1",
            "--model-step",
            "tests.steps:tiny_step",
            "--summary-json",
            str(summary),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == s["batches_applied"] == 3 and s["rejects"] == {}


def test_index_adopts_two_existing_folders_and_reports_unmatched_and_invalid(tmp_path: Path) -> None:
    user = tmp_path / "my_trainer_cache"
    (user / "mel_spec").mkdir(parents=True)
    (user / "text_ids").mkdir()
    for i in range(4):
        np.save(user / "mel_spec" / f"utt{i}.npy", np.zeros((50 + i, 80), np.float32))
        np.save(user / "text_ids" / f"utt{i}.npy", np.arange(1, 6, dtype=np.int32))
    np.save(user / "mel_spec" / "utt1.npy", np.zeros((80, 51), np.float32))  # [n_mels, frames]
    np.save(user / "text_ids" / "utt2.npy", np.arange(1, 6, dtype=np.int64))  # int64 ids
    np.save(user / "mel_spec" / "lonely.npy", np.zeros((9, 80), np.float32))  # no tokens
    cache = tmp_path / "cache"
    argv = [
        sys.executable,
        "-m",
        "melfeed",
        "index",
        "--cache-dir",
        str(cache),
        "--mels",
        str(user / "mel_spec"),
        "--tokens",
        str(user / "text_ids"),
    ]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    refused = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    assert f"bad: {cache / 'mels' / 'lonely.npy'}: no matching tokens/lonely.npy" in refused.stderr
    assert f"bad: {cache / 'mels' / 'utt1.npy'}: expected n_mels=80" in refused.stderr
    assert "(stored as [n_mels, frames]? transpose it)" in refused.stderr
    assert f"bad: {cache / 'tokens' / 'utt2.npy'}: token dtype <i8 not allowed" in refused.stderr
    assert "1 unmatched, 2 invalid files" in refused.stderr
    adopted = subprocess.run([*argv, "--skip-bad"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert adopted.returncode == 0 and "indexed 2 utterances" in adopted.stdout, adopted.stderr
    assert (cache / "mels").resolve() == user / "mel_spec"
    from melfeed.shared.cache.manifest import load_manifest

    manifest = load_manifest(cache, 80)
    assert [u.id for u in manifest.utterances] == ["utt0", "utt3"] and manifest.features is None


@pytest.mark.parametrize("command", ["consumer", "producer"])
def test_a_side_configured_with_other_features_refuses_the_prepared_cache(
    prepared: tuple[Path, object], tmp_path: Path, command: str
) -> None:
    cfg = tmp_path / "other.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {**CONFIG, "cache_dir": str(prepared[0]), "features": {**CONFIG.get("features", {}), "hop_samples": 275}}
        )
    )
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run(
        [sys.executable, "-m", "melfeed", command, "--config", str(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 78, run.stderr[-2000:]
    assert "features.hop_samples" in run.stderr and "prepared with 256, this config has 275" in run.stderr
