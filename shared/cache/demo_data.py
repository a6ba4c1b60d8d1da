"""A deterministic, LJSpeech-shaped demo cache, so the pipeline runs without a real dataset.

Role: ``write_demo_cache`` writes ``mels/<id>.npy`` (float32 [frames, n_mels]),
``tokens/<id>.npy`` (int32 [tokens]) and the manifest, with LJSpeech-like lengths (frames
100..870, mean ~570; ~4.5 frames per token) and log-mel-like values (about -11.5..2, smooth
across bins, low bins louder). The mels are a deterministic function of the tokens plus small
noise: each token id owns a fixed spectral template, and frame ``t`` of an utterance with
``L`` tokens and ``T`` frames shows token ``t * L // T``, smoothed in time. A model can
therefore learn text -> mel, so a falling loss means the pipeline delivers matching pairs.
With ``extras=True`` (every ``--demo`` and ``demo-data``) it also writes two extra arrays, so the
batch schema is exercised end to end: ``extras/speaker/<id>.npy`` (int32 scalar, kind
``utterance``: a speaker id 0..7 by chapter) and ``extras/energy/<id>.npy`` (float32 [frames], kind
``frame``: the mean log-mel of each frame). Neither draws from the random stream, so the mels and
tokens are the same bytes with or without them.

Invariants:
- Same parameters -> byte-identical files. The token templates come from a fixed seed, so
  every demo cache (any ``seed``) shares one text -> mel mapping.
- ``demo.json`` is written last and removed first when regenerating: if it exists and
  matches, the cache is complete and is reused as is.
- Only a directory that is empty or already a demo cache (has ``demo.json``) is written to.
Shutdown: nothing to shut down; writes are plain files, resumable by calling again.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt

from melfeed.shared.cache.filekind import check_cache_dir, make_dirs
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest, load_manifest, write_manifest
from melfeed.shared.errors import CacheError, ConfigError

__all__ = [
    "DEMO_VOCAB_SIZE",
    "DEMO_MARKER",
    "DEMO_EXTRAS",
    "DEMO_UTTERANCES_MAX",
    "DEMO_SEED_MAX",
    "write_demo_cache",
    "demo_utterance_id",
    "default_demo_dir",
]

log = logging.getLogger(__name__)

DEMO_VOCAB_SIZE = 64  # token ids 1..63; 0 is padding
DEMO_MARKER = "demo.json"
_DEMO_FORMAT = 1  # bump when the generated data changes, so old demo caches are rebuilt
_TEMPLATE_SEED = 0x6D656C  # fixed: every demo cache shares one token -> spectrum mapping
_FRAMES_MIN, _FRAMES_MAX = 100, 870
_FRAMES_MEAN, _FRAMES_STD = 575.0, 170.0  # clipped normal; clipping pulls the mean to ~570
_TOKENS_MIN, _TOKENS_MAX = 20, 190
_FRAMES_PER_TOKEN = 4.5
_LOG_MEL_MIN, _LOG_MEL_MAX = -11.5, 2.0  # log(1e-5) floor, as in Tacotron-style mels
_NOISE_STD = 0.25
_SMOOTH_FRAMES = 5  # moving-average width in frames: token boundaries blur like real speech
_UTTERANCES_PER_CHAPTER = 300
_SPEAKERS = 8
_UTTERANCES_PER_SPEAKER = 25
DEMO_EXTRAS = {"speaker": "utterance", "energy": "frame"}  # name -> kind, declared at index time
DEMO_UTTERANCES_MAX = 1_000_000  # ~75 times LJSpeech, ~180 GB of float32 mels: more is a typo, not a demo
DEMO_SEED_MAX = 2**63 - 1  # seeds are 0..2^63-1 (numpy refuses negative ones)


def default_demo_dir(n_utterances: int) -> Path:
    """Where ``--demo`` keeps its cache: ``$XDG_CACHE_HOME`` (or ~/.cache; a relative value is ignored, as the
    XDG spec asks)/melfeed/demo/N."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    base = base if os.path.isabs(base) else str(Path.home() / ".cache")
    return Path(base) / "melfeed" / "demo" / str(n_utterances)


def demo_utterance_id(index: int) -> str:
    """The demo id of utterance ``index`` (0-based), LJSpeech style: ``LJ001-0001``."""
    chapter, item = divmod(index, _UTTERANCES_PER_CHAPTER)
    return f"LJ{chapter + 1:03d}-{item + 1:04d}"


def _templates(n_mels: int) -> npt.NDArray[np.float32]:
    """One smooth log-mel spectrum per token id, float32 [DEMO_VOCAB_SIZE, n_mels]."""
    rng = np.random.default_rng(_TEMPLATE_SEED)
    pos = np.linspace(0.0, 1.0, n_mels)
    envelope = -1.0 - 6.5 * pos  # low bins louder
    # A few low-order cosines per token: smooth across bins, distinct between tokens.
    basis = np.cos(np.pi * np.outer(np.arange(1, 7), pos))  # [6, n_mels]
    coeffs = rng.normal(0.0, 1.0, size=(DEMO_VOCAB_SIZE, 6)) / np.arange(1, 7)
    spectra = envelope + 1.8 * coeffs @ basis
    return np.clip(spectra, _LOG_MEL_MIN + 1.0, _LOG_MEL_MAX - 0.5).astype(np.float32)


def _lengths(n: int, rng: np.random.Generator) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Frames and tokens per utterance, int64 [n] each."""
    frames = np.clip(np.rint(rng.normal(_FRAMES_MEAN, _FRAMES_STD, n)), _FRAMES_MIN, _FRAMES_MAX)
    rate = _FRAMES_PER_TOKEN * np.exp(rng.normal(0.0, 0.08, n))  # speaking-rate jitter
    tokens = np.clip(np.rint(frames / rate), _TOKENS_MIN, _TOKENS_MAX)
    return frames.astype(np.int64), tokens.astype(np.int64)


def _smooth_time(x: npt.NDArray[np.float32], width: int) -> npt.NDArray[np.float32]:
    """Centred moving average over axis 0 with edge padding; same shape as ``x``."""
    half = width // 2
    padded = np.concatenate([np.repeat(x[:1], half, 0), x, np.repeat(x[-1:], width - 1 - half, 0)])
    csum = np.cumsum(padded, axis=0, dtype=np.float64)
    csum = np.concatenate([np.zeros((1, x.shape[1])), csum])
    return ((csum[width:] - csum[:-width]) / width).astype(np.float32)


def _utterance(
    frames: int, tokens: int, templates: npt.NDArray[np.float32], rng: np.random.Generator
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int32]]:
    """One utterance: mel float32 [frames, n_mels] and token ids int32 [tokens]."""
    ids = rng.integers(1, DEMO_VOCAB_SIZE, size=tokens, dtype=np.int32)
    shown = ids[np.arange(frames) * tokens // frames]  # token on screen at each frame
    mel = _smooth_time(templates[shown], _SMOOTH_FRAMES)
    mel += rng.normal(0.0, 0.3, size=1).astype(np.float32)  # per-utterance loudness
    mel += rng.standard_normal(mel.shape, dtype=np.float32) * np.float32(_NOISE_STD)
    np.clip(mel, _LOG_MEL_MIN, _LOG_MEL_MAX, out=mel)
    return mel, ids


def _params(n_utterances: int, seed: int, n_mels: int, extras: bool) -> dict[str, int]:
    params = {"format": _DEMO_FORMAT, "n_utterances": n_utterances, "seed": seed, "n_mels": n_mels}
    if extras:  # only when set: a demo cache without extras keeps the marker it always had
        params["extras"] = 1
    return params


def _write_extras(root: Path, index: int, uid: str, mel: npt.NDArray[np.float32]) -> None:
    """The demo extras of one utterance: its speaker id and per-frame energy."""
    speaker = np.int32(index // _UTTERANCES_PER_SPEAKER % _SPEAKERS)
    np.save(root / "extras" / "speaker" / f"{uid}.npy", np.array(speaker, dtype=np.int32))
    np.save(root / "extras" / "energy" / f"{uid}.npy", mel.mean(axis=1, dtype=np.float32))


def _reuse(root: Path, params: dict[str, int]) -> Manifest | None:
    """The existing manifest if ``root`` is a complete demo cache with these params."""
    try:
        if json.loads((root / DEMO_MARKER).read_text()) != params:
            return None
        manifest = load_manifest(root, params["n_mels"])
    except (OSError, ValueError, RecursionError, CacheError):  # a demo.json nested too deeply: regenerate
        return None
    # A demo cache indexed before manifests recorded token_range is rebuilt: its runs would warn that ids are unchecked.
    return manifest if len(manifest) == params["n_utterances"] and manifest.token_range is not None else None


def _prepare(root: Path, keep: set[str], extras: bool) -> None:
    """Make ``root`` ready for writing; delete stale ``.npy`` files of an older demo cache."""
    is_demo = (root / DEMO_MARKER).exists()
    if is_demo and not extras:
        for name in DEMO_EXTRAS:
            shutil.rmtree(root / "extras" / name, ignore_errors=True)
    for sub in ("mels", "tokens", *(f"extras/{name}" for name in DEMO_EXTRAS if extras)):
        d = root / sub
        d.mkdir(parents=True, exist_ok=True)
        stale = [p for p in d.glob("*.npy") if p.stem not in keep]
        if stale and not is_demo:
            raise CacheError(d, f"not a demo cache ({len(stale)} other .npy files); refusing to write")
        for p in stale:
            p.unlink()
    (root / DEMO_MARKER).unlink(missing_ok=True)


_LOCK_WAIT_S = 600.0  # the longest another writer may hold the demo cache (2000 utterances: seconds)
_LOCK_POLL_S = 0.1


def write_demo_cache(
    out_dir: str | os.PathLike[str],
    n_utterances: int = 2000,
    seed: int = 1234,
    n_mels: int = 80,
    extras: bool = False,
    utterances_flag: str = "--demo-utterances",
) -> Manifest:
    """Write (or reuse) a deterministic demo cache and its manifest.

    Args:
        out_dir: Cache directory; created if missing. Must be empty or a demo cache.
        n_utterances: Number of utterances, 1..DEMO_UTTERANCES_MAX.
        seed: Seeds lengths, token ids and noise (0..DEMO_SEED_MAX); the token -> spectrum mapping is fixed.
        n_mels: Mel bins per frame.
        extras: Also write the extra arrays ``speaker`` and ``energy`` (module docstring).
        utterances_flag: The flag ``n_utterances`` came from, named when it is refused.

    The cache is also packed (``melfeed-float32.pack``, ``shared/cache/pack_write.py``) unless a pack that
    serves it is there already.

    Returns:
        The manifest of the cache.

    Raises:
        ConfigError: ``n_utterances`` (named as ``utterances_flag``) or ``seed`` (``--seed``) out of range.
        ValueError: ``n_mels`` < 1.
        CacheError: ``out_dir`` holds ``.npy`` files that are not from a demo cache, is not a directory,
            or cannot be created or written (read-only parent, disk full): one line with the OS reason;
            or another user could write to it or swap it (``melfeed.shared.output_files.output_dir_reason``).
    """
    if not 1 <= n_utterances <= DEMO_UTTERANCES_MAX:
        raise ConfigError(f"must be in 1..{DEMO_UTTERANCES_MAX}", path=(utterances_flag,), got=n_utterances)
    if not 0 <= seed <= DEMO_SEED_MAX:
        raise ConfigError(f"must be in 0..{DEMO_SEED_MAX} (2^63-1)", path=("--seed",), got=seed)
    if n_mels < 1:
        raise ValueError(f"n_mels must be >= 1, got {n_mels}")
    root = Path(out_dir)
    check_cache_dir(root, "demo cache")  # before the lock file or any directory is made
    make_dirs(root.parent)  # the lock sits beside the cache: a file or /proc path is refused, never locked
    if root.exists() and not root.is_dir():
        raise CacheError(root, "not a directory")
    with _writer_lock(root):
        make_dirs(root)
        check_cache_dir(root, "demo cache")
        try:
            manifest = _write_or_reuse(root, n_utterances, seed, n_mels, extras)
            from melfeed.shared.cache.pack_write import ensure_pack

            ensure_pack(manifest, "float32")  # packed, as melfeed pack would
        except OSError as err:  # a read-only demo cache, disk full: one line, not a traceback
            raise CacheError(err.filename or root, f"cannot write the demo cache ({err.strerror})") from err
        return manifest


@contextmanager
def _writer_lock(root: Path) -> Iterator[None]:
    """One writer per demo cache: two processes started with ``--demo`` at once (two ranks on one host)
    would otherwise write the same files, and one could read another's half-written ``.npy``. The lock
    file sits beside the cache (``.<name>.lock``) so the cache directory itself stays empty or a cache.
    Waits at most ``_LOCK_WAIT_S`` for the other writer; a parent that refuses the lock file means no lock."""
    wait_s = _LOCK_WAIT_S
    try:
        fd = os.open(root.parent / f".{root.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        log.warning("demo cache %s: no writer lock (%s); do not start two --demo runs at once", root, err)
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CacheError(
                        root,
                        f"another process has been writing this demo cache for over {wait_s:.0f} s; "
                        "let it finish, or remove the directory and retry",
                    ) from None
                time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_or_reuse(root: Path, n_utterances: int, seed: int, n_mels: int, extras: bool) -> Manifest:
    params = _params(n_utterances, seed, n_mels, extras)
    existing = _reuse(root, params)
    if existing is not None:
        log.info("demo cache reused dir=%s utterances=%d", root, n_utterances)
        return existing
    ids = [demo_utterance_id(i) for i in range(n_utterances)]
    _prepare(root, set(ids), extras)
    rng = np.random.default_rng(seed)
    frames, tokens = _lengths(n_utterances, rng)
    templates = _templates(n_mels)
    for index, (uid, t, n) in enumerate(zip(ids, frames.tolist(), tokens.tolist())):
        mel, tok = _utterance(t, n, templates, rng)
        np.save(root / "mels" / f"{uid}.npy", mel)
        np.save(root / "tokens" / f"{uid}.npy", tok)
        if extras:
            _write_extras(root, index, uid, mel)
    manifest, problems = build_manifest(root, n_mels, kinds=DEMO_EXTRAS if extras else None)
    if problems:  # we just wrote every file, so this is a bug, not a bad cache
        raise RuntimeError(f"demo cache has problems: {problems[0]}")
    write_manifest(manifest)
    (root / DEMO_MARKER).write_text(json.dumps(params, sort_keys=True))
    log.info("demo cache written dir=%s utterances=%d", root, n_utterances)
    return manifest
