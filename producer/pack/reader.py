"""Read whole batch rows (mel, tokens, extras) from a packed cache: copied from a mapping, or one ``preadv``.

Role: the fast path of ``producer/batcher.py`` when the cache has a usable pack for the batch's mel
dtype (``producer.pack: auto``; written by ``melfeed pack``). A row goes into its places in
the send buffer or the consumer's slot: the mel's first ``n`` frames, the tokens, each extra. Mapped
(the default, ``producer/pack/mapped.py``), each place is one copy out of the mapping and the parts a
bucket cuts off are skipped; with ``preadv`` (the mapping failed, or a producer died of a bus error on
this pack before), the row is one scatter read from one descriptor, cut parts into a scratch sink.
No open, header compare, open-file lookup or value check per row: the pack was checked when it was
written, and ``open_pack`` checked at start that it belongs to this manifest and that no source file
changed since.

Invariants:
- A read fills each row by the same rule as the per-file readers (the first ``min(length, capacity)``
  elements, the padding tail zeroed; an utterance extra whole) with the same bytes, or raises
  ``CacheError``: a row the pack lists as bad names its source file and the reason found at pack
  time, so quarantine decisions match the per-file path's. A pack whose size changed since it was
  opened (``check_intact``, once per batch) or that reads short is the pack's fault, not the row's:
  ``TransientReadError`` naming the pack (the producer restarts and ``open_pack`` refuses it), as for
  reasons outside the file; never a quarantine.
- Not thread-safe (the sink is shared): one reader per thread.
Shutdown: ``close()`` unmaps, removes the fault record and closes the pack's descriptor; idempotent.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from melfeed.producer.batch_rows import RowBytes
from melfeed.producer.pack.mapped import FaultRecord, MappedPack, earlier_bus_error, pack_identity
from melfeed.producer.reader import TransientReadError
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.cache.pack_format import PackFile, PackUnusable, open_pack, pack_path
from melfeed.shared.errors import CacheError

__all__ = ["PackReader", "open_pack_reader"]

log = logging.getLogger(__name__)

_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR})
ExtraRows = Sequence[tuple[str, RowBytes, "list[int] | None"]]  # the assembler's (name, rows, lengths) per extra


class PackReader:
    """Rows of one open pack (``open_pack``) into caller-owned batch rows.

    Args:
        mapped: the pack mapped (rows copied out of it), or None (rows read with ``preadv``).
        record: this process's fault record while ``mapped`` is read; closed with the reader.
    """

    def __init__(
        self, manifest: Manifest, pack: PackFile, mapped: MappedPack | None = None, record: FaultRecord | None = None
    ) -> None:
        self._pack = pack
        self._mapped = mapped
        self._record = record
        self.mode = "mapped" if mapped is not None else "preadv"
        self.mel_dtype = pack.header.mel_dtype
        self.path = pack.path
        self._nbytes = os.fstat(pack.fd).st_size
        # One plain tuple per utterance, made once: (offset, record bytes, frames, tokens, extra lengths)
        offsets = pack.layout.offsets.tolist()
        sizes = pack.layout.parts.sum(axis=1).tolist() if len(manifest) else []
        lengths = [c.rows[:, 0].tolist() for c in manifest.extras]
        has_length = [c.spec.has_length for c in manifest.extras]
        self._rows = [
            (
                offsets[i],
                sizes[i],
                u.frames,
                u.tokens,
                tuple(lengths[k][i] if has_length[k] else -1 for k in range(len(lengths))),
            )
            for i, u in enumerate(manifest.utterances)
        ]
        self._bad = dict(pack.header.bad)
        self._sink = memoryview(bytearray(0))

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
        if self._record is not None:
            self._record.close()
        self._pack.close()

    def check_intact(self) -> None:
        """Once per batch, before its rows: the pack still has the size it had when it was opened.

        Raises:
            TransientReadError: it changed (truncated or rewritten in place): restart and reopen it.
        """
        try:
            nbytes = os.fstat(self._pack.fd).st_size
        except OSError as err:
            raise TransientReadError(str(self.path), f"cannot stat the open pack ({err.strerror})") from err
        if nbytes != self._nbytes:
            raise TransientReadError(
                str(self.path),
                f"the pack changed size while open ({self._nbytes} -> {nbytes} "
                "bytes: rewritten in place); restarting to reopen it",
            )

    def read_row(self, index: int, mel: RowBytes, tokens: RowBytes, extras: ExtraRows, row: int) -> tuple[int, int]:
        """Fill row ``row`` of every array from utterance ``index``'s record; the mel and token lengths kept.

        A sequence extra's kept length goes into its ``lengths[row]``.

        Raises:
            CacheError: the row is listed bad in the pack, or the pack ends early (see the module).
        """
        bad = self._bad.get(index)
        if bad is not None:
            raise CacheError(*bad)
        offset, size, frames, n_tokens, extra_lengths = self._rows[index]
        n_mel = frames if frames <= mel.capacity else mel.capacity
        n_tok = n_tokens if n_tokens <= tokens.capacity else tokens.capacity
        iov = [mel.head(row, n_mel)]  # cut parts all go to the one sink: read and dropped
        if n_mel < frames:
            iov.append(self._skip((frames - n_mel) * mel.item_nbytes))
        iov.append(tokens.head(row, n_tok))
        if n_tok < n_tokens:
            iov.append(self._skip((n_tokens - n_tok) * tokens.item_nbytes))
        kept = []
        for (_, rows, _), length in zip(extras, extra_lengths):
            if length < 0:  # an utterance extra: the whole row
                iov.append(rows.head(row, rows.capacity))
                kept.append(1)
                continue
            n = length if length <= rows.capacity else rows.capacity
            iov.append(rows.head(row, n))
            if n < length:
                iov.append(self._skip((length - n) * rows.item_nbytes))
            kept.append(n)
        if self._mapped is not None:
            src, sink, at = self._mapped.view, self._sink.obj, offset
            for part in iov:  # the size was checked this batch (check_intact): in bounds
                n = part.nbytes
                if part.obj is not sink:
                    part[:] = src[at : at + n]
                at += n
        else:
            self._pread(iov, offset, size, index)
        if n_mel < mel.capacity:
            mel.zero_tail(row, n_mel)
        if n_tok < tokens.capacity:
            tokens.zero_tail(row, n_tok)
        for (_, rows, lens), length, n in zip(extras, extra_lengths, kept):
            if length >= 0 and n < rows.capacity:
                rows.zero_tail(row, n)
            if lens is not None:
                lens[row] = n
        return n_mel, n_tok

    def _pread(self, iov: list[memoryview], offset: int, size: int, index: int) -> None:
        try:
            got = os.preadv(self._pack.fd, iov, offset)
        except OSError as err:
            cls = TransientReadError if err.errno in _TRANSIENT else CacheError
            raise cls(str(self.path), f"read failed ({err.strerror})") from err
        if got != size:  # the pack's fault, not the row's: restart, reopen, refuse it
            raise TransientReadError(
                str(self.path),
                f"short read at record {index}: {got} of {size} bytes (the pack was truncated; re-run pack)",
            )

    def _skip(self, nbytes: int) -> memoryview:
        """``nbytes`` of scratch the cut part of a row is read into (and dropped)."""
        if self._sink.nbytes < nbytes:
            self._sink = memoryview(bytearray(nbytes))
        return self._sink[:nbytes]


def open_pack_reader(
    manifest: Manifest, mode: str, mel_dtype: str, fault_dir: Path | None = None, mapped: bool = True
) -> PackReader | None:
    """The pack reader ``producer.pack`` asks for, or None (read the ``.npy`` files); says which in the log.

    ``mode`` "off": None. "auto": the cache's pack of ``mel_dtype`` when there is one and it serves this
    manifest; a missing pack is an INFO line, an unusable one a WARNING naming the reason. The pack is
    mapped (``mapped``) unless the mapping fails or, given ``fault_dir`` (a producer's private runtime
    directory), a producer died of a bus error reading this same pack before or this process's fault
    record cannot be written: then ``preadv``, with a WARNING saying why. "preadv": as "auto", never mapped.
    """
    if mode == "off":
        return None
    path = pack_path(manifest.cache_dir, mel_dtype)
    if not os.path.lexists(path):
        log.info(
            "no packed cache at %s: reading the .npy files (melfeed pack --cache-dir %s makes one)",
            path,
            manifest.cache_dir,
        )
        return None
    try:
        pack = open_pack(manifest, mel_dtype, path)
    except PackUnusable as err:
        log.warning("packed cache %s not used: %s; reading the .npy files", path, err)
        return None
    mapping, record = _map(pack, fault_dir) if mapped and mode != "preadv" else (None, None)
    reader = PackReader(manifest, pack, mapping, record)
    log.info("reading the packed cache %s (%s; %d rows listed bad)", path, reader.mode, len(pack.header.bad))
    return reader


def _map(pack: PackFile, fault_dir: Path | None) -> tuple[MappedPack | None, FaultRecord | None]:
    """The pack's mapping and this process's fault record (``fault_dir`` given), or (None, None): ``preadv``."""
    identity = pack_identity(pack.fd)
    if fault_dir is not None:
        earlier = earlier_bus_error(fault_dir, identity)
        if earlier is not None:
            log.warning(
                "a producer died of a bus error reading the mapped pack %s (its report: %s): reading it "
                "with preadv; a bad disk block is then one row's read error",
                pack.path,
                earlier,
            )
            return None, None
    try:
        record = FaultRecord(fault_dir, identity, pack.path) if fault_dir is not None else None
    except OSError as err:
        log.warning(
            "cannot write the fault record in %s (%s): reading the pack %s with preadv",
            fault_dir,
            err.strerror,
            pack.path,
        )
        return None, None
    try:
        mapping = MappedPack(pack.fd, os.fstat(pack.fd).st_size)
        mapping.populate_in_background()
        return mapping, record
    except OSError as err:
        if record is not None:
            record.close()
        log.warning("cannot map the pack %s (%s): reading it with preadv", pack.path, err.strerror)
        return None, None
