"""One planned batch read from the cache files with plain numpy: the reference assembly of a batch.

Role: what a batch of a bucket holds, built from its samples' files by the schema's padding rule
(``melfeed.shared.wire.schema.pad_row``: mel and tokens are padded as a frame and a token array are): row
``r`` holds sample ``sample_ids[r]`` cut to the bucket and zero padded, ``mel_len`` / ``tok_len`` / a
sequence's ``<name>_len`` its kept lengths, rows past the samples are zeros. The producer builds the same
bytes its fast way (one ``preadv`` per file, ``producer/batcher.py``); this slow, simple path is for the few
batches the consumer reads itself (its warm-up batches, consumer/train/warm_batches.py) and is the oracle
tests hold the producers to.
Invariants: ``arrays`` are filled in place (a slot's views, ``shared/wire/layout.py``), nothing else is written;
a file that cannot be read leaves its row empty (all zeros, lengths 0), as a producer quarantines it, and is
named in the result. A float16 wire (``transport.mel_dtype``) gets the mel rounded to nearest, as
``np.copyto`` does (the producer's ``HalfCaster`` is bit-identical to it).
Shutdown: nothing to release; every file is closed before returning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.shared.cache.filekind import open_regular
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.schema import ExtraSpec, pad_row

__all__ = ["read_batch"]


def read_batch(manifest: Manifest, sample_ids: Sequence[int], arrays: Mapping[str, npt.NDArray[Any]]) -> list[str]:
    """Fill ``arrays`` (one batch of a bucket: ``Bucket.shapes()`` keys, zero-filled) with ``sample_ids``' rows.

    Args:
        manifest: the cache's manifest (its files and extras).
        sample_ids: manifest indices, at most the batch's rows; the remaining rows stay as they are (zeros).
        arrays: the batch's arrays, wire order (``batch_layout``), already zero.

    Returns:
        ``sample ID: PATH: REASON`` of each sample that could not be read (its row left empty).
    """
    problems = []
    for row, sid in enumerate(sample_ids):
        try:
            _read_row(manifest, sid, arrays, row)
        except (OSError, ValueError) as err:  # missing, truncated or not the declared array: as quarantine
            for array in arrays.values():
                array[row] = 0
            problems.append(f"sample {sid}: {err}")
    return problems


def _read_row(manifest: Manifest, sid: int, arrays: Mapping[str, npt.NDArray[Any]], row: int) -> None:
    mel = _load(manifest.mel_path(sid))
    mel_spec = ExtraSpec("mel", "frame", str(mel.dtype), (manifest.n_mels,))  # the row's dtype may be float16
    arrays["mel_len"][row] = pad_row(mel_spec, mel, arrays["mel"][row])
    tokens = _load(manifest.tokens_path(sid))
    arrays["tok_len"][row] = pad_row(ExtraSpec("tokens", "token", str(tokens.dtype)), tokens, arrays["tokens"][row])
    for spec in manifest.schema.extras:
        batch = arrays[spec.name]
        dst = batch[row : row + 1].reshape(batch.shape[1:])  # a view, also of an utterance scalar's row
        kept = pad_row(spec, _load(manifest.extra_path(spec.name, sid)), dst)
        if spec.length_key is not None:
            arrays[spec.length_key][row] = kept


def _load(path: Path) -> npt.NDArray[Any]:
    """The array of one ``.npy`` file; only a regular file is opened (a FIFO would block, ``open_regular``)."""
    try:
        fd, _ = open_regular(path)
        with os.fdopen(fd, "rb") as file:
            return np.load(file, allow_pickle=False)  # type: ignore[no-any-return]
    except CacheError as err:
        raise ValueError(str(err)) from err
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err
