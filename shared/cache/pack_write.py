"""``melfeed pack``: write a cache's packed copy (``shared/cache/pack_format.py``), checked once.

Every source file of every manifest utterance is read whole, and checked by the rules a producer
applies at read time: a regular file of the indexed size, a header that still says what the manifest
says, no NaN/Inf in a mel or a float extra, and (float16 pack from float32 mels) no finite value
beyond float16's range. A row that fails is written as zeros and listed in the header's ``bad``
table with its file and reason, so a producer reading the pack quarantines (or, under
``producer.bad_samples: fail``, stops on) the rows it would have refused reading the files, with one
difference: the pack checks a whole file's values, the file reader only the frames a bucket keeps, so a
NaN/Inf beyond a bucket's cut makes the row bad here and not there. Every producer reading one pack
decides alike, which is what keeps quarantine deterministic. The command publishes a pack with bad rows
only when asked (``--skip-bad``, as ``index`` writes a manifest without its bad files): otherwise it lists
them, writes nothing and exits 1.
Invariants: the pack appears only complete (temp file ``.NAME-<pid>-*.tmp`` in the cache dir, fsync,
rename, fsync of the directory; a temp file whose writer died is removed by the next ``pack``); memory
stays bounded by one utterance's files; the sources digest is of the files as they were read (``fstat``
of each open descriptor).
Shutdown: nothing outlives a call; a failed write removes its temp file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from melfeed.shared.cache.filekind import open_regular
from melfeed.shared.cache.index import ids_outside
from melfeed.shared.cache.manifest import MEL_DTYPES, TOKEN_DTYPE, Manifest, load_manifest
from melfeed.shared.cache.npyfile import parse_npy_header
from melfeed.shared.cache.pack_format import (
    DATA_OFFSET,
    PackHeader,
    PackLayout,
    pack_path,
    preamble,
    source_paths,
    sources_digest,
    stat_source,
)
from melfeed.shared.errors import CacheError

__all__ = ["PackSummary", "write_pack", "ensure_pack", "main_pack"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (utterances done, total)


@dataclass(frozen=True, slots=True)
class PackSummary:
    path: Path
    utterances: int
    data_bytes: int
    bad: dict[int, tuple[str, str]]  # row -> (file, reason) of every row stored as zeros and listed bad
    written: bool = True  # False: rows were bad without keep_bad, and nothing was published


def _read_whole(path: str, file_bytes: int) -> tuple[bytes, tuple[int, int]]:
    """The file's bytes (exactly the indexed size) and its (size, mtime_ns) at open."""
    try:
        fd, st = open_regular(path)
    except OSError as err:
        raise CacheError(path, f"cannot open ({err.strerror})") from err
    try:
        if st.st_size != file_bytes:
            raise CacheError(
                path, f"file changed since index (size {st.st_size}, manifest says {file_bytes}); re-run index"
            )
        data = os.pread(fd, file_bytes, 0)
        if len(data) != file_bytes:
            raise CacheError(path, f"short read: {len(data)} of {file_bytes} bytes")
        return data, (st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)


def _payload(path: str, data: bytes, shape: tuple[int, ...], dtype: np.dtype, offset: int) -> np.ndarray:
    """The file's data as an array, after its header was compared with the manifest's record."""
    try:
        header = parse_npy_header(data[:offset], path)
    except CacheError as err:
        raise CacheError(path, f"file changed since index ({err.reason}); re-run index") from err
    if (header.shape, header.dtype, header.data_offset) != (shape, dtype, offset):
        raise CacheError(
            path,
            f"file changed since index (header says shape {header.shape} dtype "
            f"{header.dtype.str}, manifest says {shape} {dtype.str}); re-run index",
        )
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape)


def _finite(path: str, values: np.ndarray, what: str) -> None:
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        raise CacheError(path, f"{bad} non-finite values (NaN/Inf) in {what}; run verify-cache")


def _record(manifest: Manifest, i: int, mel_dtype: str, stats: list[tuple[int, int]]) -> list[bytes]:
    """Utterance ``i``'s record parts (mel, tokens, extras), each checked; appends each file's stat."""
    utt, n_mels = manifest.utterances[i], manifest.n_mels
    paths = source_paths(manifest, i)
    data, stat = _read_whole(paths[0], utt.mel_file_bytes)
    stats.append(stat)
    mel = _payload(paths[0], data, (utt.frames, n_mels), MEL_DTYPES[utt.mel_dtype], utt.mel_offset)
    _finite(paths[0], mel, "the mel")
    if utt.mel_dtype != mel_dtype:
        with np.errstate(over="ignore"):
            mel = mel.astype(MEL_DTYPES[mel_dtype])  # numpy's rounding: what the file reader's cast gives
        _finite(paths[0], mel, f"the mel cast to {mel_dtype} (values beyond float16's range, largest 65504)")
    parts = [mel.tobytes()]
    data, stat = _read_whole(paths[1], utt.tok_file_bytes)
    stats.append(stat)
    tokens = _payload(paths[1], data, (utt.tokens,), TOKEN_DTYPE, utt.tok_offset)
    changed = ids_outside(tokens, manifest.token_range)  # the range the consumer's start checked
    if changed is not None:
        raise CacheError(paths[1], changed)
    parts.append(tokens.tobytes())
    for column, path in zip(manifest.extras, paths[2:]):
        spec = column.spec
        length, offset, file_bytes = (int(x) for x in column.rows[i])
        data, stat = _read_whole(path, file_bytes)
        stats.append(stat)
        values = _payload(path, data, spec.file_shape(length), np.dtype(spec.dtype).newbyteorder("<"), offset)
        _finite(path, values, f"extra {spec.name!r}")
        parts.append(values.tobytes())
    return parts


def _remove_dead_temps(final: Path) -> None:
    """Temp files a killed ``pack`` of this name left (``.NAME-<pid>-*.tmp`` of a pid no longer alive)."""
    for tmp in final.parent.glob(f".{final.name}-*-*.tmp"):
        try:
            pid = int(tmp.name[len(final.name) + 2 :].split("-", 1)[0])
            os.kill(pid, 0)
        except ValueError:
            continue  # not ours
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
            log.info("removed %s, left by an interrupted pack", tmp)
        except PermissionError:
            continue  # alive, another user's


def _write_records(
    f: BinaryIO, manifest: Manifest, mel_dtype: str, layout: PackLayout, progress: Progress | None, keep_bad: bool
) -> tuple[dict[int, tuple[str, str]], list[tuple[int, int]]]:
    """Every utterance's record, in manifest order: the bad rows and each source file's (size, mtime_ns).

    Without ``keep_bad`` the records after the first bad row are checked but not written: the pack will not
    be published, and the list of bad rows must still be complete.
    """
    bad: dict[int, tuple[str, str]] = {}
    stats: list[tuple[int, int]] = []
    for i in range(len(manifest)):
        done = len(stats)
        try:
            parts = _record(manifest, i, mel_dtype, stats)
        except CacheError as err:
            bad[i] = (str(err.path), err.reason)
            del stats[done:]
            stats.extend(stat_source(p) for p in source_paths(manifest, i))
            parts = [bytes(int(layout.parts[i].sum()))]
        if keep_bad or not bad:
            for part in parts:
                f.write(part)
        if progress is not None:
            progress(i + 1, len(manifest))
    return bad, stats


def write_pack(
    manifest: Manifest, mel_dtype: str, progress: Progress | None = None, *, keep_bad: bool = True
) -> PackSummary:
    """Write ``pack_path(manifest.cache_dir, mel_dtype)`` from the manifest's files.

    Args:
        keep_bad: Publish the pack even when some rows are bad (zeros, listed in its header). False: a bad row
            means nothing is published (``PackSummary.written`` is False; an older pack stays as it was).

    Raises:
        ValueError: ``mel_dtype`` is not a cache mel dtype.
        CacheError: the cache has a matrix extra (a pack does not hold one).
        OSError: the pack cannot be written (permissions, disk full); nothing is left behind.
    """
    if mel_dtype not in MEL_DTYPES:
        raise ValueError(f"mel_dtype must be one of {sorted(MEL_DTYPES)}, got {mel_dtype!r}")
    matrix = next((c.spec.name for c in manifest.extras if c.spec.kind == "matrix"), None)
    if matrix is not None:  # its rows are narrower than the batch's: the pack's one-copy row read cannot place them
        raise CacheError(
            manifest.cache_dir,
            f"extra {matrix!r} is a matrix, which a pack does not hold; producers read its .npy files",
        )
    layout = PackLayout.of(manifest, mel_dtype)
    final = pack_path(manifest.cache_dir, mel_dtype)
    _remove_dead_temps(final)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}-{os.getpid()}-", suffix=".tmp", dir=manifest.cache_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(DATA_OFFSET))
            bad, stats = _write_records(f, manifest, mel_dtype, layout, progress, keep_bad)
            publish = keep_bad or not bad
            if publish:
                raw = PackHeader(
                    manifest.fingerprint, mel_dtype, layout.data_bytes, sources_digest(stats), bad
                ).to_json()
                f.write(raw)
                f.seek(0)
                f.write(preamble(len(raw), layout.data_bytes))
                f.flush()
                os.fsync(f.fileno())
        if not publish:
            Path(tmp).unlink()
            return PackSummary(final, len(manifest), layout.data_bytes, bad, written=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(manifest.cache_dir, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return PackSummary(final, len(manifest), layout.data_bytes, bad)


def ensure_pack(manifest: Manifest, mel_dtype: str) -> None:
    """Write the cache's ``mel_dtype`` pack unless one that serves this manifest is there already."""
    from melfeed.shared.cache.pack_format import PackUnusable, open_pack

    try:
        open_pack(manifest, mel_dtype).close()
        return
    except PackUnusable:
        pass
    summary = write_pack(manifest, mel_dtype)
    log.info("packed %s (%d data bytes, %d bad rows)", summary.path, summary.data_bytes, len(summary.bad))


def main_pack(args: argparse.Namespace) -> int:
    """Exit 0 when the pack is written, 1 when files are bad (written only with ``--skip-bad``), 78 on a bad cache.

    Every bad file is one ``bad: PATH: REASON`` line on stderr, as ``index`` prints them.
    """
    from melfeed.shared.cache.features import check_n_mels_flag
    from melfeed.shared.service.progress import Progress as Bar
    from melfeed.shared.service.progress import progress_interval_s

    manifest = load_manifest(args.cache_dir, check_n_mels_flag(args.n_mels))
    bar = Bar(0, sys.stderr, label="pack", unit="utterances", interval_s=progress_interval_s(5.0))
    try:
        summary = write_pack(manifest, args.mel_dtype, bar.callback(), keep_bad=getattr(args, "skip_bad", False))
    except OSError as err:  # reading a source (EIO) or writing the pack (ENOSPC, EACCES): nothing left behind
        where = f"{err.filename}: " if err.filename else ""
        raise CacheError(args.cache_dir, f"pack not written ({where}{err.strerror})") from err
    finally:
        bar.finish()
    for path, reason in summary.bad.values():
        print(f"bad: {path}: {reason}", file=sys.stderr)
    if not summary.written:
        print(
            f"{len(summary.bad)} bad files; pack not written (fix them, or pass --skip-bad to write it with "
            "their rows quarantined)",
            file=sys.stderr,
        )
        return 1
    print(
        f"packed {summary.utterances} utterances ({summary.data_bytes / 1e6:.1f} MB, {args.mel_dtype} mels)"
        f" -> {summary.path}" + (f"; {len(summary.bad)} bad rows will be quarantined" if summary.bad else "")
    )
    return 0
