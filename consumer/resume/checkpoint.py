"""Checkpoints: model + optimizer variables and the data cursor, committed together atomically.

Layout in the state directory::

    ckpt-000000000400/           one complete checkpoint; 400 = next batch id to apply
        vars.index, vars.data-*  tf.train.Checkpoint.write() of the step's variables
        cursor.json              next_batch, audit_records, seed, fingerprint, ...
    ckpt-000000000400.tmp-PID/   a checkpoint being written (removed at the next start)

Commit protocol: write everything into the ``.tmp-PID`` directory, fsync each file and the
directory, ``rename`` it to its final name, fsync the state directory. A crash at any point leaves
either the previous checkpoint or the new one, never a half-written one under a final name. Files
are 0640 and the directory 0750 or stricter whatever the umask (``filemode``) before the rename. The
newest readable checkpoint wins; an unreadable one is skipped with a warning (the one before it is
kept, ``keep`` >= 1 complete checkpoints stay on disk).
TensorFlow is imported only by ``save`` and ``restore``; the audit command never loads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from melfeed.consumer.resume.filemode import STATE_DIR_MODE, restrict, write_private
from melfeed.shared.errors import StateError

__all__ = ["Cursor", "CheckpointStore", "latest_checkpoint", "latest_cursor", "list_checkpoints", "read_cursor"]

log = logging.getLogger(__name__)

_PREFIX = "ckpt-"
_TMP = ".tmp-"
_CURSOR = "cursor.json"
_VARS = "vars"
_FORMAT = 1


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the data stream stands in the lineage of this checkpoint."""

    next_batch: int  # first batch id not yet applied to the saved variables
    audit_records: int  # audit log records covered (== next_batch for a lineage from 0)
    seed: int  # data order seed of the plan
    fingerprint: str  # manifest fingerprint of the plan
    consumer_epoch: int  # the consumer start that wrote it
    written_unix_s: float
    format: int = _FORMAT


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    if not root.is_dir():
        return []
    out = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and _TMP not in p.name and p.name[len(_PREFIX) :].isdigit()
    ]
    return sorted(out, key=lambda p: int(p.name[len(_PREFIX) :]))


def read_cursor(path: Path) -> Cursor:
    """The cursor of checkpoint directory ``path`` (OSError, ValueError, TypeError when unreadable)."""
    doc = json.loads((path / _CURSOR).read_text(encoding="utf-8"))
    if doc.get("format") != _FORMAT:
        raise ValueError(f"cursor format {doc.get('format')!r}, this melfeed reads {_FORMAT}")
    return Cursor(**doc)


def latest_checkpoint(root: Path) -> tuple[Path, Cursor] | None:
    """The newest checkpoint whose cursor and variable index are readable, or ``None``."""
    for path in reversed(list_checkpoints(root)):
        try:
            cursor = read_cursor(path)
            if not (path / f"{_VARS}.index").is_file():
                raise ValueError(f"{_VARS}.index is missing")
            return path, cursor
        except (OSError, ValueError, TypeError) as err:
            log.warning("skipping unreadable checkpoint %s: %s", path, err)
    return None


def latest_cursor(root: Path) -> Cursor | None:
    found = latest_checkpoint(root)
    return found[1] if found else None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """Writes and reads the checkpoints of one state directory (the ``RunState`` owns it)."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root = root
        self.keep = max(1, keep)
        for stale in root.glob(f"{_PREFIX}*{_TMP}*"):
            log.info("removing incomplete checkpoint %s", stale)
            shutil.rmtree(stale, ignore_errors=True)

    def save(self, cursor: Cursor, items: dict[str, object]) -> Path:
        """Commit ``items`` (trackables for ``tf.train.Checkpoint``) with ``cursor``.

        Raises:
            StateError: (not fatal) the write failed; the previous checkpoint is intact.
        """
        import tensorflow as tf

        final = self.path_of(cursor.next_batch)
        if final.exists():
            return final  # same position: identical lineage state
        tmp = self.root / f"{final.name}{_TMP}{os.getpid()}"
        t0 = time.perf_counter()
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=STATE_DIR_MODE)  # 0750 or stricter whatever the umask
            tf.train.Checkpoint(**items).write(str(tmp / _VARS))
            write_private(tmp / _CURSOR, (json.dumps(asdict(cursor), indent=1) + "\n").encode("utf-8"))
            for f in tmp.iterdir():
                restrict(f)  # TensorFlow creates its files 0666 & ~umask
                _fsync_path(f)
            _fsync_path(tmp)
            os.rename(tmp, final)
            _fsync_path(self.root)
        except (OSError, tf.errors.OpError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            first_line = (str(err).splitlines() or [type(err).__name__])[0]
            raise StateError(
                tmp, f"checkpoint write failed ({first_line}); the previous checkpoint is intact", fatal=False
            ) from err
        self._prune()
        log.info("checkpoint %s (next batch %d) in %.2f s", final.name, cursor.next_batch, time.perf_counter() - t0)
        return final

    def path_of(self, step: int) -> Path:
        """Where the checkpoint whose next batch is ``step`` lives (it may not exist)."""
        return self.root / f"{_PREFIX}{step:012d}"

    def remove(self, path: Path) -> None:
        """Delete checkpoint ``path`` (one of this store's)."""
        shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        for old in list_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def restore(path: Path, items: dict[str, object]) -> None:
        """Load the variables of checkpoint ``path`` into ``items``; every saved value must match.

        Raises:
            StateError: the checkpoint does not fit this model (another step factory or sizes).
        """
        import tensorflow as tf

        try:
            status = tf.train.Checkpoint(**items).read(str(path / _VARS))
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as err:
            raise StateError(
                path,
                f"does not fit this model ({str(err).splitlines()[0]}); "
                "was it written with another model.step or sizes?",
            ) from err
