"""Build a mel cache from an LJSpeech-format corpus: ``melfeed prepare``.

Corpus: ``DIR/metadata.csv`` (UTF-8, one ``id|text|normalized_text`` line per utterance, no
quoting; the normalised column is used when present and non-empty, else the text column) and
``DIR/wavs/<id>.wav``. Output: ``CACHE/mels/<id>.npy``, ``CACHE/tokens/<id>.npy``,
``CACHE/features.json`` and, when the run completes, ``CACHE/manifest.json``.

Invariants:
- Resumable: outputs are atomic (``melfeed.producer.prepare.worker``); an utterance whose two files are
  present and valid, with the tokens of its current transcript, is not computed again; temp
  files of an interrupted run are removed at start. Interrupted + resumed = uninterrupted, byte
  for byte (tests/integration/tools/test_prepare.py).
- ``features.json`` is written before the first output and checked on every later run: other
  features, vocabulary or duration limits never mix into one cache (refused, naming the key).
- Every skipped utterance gets one line naming its id and file; the summary counts them by
  reason (metadata, empty_text, missing_wav, bad_wav, duration, error).
Shutdown: SIGTERM/SIGINT set ``stop``; workers finish the item in hand, then the stop ladder
(``melfeed.producer.prepare.pool``) runs; the run exits 128 + the signal (130 SIGINT, 143 SIGTERM) and says how
to resume. No manifest is written.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TextIO

import numpy as np

from melfeed.producer.prepare.pool import WorkerPool
from melfeed.producer.prepare.worker import WorkerSpec, WorkItem, WorkResult
from melfeed.shared.cache.features import RESAMPLER_VERSION, feature_params, read_feature_record, write_feature_record
from melfeed.shared.cache.filekind import check_cache_dir, make_dirs
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import MEL_DTYPES, TOKEN_DTYPE, write_manifest
from melfeed.shared.cache.npyfile import inspect_npy
from melfeed.shared.cache.text import VOCAB_SIZE, VOCABULARY, encode_text
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import CacheError, ConfigError
from melfeed.shared.service.progress import Progress, progress_interval_s

__all__ = [
    "MetadataRow",
    "PrepareSummary",
    "read_metadata",
    "run_prepare",
    "main_prepare",
    "worker_count",
    "debug_delay_s",
]

log = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 10.0  # a plain progress line this often off a terminal (logs stay short)
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # ids become file names
_DEBUG_DELAY_MAX_MS = 60_000.0  # --debug-delay-ms (testing): a minute per utterance at most, never a hang


class MetadataRow(NamedTuple):
    """One usable line of metadata.csv."""

    uid: str
    text: str  # the normalised column if present and non-empty, else the text column
    line: int  # 1-based line number, for messages


@dataclass(slots=True)
class PrepareSummary:
    """What a prepare run did; ``done`` counts every utterance now in the cache."""

    done: int = 0
    new: int = 0
    frames: int = 0
    new_frames: int = 0
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    elapsed_s: float = 0.0
    work_s: float = 0.0  # from the first worker ready to the end: excludes TensorFlow start-up
    interrupted: bool = False

    def audio_h(self, cfg: PipelineConfig, frames: int | None = None) -> float:
        """Hours of audio in ``frames`` (default: the whole cache), as frames x hop (+-1 hop per clip)."""
        n = self.frames if frames is None else frames
        return n * cfg.features.hop_samples / cfg.features.sample_rate_hz / 3600


def read_metadata(corpus: Path, report: TextIO) -> tuple[list[MetadataRow], int]:
    """Parse ``metadata.csv``; print one line per unusable line (naming file and line).

    Returns:
        The usable rows in file order, and the number of unusable lines.

    Raises:
        CacheError: ``metadata.csv`` is missing or unreadable.
    """
    path = corpus / "metadata.csv"
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError as err:
        raise CacheError(path, "missing: an LJSpeech-format corpus has metadata.csv and wavs/") from err
    except OSError as err:
        raise CacheError(path, f"cannot read ({err.strerror})") from err
    rows: list[MetadataRow] = []
    seen: set[str] = set()
    bad = 0
    for number, raw in enumerate(lines, 1):
        problem, row = _parse_line(raw, number, seen)
        if problem:
            print(f"skipped {path}:{number}: {problem}", file=report)
            bad += 1
        elif row is not None:
            seen.add(row.uid)
            rows.append(row)
    return rows, bad


def _parse_line(raw: bytes, number: int, seen: set[str]) -> tuple[str | None, MetadataRow | None]:
    try:
        line = raw.decode("utf-8").lstrip("\ufeff") if number == 1 else raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8", None
    if not line.strip():
        return None, None
    fields = line.split("|", 2)
    if len(fields) < 2:
        return "expected id|text|normalized_text", None
    uid = fields[0].strip()
    if not _SAFE_ID.fullmatch(uid):
        return f"bad id {uid[:40]!r} (letters, digits, '.', '_', '-')", None
    if uid in seen:
        return f"duplicate id {uid}", None
    normalised = fields[2].strip() if len(fields) == 3 else ""
    return None, MetadataRow(uid, normalised or fields[1], number)


def _check_record(cache: Path, cfg: PipelineConfig) -> bool:
    """Refuse a cache prepared with other settings, or not by prepare; True if it has a record."""
    f = cfg.features
    features = feature_params(f, cfg.n_mels)
    selection = _selection(cfg)
    record = read_feature_record(cache)
    if record is None:
        if any((cache / sub).is_dir() and any((cache / sub).glob("*.npy")) for sub in ("mels", "tokens")):
            raise CacheError(
                cache,
                "holds .npy files but no features.json: not made by prepare; "
                "use an empty directory (or `index` to adopt it as it is)",
            )
        return False
    for section, values in (("features", features), ("selection", selection)):
        old = record.get(section)
        old = old if isinstance(old, dict) else {}
        for key, value in values.items():
            if old.get(key) != value:
                path = ("n_mels",) if key == "n_mels" else ("features", key)
                raise ConfigError(
                    f"cache {cache} was prepared with {old.get(key)!r}, this config has "
                    f"{value!r}; use another --cache-dir or the same settings",
                    path=path,
                )
    if record.get("vocabulary") != list(VOCABULARY):
        raise ConfigError(f"cache {cache} was prepared with another vocabulary", path=("vocabulary",))
    return True


def _selection(cfg: PipelineConfig) -> dict[str, float | str | None]:
    """Recorded for the resume check only: which clips are kept, and how they are resampled."""
    f = cfg.features
    return {"min_duration_s": f.min_duration_s, "max_duration_s": f.max_duration_s, "resampler": RESAMPLER_VERSION}


def _done_frames(cache: Path, uid: str, tokens: np.ndarray, n_mels: int) -> int:
    """Frames of ``uid`` if both its outputs are complete and its tokens current, else 0."""
    try:
        mel, _ = inspect_npy(cache / "mels" / f"{uid}.npy")
        tok, _ = inspect_npy(cache / "tokens" / f"{uid}.npy")
        same = np.array_equal(np.load(cache / "tokens" / f"{uid}.npy"), tokens)
    except (CacheError, OSError, ValueError):
        return 0
    ok = (
        same
        and mel.dtype == MEL_DTYPES["float32"]
        and len(mel.shape) == 2
        and mel.shape[1] == n_mels
        and mel.shape[0] > 0
        and tok.dtype == TOKEN_DTYPE
    )
    return mel.shape[0] if ok else 0


def _remove_temp_files(cache: Path) -> None:
    for sub in ("mels", "tokens"):
        make_dirs(cache / sub)
        for p in (cache / sub).glob(".*.tmp"):
            p.unlink(missing_ok=True)


def _plan(
    rows: list[MetadataRow], corpus: Path, cache: Path, cfg: PipelineConfig, summary: PrepareSummary, report: TextIO
) -> list[WorkItem]:
    """Work items for the rows not done yet; done rows and empty transcripts are counted here."""
    items = []
    for row in rows:
        wav = corpus / "wavs" / f"{row.uid}.wav"
        encoded = encode_text(row.text)
        if encoded.ids.size == 0:
            print(f"skipped {row.uid}: {corpus / 'metadata.csv'}:{row.line}: empty transcript", file=report)
            summary.skipped["empty_text"] += 1
            continue
        frames = _done_frames(cache, row.uid, encoded.ids, cfg.n_mels)
        if frames:
            summary.done += 1
            summary.frames += frames
        else:
            items.append(WorkItem(row.uid, str(wav), tuple(encoded.ids.tolist())))
    return items


def _check_config(cfg: PipelineConfig) -> None:
    if cfg.model.vocab_size < VOCAB_SIZE:
        raise ConfigError(
            f"must be >= {VOCAB_SIZE}, the size of the prepare vocabulary",
            path=("model", "vocab_size"),
            got=cfg.model.vocab_size,
        )
    if cfg.n_mels > cfg.features.n_fft // 2:
        raise ConfigError(
            f"must be <= features.n_fft / 2 ({cfg.features.n_fft // 2}) or bands are empty",
            path=("n_mels",),
            got=cfg.n_mels,
        )


def run_prepare(
    corpus: Path,
    cache: Path,
    cfg: PipelineConfig,
    workers: int,
    stop: threading.Event,
    report: TextIO,
    debug_delay_s: float = 0.0,
    progress_s: float = _PROGRESS_EVERY_S,
) -> PrepareSummary:
    """Prepare every utterance of ``corpus`` into ``cache`` that is not there yet.

    Args:
        workers: Worker processes (>= 1).
        stop: Set to interrupt; the summary then has ``interrupted`` and no manifest is written.
        report: Where skip lines and progress go (stderr in the CLI).
        progress_s: Seconds between plain progress lines when ``report`` is not a terminal.

    Raises:
        CacheError: Missing metadata, a cache made by something else, a cache directory that cannot be
            created or written (named, with the OS reason) or that another user could write to or swap
            (``melfeed.shared.output_files.output_dir_reason``), or a worker that failed.
        ConfigError: The config does not fit (vocabulary, n_mels) or differs from the cache's.
    """
    started = time.monotonic()
    _check_config(cfg)
    if cache.exists() and not cache.is_dir():
        raise CacheError(cache, "not a directory")
    check_cache_dir(cache)  # before reading its record (it may be another user's) or making anything there
    has_record = _check_record(cache, cfg)  # before any output: a mismatch is the only message
    rows, bad_lines = read_metadata(corpus, report)
    summary = PrepareSummary()
    summary.skipped["metadata"] += bad_lines
    make_dirs(cache)  # a read-only parent or /proc: one line naming the directory
    check_cache_dir(cache)
    if not has_record:
        write_feature_record(
            cache, feature_params(cfg.features, cfg.n_mels), VOCABULARY, {"selection": _selection(cfg)}
        )
    _remove_temp_files(cache)
    items = _plan(rows, corpus, cache, cfg, summary, report)
    log.info(
        "prepare corpus=%s cache=%s utterances=%d done_before=%d to_do=%d workers=%d",
        corpus,
        cache,
        len(rows),
        summary.done,
        len(items),
        workers,
    )
    spec = WorkerSpec(
        str(cache),
        cfg.features,
        cfg.n_mels,
        cfg.producer.data_gpu,
        cfg.producer.gpu_memory_limit_mb,
        debug_delay_s,
        nice=cfg.producer.nice,
    )
    work_started_s = _run_items(
        items,
        spec,
        workers,
        stop,
        summary,
        Progress(len(items), report, progress_s, label="prepare", unit="utterances", count_skipped=True),
    )
    summary.interrupted = stop.is_set()
    summary.elapsed_s = time.monotonic() - started
    summary.work_s = time.monotonic() - work_started_s
    return summary


def _run_items(
    items: list[WorkItem],
    spec: WorkerSpec,
    workers: int,
    stop: threading.Event,
    summary: PrepareSummary,
    progress: Progress,
) -> float:
    """Run ``items`` on the pool, counting into ``summary``; returns when work began (monotonic s)."""
    skipped_before = sum(summary.skipped.values())
    work_started = [time.monotonic()]

    def on_ready() -> None:
        work_started[0] = time.monotonic()
        progress.start()

    if items:
        with WorkerPool(spec, max(1, min(workers, len(items)))) as pool:
            for result in pool.run(items, stop, on_ready):
                _count(result, summary, progress)
                progress.update(summary.new, sum(summary.skipped.values()) - skipped_before)
    progress.finish()
    return work_started[0]


def _count(result: WorkResult, summary: PrepareSummary, progress: Progress) -> None:
    if result.reason is None:
        summary.done += 1
        summary.new += 1
        summary.frames += result.frames
        summary.new_frames += result.frames
    else:
        summary.skipped[result.reason] += 1
        progress.note(f"skipped {result.uid}: {result.wav_path}: {result.detail}")


def _print_summary(s: PrepareSummary, cache: Path, cfg: PipelineConfig) -> None:
    work_s = max(s.work_s, 1e-9)
    print(
        f"{'interrupted' if s.interrupted else 'prepared'} {cache}: {s.done} utterances done "
        f"({s.new} new, {s.done - s.new} from earlier runs), {s.audio_h(cfg):.3f} h of audio, "
        f"{s.frames} frames"
    )
    print(
        f"took {s.elapsed_s:.1f} s, {s.elapsed_s - s.work_s:.1f} s of it starting workers; "
        f"{s.new / work_s:.1f} utterances/s, {s.audio_h(cfg, s.new_frames) * 3600 / work_s:.0f} s of audio/s"
    )
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.skipped.items()) if v)
    print(f"skipped {sum(s.skipped.values())}" + (f": {reasons}" if reasons else ""))


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[tuple[threading.Event, list[int]]]:
    """An Event set by SIGTERM/SIGINT and the signals that came, in order; the old handlers restored after."""
    stop, signums = threading.Event(), []

    def _on_signal(signum: int, frame: object) -> None:
        signums.append(signum)
        stop.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop, signums
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def worker_count(requested: int | None) -> int:
    """``--workers``: absent = one per CPU this process may run on; below 1 is refused; above that
    count it is lowered to it, with one INFO line (more workers add memory, never speed: every worker is
    CPU-bound, and the cache is the same bytes with any count).

    Raises:
        ConfigError: ``requested`` < 1, naming ``--workers``.
    """
    cpus = len(os.sched_getaffinity(0))
    if requested is None:
        return cpus
    if requested < 1:
        raise ConfigError(
            f"must be >= 1 (leave it out for one per available CPU: {cpus})", path=("--workers",), got=requested
        )
    if requested > cpus:
        log.info("--workers %d is above the %d available CPUs: using %d", requested, cpus, cpus)
    return min(requested, cpus)


def debug_delay_s(delay_ms: float) -> float:
    """``--debug-delay-ms`` in seconds; negative, NaN or above ``_DEBUG_DELAY_MAX_MS`` is refused (ConfigError)."""
    if not 0.0 <= delay_ms <= _DEBUG_DELAY_MAX_MS:  # NaN fails every comparison
        raise ConfigError(f"must be in 0..{_DEBUG_DELAY_MAX_MS:.0f}", path=("--debug-delay-ms",), got=delay_ms)
    return delay_ms / 1000.0


def main_prepare(args: argparse.Namespace) -> int:
    """``melfeed prepare``: 0 = complete (skips reported), 1 = bad outputs, 128 + signal = interrupted."""
    from melfeed.shared.service.cli import loaded_config

    workers, delay_s = worker_count(args.workers), debug_delay_s(args.debug_delay_ms)
    cfg = loaded_config(args)
    cache = Path(args.cache_dir)
    with _stop_on_signals() as (stop, signums):
        summary = run_prepare(
            Path(args.ljspeech), cache, cfg, workers, stop, sys.stderr, delay_s, progress_interval_s(_PROGRESS_EVERY_S)
        )
    _print_summary(summary, cache, cfg)
    if summary.interrupted:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 128 + (signums[0] if signums else signal.SIGINT)
    for sub in ("mels", "tokens"):  # make the renames of every output durable before the manifest
        fd = os.open(cache / sub, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    manifest, problems = build_manifest(cache, cfg.n_mels)
    for problem in problems:
        print(f"bad: {problem}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} bad files in {cache}; manifest not written", file=sys.stderr)
        return 1
    path = write_manifest(manifest)
    print(
        f"manifest: {len(manifest)} utterances, vocabulary {len(manifest.vocabulary or ())} symbols, "
        f"fingerprint {manifest.fingerprint} -> {path}"
    )
    return 0
