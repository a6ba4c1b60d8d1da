"""TensorBoard scalars of a run: the named outputs' interval means and the metrics snapshot's figures.

Role: ``board_scalars`` (pure) names what a write holds: ``train/<name>`` for each named output (the interval's
mean), and from a metrics snapshot the tag of every field whose schema names one (observe/snapshot.py
``FieldSpec.board``: ``feed/...`` figures, per sampled GPU ``gpu/<role>-<index>/...``, per producer
``producer/<id>/batches_per_s``); a figure the snapshot does not know yet (null) is left out.
``BoardWriter`` writes them with TensorFlow's own file writer (``tf.summary.create_file_writer``) and the scalar
plugin's metadata, one float32 rank-0 tensor per tag, which is what TensorBoard's Scalars dashboard reads, with no
``tensorboard`` package: TensorFlow 2.21 no longer installs it, and ``tf.summary.scalar`` raises
``TBNotInstalledError`` without it. One write is one ``Summary`` proto holding every tag, written by one op
(``tf.summary.experimental.write_raw_pb``, the proto ``tf.summary.write`` would write per tag): the loop has just
drained the device when it writes, so each op of the write is device idle time (15 tags took 41 ms as 15 ops, 5 ms
as one, on the loaded 2-core development machine). On the CPU, flushed at each write. ``Board`` is the built-in
loop's side: its own means of the same interval reads (``consumer.tensorboard_every_steps`` decides when a write is
due) and the global step.
Invariants: a write reads no device tensor (host floats only; the loop writes where it read the device
anyway); the step (x axis) is the global step: the run's first batch id plus the steps the reads covered, so a
resumed run continues its curves; no step is written twice (a later write at the same step is dropped).
Shutdown: ``close()`` flushes and closes the file writer; idempotent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from melfeed.consumer.observe.snapshot import Snapshot, schema_fields
from melfeed.consumer.train.meter import IntervalFigures, OutputMeans
from melfeed.shared.errors import ConfigError
from melfeed.shared.filetrust import make_dirs

__all__ = ["Board", "BoardWriter", "board_dir", "board_scalars", "check_board_dir", "scalar_metadata", "summary_proto"]

log = logging.getLogger(__name__)

_DIR_MODE = 0o750  # like the state directory: the service user and group (a TensorBoard in the group reads it)
_KEY = ("consumer", "tensorboard_dir")


def board_dir(root: str | os.PathLike[str], rank: int = 0, world: int = 1) -> Path:
    """Where a consumer writes: ``root`` alone, ``root/rank-<rank>`` in a multi-worker job (one run per rank)."""
    return Path(root) / f"rank-{rank}" if world > 1 else Path(root)


def check_board_dir(path: Path, key: tuple[str, ...] = _KEY) -> None:
    """Create ``path`` (and its parents, 0750) and check that files can be created in it, before any work.

    Raises:
        ConfigError: naming ``key``: a component cannot be created or is a file, or the directory is not writable.
    """
    try:
        make_dirs(path, _DIR_MODE)
    except OSError as err:
        raise ConfigError(f"cannot create {path}: {err.strerror or err}", path=key) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"directory {path} is not writable", path=key)


def scalar_metadata() -> Any:
    """The ``SummaryMetadata`` TensorBoard's Scalars dashboard reads: plugin "scalars", content of version 0 (the
    empty bytes ``tensorboard.plugins.scalar.metadata`` writes). TensorFlow ships the proto."""
    from tensorflow.core.framework import summary_pb2

    return summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


def summary_proto(scalars: Mapping[str, float]) -> bytes:
    """One serialized ``Summary``: per tag a float32 rank-0 tensor with ``scalar_metadata()``."""
    from tensorflow.core.framework import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

    metadata, scalar = scalar_metadata(), tensor_shape_pb2.TensorShapeProto()
    serialized: bytes = summary_pb2.Summary(
        value=[
            summary_pb2.Summary.Value(
                tag=tag,
                metadata=metadata,
                tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=scalar, float_val=[value]),
            )
            for tag, value in scalars.items()
        ]
    ).SerializeToString()
    return serialized


def board_scalars(
    snapshot: Mapping[str, Any] | None, means: Mapping[str, float], schema: type = Snapshot
) -> dict[str, float]:
    """Tag -> value for one write (module doc): ``means`` as given (NaN stays NaN: it is news), the snapshot's
    figures when known, tagged as ``schema`` says."""
    out = {f"train/{name}": float(value) for name, value in means.items()}
    if snapshot is None:
        return out
    for f in schema_fields(schema):
        if f.row is None:
            if f.spec.board is not None and snapshot[f.name] is not None:
                out[f.spec.board] = float(snapshot[f.name])
            continue
        tagged = [r for r in schema_fields(f.row) if r.spec.board is not None]
        for row in snapshot[f.name]:
            out.update(
                {
                    r.spec.board.format(**row): float(row[r.name])
                    for r in tagged
                    if r.spec.board is not None and row[r.name] is not None
                }
            )
    return out


class BoardWriter:
    """One TensorBoard run directory: ``write(step, scalars)`` appends one event per tag and flushes."""

    def __init__(self, logdir: Path, key: tuple[str, ...] = _KEY) -> None:
        """Raises: ConfigError naming ``key`` when the directory cannot be created or written."""
        import tensorflow as tf

        check_board_dir(logdir, key)
        self.logdir = logdir
        self._tf = tf
        try:
            with tf.device("/CPU:0"):
                self._writer: Any = tf.summary.create_file_writer(str(logdir))
        except (tf.errors.OpError, OSError) as err:
            raise ConfigError(
                f"cannot write event files in {logdir}: {getattr(err, 'message', err)}", path=key
            ) from None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """One float32 scalar per tag at ``step`` (one op), then a flush (TensorBoard sees it at once)."""
        if self._writer is None:
            raise RuntimeError("BoardWriter is closed")
        if not scalars:
            return
        tf = self._tf
        with tf.device("/CPU:0"), self._writer.as_default():  # a host proto, the CPU writer: no device op
            tf.summary.experimental.write_raw_pb(summary_proto(scalars), step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class Board:
    """The built-in loop's TensorBoard (``consumer.tensorboard_dir``), a context manager that closes its writer.

    Args:
        logdir: the run directory (``board_dir``; checked before the run starts, ``check_board_dir``), opened at
            the first write (creating a file writer initialises TensorFlow's devices: after ``configure_memory``).
        every_steps: ``consumer.tensorboard_every_steps``: None = the loop writes at each status line; N = every
            N steps (``is_due``), reading the accumulated outputs there unless that step was read already.
        first_batch: the global step before the first step of this process (the resume position).
    """

    def __init__(self, logdir: Path, every_steps: int | None, first_batch: int = 0) -> None:
        self.logdir = logdir
        self.every_steps = every_steps
        self._writer: BoardWriter | None = None  # opened at the first write: TensorFlow is set up by then
        self._means = OutputMeans()
        self._steps_read = 0  # steps the reads covered (a GPU's read includes any step dispatched)
        self._first = first_batch
        self._written = first_batch  # global step of the newest write

    def add_read(self, read: IntervalFigures) -> None:
        """One host read of the accumulated outputs (the same reads the status line averages)."""
        self._means.add_sums(read.sums, read.steps)
        self._steps_read += read.steps

    def is_due(self, steps_done: int) -> bool:
        """Every ``every_steps`` steps of this process (never when the status line sets the pace)."""
        return self.every_steps is not None and steps_done % self.every_steps == 0

    def needs_read(self, steps_done: int) -> bool:
        """True when no read has covered step ``steps_done`` yet (a checkpoint's read at that step serves)."""
        return self._steps_read < steps_done

    def write(self, snapshot: Mapping[str, Any] | None) -> None:
        """Write the means since the previous write and ``snapshot``'s figures at the global step the reads reached;
        nothing when no step was read since the previous write."""
        step = self._first + self._steps_read
        if step <= self._written:
            return
        if self._writer is None:
            self._writer = BoardWriter(self.logdir)
        self._writer.write(step, board_scalars(snapshot, self._means.take()))
        self._written = step

    def close(self) -> None:
        """Close the event file, if one was opened (idempotent)."""
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> Board:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
