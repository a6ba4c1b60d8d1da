"""``verify-cache``: check every cache file's header, size and values, and say what is wrong.

Role: the offline counterpart of the producer's read-time checks. ``index`` reads only the mels'
headers; this also reads every mel's data, so NaN/Inf values and files changed since indexing are found
before a training run quarantines (or, under ``producer.bad_samples: fail``, stops on) them.

With ``manifest.json`` the listed utterances are checked against their rows (the files a training
run reads): missing, a size other than the recorded one (truncated or rewritten), a header that no
longer matches the row, non-finite mel values, and token ids: negative (as ``index`` refuses them),
outside the ``token_range`` the manifest records (the file changed since indexing), or, with
``vocab_size`` (``--vocab-size``), one the model cannot embed (the files behind a consumer's
``model.vocab_size`` refusal). ``.npy`` files in ``mels/``/``tokens/`` that the
manifest does not list are reported as warnings (``fatal=False``): training never reads them, so
they cannot hurt a run, but they usually mean a forgotten ``index`` or a file ``--skip-bad`` left
out. Without a manifest (or with one that does not load) every file is checked by its header with
the rules ``index`` applies, plus the same value scan. Extra arrays (``extras/<name>/``) are checked
against the manifest's declarations and rows (only with a manifest: it is what declares them): the
file exists, its size and header are the indexed ones, its shape and dtype fit the declared kind
and the utterance's frames or tokens, and a float extra holds no NaN/Inf.

Invariants:
- Problems come out sorted by path, at most one per file (the first check that fails).
- Memory stays bounded: mel data is read in ``_CHUNK_BYTES`` chunks into one reused buffer.
- Pure of clocks and terminals: progress goes to a callback; the CLI decides how to show it.
Shutdown: nothing to shut down; every file opened here is closed before returning.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from melfeed.shared.cache.extras import ExtraColumn, check_extra_header
from melfeed.shared.cache.filekind import open_regular
from melfeed.shared.cache.index import check_mel_header, check_token_header, list_npy, token_range  # index's rules
from melfeed.shared.cache.manifest import MANIFEST_NAME, TOKEN_DTYPE, Manifest, Utterance, load_manifest
from melfeed.shared.cache.npyfile import NpyHeader, inspect_npy
from melfeed.shared.errors import CacheError

__all__ = ["VerifyProblem", "VerifyReport", "verify_cache"]

_CHUNK_BYTES = 1 << 20  # 1 MiB per read: bounded memory, few syscalls (a typical mel is ~180 KB)


@dataclass(frozen=True, slots=True)
class VerifyProblem:
    """One file and what is wrong with it; ``fatal=False`` marks a warning (unlisted file)."""

    path: str
    reason: str
    fatal: bool = True

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What ``verify_cache`` checked and found."""

    cache_dir: Path
    has_manifest: bool  # True: utterances were checked against a loadable manifest.json
    utterances: int  # utterance ids checked (listed ones with a manifest, all ids without)
    files: int  # .npy paths checked, missing ones included
    problems: tuple[VerifyProblem, ...]  # sorted by path, at most one per path

    @property
    def bad(self) -> tuple[VerifyProblem, ...]:
        """The fatal problems: files a training run would quarantine or stop on."""
        return tuple(p for p in self.problems if p.fatal)

    @property
    def warnings(self) -> tuple[VerifyProblem, ...]:
        return tuple(p for p in self.problems if not p.fatal)


def _list_npy(directory: Path) -> dict[str, Path]:
    """``{stem: path}`` of the ``.npy`` files in ``directory``; empty when it does not exist."""
    return list_npy(directory) if directory.is_dir() else {}  # unreadable: CacheError (exit 78)


class _Scanner:
    """Counts non-finite mel values chunk by chunk, reusing one buffer for every file; checks token ids."""

    def __init__(self, recorded: tuple[int, int] | None = None, vocab_size: int | None = None) -> None:
        self._buf = bytearray(_CHUNK_BYTES)
        self._finite = np.empty(_CHUNK_BYTES // 2, dtype=bool)  # one flag per float16, the smallest item
        self._recorded, self._vocab_size = recorded, vocab_size  # the manifest's token_range; --vocab-size

    def tokens(self, path: Path, header: NpyHeader, listed: bool) -> str | None:
        """Why a token file's ids are wrong (negative, beyond the manifest's range if ``listed``, or
        ``>= vocab_size``), else ``None``."""
        try:
            smallest, largest = token_range(path, header)
        except CacheError as err:
            return err.reason
        lo, hi = self._recorded or (smallest, largest)
        if listed and not lo <= smallest <= largest <= hi:
            return (
                f"changed since index: token ids {smallest}..{largest}, outside the {lo}..{hi} the manifest "
                "records; re-run index"
            )
        if self._vocab_size is not None and largest >= self._vocab_size:
            return f"token id {largest} >= --vocab-size {self._vocab_size}"
        return None

    def scan(self, path: Path, header: NpyHeader) -> str | None:
        """Return a reason if the data holds NaN or Inf (or cannot be read), else ``None``."""
        dtype, row_items = header.dtype, int(np.prod(header.shape[1:], dtype=np.int64))
        chunk_items = _CHUNK_BYTES // dtype.itemsize  # chunks may split a frame: frames come from item indices
        n_nan = n_inf = 0
        first_frame = -1
        try:
            fd, _ = open_regular(path)  # inspect_npy checked it; this guards against a swap since
            with os.fdopen(fd, "rb", buffering=0) as f:
                f.seek(header.data_offset)
                done, total = 0, header.nbytes // dtype.itemsize
                while done < total:
                    k = min(chunk_items, total - done)
                    view = memoryview(self._buf)[: k * dtype.itemsize]
                    if f.readinto(view) != len(view):  # raw file: short only at EOF
                        return f"short read at item {done} of {total}"
                    values = np.frombuffer(view, dtype=dtype)
                    finite = np.isfinite(values, out=self._finite[:k])
                    if not finite.all():
                        if first_frame < 0:
                            first_frame = (done + int(np.argmin(finite))) // row_items
                        nan = int(np.count_nonzero(np.isnan(values)))
                        n_nan += nan
                        n_inf += k - int(np.count_nonzero(finite)) - nan
                    done += k
        except CacheError as err:
            return err.reason
        except OSError as err:
            return f"read failed ({err.strerror})"
        if first_frame < 0:
            return None
        return f"{n_nan + n_inf} non-finite values (NaN/Inf): {n_nan} NaN, {n_inf} Inf; first at frame {first_frame}"


def _check_file(path: Path, is_mel: bool, n_mels: int, row: Utterance | None, scanner: _Scanner) -> str | None:
    """The first thing wrong with one file (header, size vs ``row``, values), or ``None``."""
    try:
        header, size = inspect_npy(path)
    except CacheError as err:
        return err.reason + (" (listed in the manifest)" if row is not None and err.reason == "missing" else "")
    bad = check_mel_header(header, n_mels) if is_mel else check_token_header(header)
    if bad:
        return bad
    if row is not None:
        want_bytes = row.mel_file_bytes if is_mel else row.tok_file_bytes
        if size != want_bytes:
            return f"changed since index: {size} bytes, manifest says {want_bytes}; re-run index"
        want = (
            ((row.frames, n_mels), row.mel_dtype, row.mel_offset)
            if is_mel
            else ((row.tokens,), TOKEN_DTYPE.name, row.tok_offset)
        )
        got = (header.shape, header.dtype.name, header.data_offset)
        if got != want:
            return f"changed since index: header says shape/dtype/offset {got}, manifest {want}; re-run index"
    return scanner.scan(path, header) if is_mel else scanner.tokens(path, header, row is not None)


def _paired(uid: str, mel: Path | None, tok: Path | None) -> VerifyProblem | None:
    """Without a manifest, a file whose partner is missing is the problem (as ``index`` says)."""
    if mel is not None and tok is None:
        return VerifyProblem(str(mel), f"no matching tokens/{uid}.npy")
    if tok is not None and mel is None:
        return VerifyProblem(str(tok), f"no matching mels/{uid}.npy")
    return None


def _check_utterance(
    uid: str, mel: Path | None, tok: Path | None, row: Utterance | None, n_mels: int, scanner: _Scanner
) -> list[VerifyProblem]:
    """The problems of one utterance's two files (``row``: its manifest row, if listed)."""
    unpaired = _paired(uid, mel, tok)
    if unpaired is not None or mel is None or tok is None:
        return [unpaired] if unpaired is not None else []
    out = []
    for path, is_mel in ((mel, True), (tok, False)):
        reason = _check_file(path, is_mel, n_mels, row, scanner)
        if reason is not None:
            out.append(VerifyProblem(str(path), reason))
    return out


def _load(root: Path, n_mels: int, problems: list[VerifyProblem]) -> Manifest | None:
    """The manifest; ``None`` when there is none or it does not load (reported)."""
    if not (root / MANIFEST_NAME).exists():
        return None
    try:
        return load_manifest(root, n_mels)
    except CacheError as err:  # report it; the caller then checks every file by its header instead
        problems.append(VerifyProblem(err.path, err.reason))
        return None


def _check_extra_file(manifest: Manifest, column: ExtraColumn, i: int, scanner: _Scanner) -> VerifyProblem | None:
    """The first thing wrong with utterance ``i``'s file of one extra, or ``None``."""
    path, spec = manifest.extra_path(column.spec.name, i), column.spec
    utt = manifest.utterances[i]
    try:
        header, size = inspect_npy(path)
    except CacheError as err:
        return VerifyProblem(str(path), err.reason + (" (listed in the manifest)" if err.reason == "missing" else ""))
    length, offset, file_bytes = (int(x) for x in column.rows[i])
    bad = check_extra_header(spec, header, utt.frames, utt.tokens)
    if bad is None and size != file_bytes:
        bad = f"changed since index: {size} bytes, manifest says {file_bytes}; re-run index"
    elif bad is None and (header.shape != spec.file_shape(length, utt.frames) or header.data_offset != offset):
        bad = (
            f"changed since index: header says shape {header.shape} offset {header.data_offset}, manifest "
            f"{spec.file_shape(length, utt.frames)} {offset}; re-run index"
        )
    elif bad is None and header.dtype.kind == "f":
        bad = scanner.scan(path, header)
    return VerifyProblem(str(path), f"extra {spec.name!r}: {bad}") if bad else None


def _check_extras(manifest: Manifest, scanner: _Scanner) -> tuple[int, list[VerifyProblem]]:
    """Every listed utterance's file of every declared extra: (files checked, problems)."""
    out = [_check_extra_file(manifest, c, i, scanner) for c in manifest.extras for i in range(len(manifest))]
    return len(out), [p for p in out if p is not None]


def _check_unlisted(
    mels: dict[str, Path], toks: dict[str, Path], rows: dict[str, Utterance], n_mels: int, scanner: _Scanner
) -> list[VerifyProblem]:
    """Warnings for files the manifest does not list, saying whether ``index`` could use them."""
    out = []
    for stems, other, is_mel in ((mels, toks, True), (toks, mels, False)):
        for uid in sorted(stems.keys() - rows.keys()):
            path = stems[uid]
            unpaired = None if uid in other else _paired(uid, path if is_mel else None, None if is_mel else path)
            reason = unpaired.reason if unpaired else _check_file(path, is_mel, n_mels, None, scanner)
            note = f"; also bad: {reason}" if reason else "; re-run index to use it"
            out.append(VerifyProblem(str(path), "not in the manifest (training ignores it)" + note, fatal=False))
    return out


def verify_cache(
    cache_dir: str | os.PathLike[str],
    n_mels: int = 80,
    progress: Callable[[int, int], None] | None = None,
    vocab_size: int | None = None,
) -> VerifyReport:
    """Check every file of a cache; see the module docstring for what is checked.

    Args:
        cache_dir: Directory holding ``mels/``, ``tokens/`` and usually ``manifest.json``.
        n_mels: Required mel bins (the manifest's must match).
        progress: Called as ``progress(done, total)`` after each utterance id.
        vocab_size: If given, a token file holding an id ``>= vocab_size`` is bad too.

    Returns:
        The report; ``report.bad`` is empty for a cache a training run reads without a problem.

    Raises:
        CacheError: ``cache_dir`` is not a directory, ``mels/`` or ``tokens/`` cannot be listed (mode 000),
            or it has no manifest and no ``.npy`` files.
    """
    root = Path(cache_dir)
    if not root.is_dir():
        raise CacheError(root, "no such cache directory")
    mels, toks = _list_npy(root / "mels"), _list_npy(root / "tokens")
    problems: list[VerifyProblem] = []
    manifest = _load(root, n_mels, problems)
    rows = {u.id: u for u in manifest.utterances} if manifest is not None else None
    if rows is None and not mels and not toks:
        raise CacheError(root, "empty cache: no manifest and no .npy files in mels/ or tokens/")
    ids = sorted(rows) if rows is not None else sorted(mels.keys() | toks.keys())
    scanner, files = _Scanner(manifest.token_range if manifest is not None else None, vocab_size), 0
    for done, uid in enumerate(ids, 1):
        if rows is not None:  # listed: both files must be there and match the row
            row: Utterance | None = rows[uid]
            mel: Path | None = root / "mels" / f"{uid}.npy"
            tok: Path | None = root / "tokens" / f"{uid}.npy"
        else:
            row, mel, tok = None, mels.get(uid), toks.get(uid)
        files += (mel is not None) + (tok is not None)
        problems += _check_utterance(uid, mel, tok, row, n_mels, scanner)
        if progress is not None:
            progress(done, len(ids))
    if manifest is not None and rows is not None:
        unlisted = _check_unlisted(mels, toks, rows, n_mels, scanner)
        n_extra, extra_problems = _check_extras(manifest, scanner)
        files += len(unlisted) + n_extra
        problems += unlisted + extra_problems
    problems.sort(key=lambda p: p.path)
    return VerifyReport(root, rows is not None, len(ids), files, tuple(problems))
