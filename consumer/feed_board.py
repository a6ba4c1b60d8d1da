"""Keras ``fit``'s feed figures in TensorBoard, beside ``keras.callbacks.TensorBoard(log_dir)``.

```python
with melfeed.Consumer(cfg, producers=2) as feed, melfeed.FeedBoard(feed, "logs") as board:
    model.fit(feed.as_dataset(), epochs=1, callbacks=[keras.callbacks.TensorBoard("logs"),   # pip install tensorboard
                                                      board.callback()])                     # no extra package
```
Role: the figures of melfeed's metrics snapshot (consumer/observe/board.py names the tags: ``feed/``, ``gpu/``,
``producer/``) written into ``log_dir/feed``: a sibling of Keras's ``log_dir/train`` and ``log_dir/validation``, so
``tensorboard --logdir log_dir`` lists the three runs together. Not into ``train`` itself: TensorBoard polls only
the newest event file of a run directory, so two writers there would leave one of them stale until a reload.
Figures: one ``StepRecord`` per trained batch, taken when ``fit`` begins the next one (the callback has only
``on_train_batch_begin``, which reads no logs: Keras dispatches batch ends unchanged and no host wait is added): the
period between batch begins, the Consumer's wait for that batch (a dataset read-ahead may overlap it with the step:
stall % is an upper bound here), rows and frames from the plan; the first ``consumer.warmup_steps`` batches
(tracing, compiling) are left out. The same window arithmetic as the built-in loop's snapshot
(``consumer.metrics_window_s``), GPUs sampled as there. No feed efficiency (this path measures no resident limit)
and no ``train/`` scalars (Keras's callback writes the losses). The step (x axis) is the global step, the batch id
after the newest recorded batch: the last batch of a ``fit`` is not recorded (no batch begins after it, and ``fit``
may have begun it only to find the data ended).
Writes every ``every_steps`` batches, else every ``consumer.status_interval_s``, and at the end of ``fit``; flushed
at each write. Importing this module imports no Keras (``callback()`` does: ``melfeed`` loads no TensorFlow).
Shutdown: ``on_train_end`` writes, stops the GPU samplers and closes the file; ``close()`` (or leaving the ``with``
block) does the same for a ``fit`` that raised; idempotent.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from melfeed.consumer.observe.board import BoardWriter, board_scalars, check_board_dir
from melfeed.consumer.observe.telemetry import Telemetry
from melfeed.shared.metrics import StepRecord

if TYPE_CHECKING:
    from melfeed.consumer.feed import Consumer
    from melfeed.shared.wire.buckets import Bucket

__all__ = ["FeedBoard", "planned_frames"]

_KEY = ("FeedBoard(log_dir)",)


def planned_frames(sample_ids: Sequence[int], bucket: Bucket, frames: npt.NDArray[np.int64]) -> tuple[int, int, int]:
    """(rows, real frames, padded frames) of a planned batch: each utterance's frames up to the bucket's length
    (an overlong one is cut to it), over the bucket's B x T."""
    real = int(np.minimum(frames[list(sample_ids)], bucket.max_frames).sum()) if sample_ids else 0
    return len(sample_ids), real, bucket.batch_size * bucket.max_frames


class FeedBoard:
    """Writes ``feed``'s figures into ``log_dir/feed`` while ``fit`` trains on ``feed.as_dataset()`` (module doc);
    ``callback()`` is the Keras callback, the other methods are its hooks.

    Args:
        feed: the Consumer whose dataset ``fit`` trains on.
        log_dir: the directory given to ``keras.callbacks.TensorBoard``.
        every_steps: write every N batches; None = every ``consumer.status_interval_s`` seconds.

    Raises:
        ConfigError: ``log_dir/feed`` cannot be created or written (one line). ValueError: ``every_steps`` < 1.
    """

    def __init__(self, feed: Consumer, log_dir: str | os.PathLike[str], *, every_steps: int | None = None) -> None:
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 or None, got {every_steps}")
        self.logdir = Path(log_dir) / "feed"
        check_board_dir(self.logdir, _KEY)
        self._feed, self._every_steps = feed, every_steps
        self._telemetry: Telemetry | None = None
        self._writer: BoardWriter | None = None
        self._first = self._recorded = self._epoch_start = self._begun = 0
        self._last_s = self._wait_seen = self._next_write_s = 0.0
        self._written = 0

    def on_train_begin(self, logs: Any = None) -> None:
        cfg = self._feed._cfg
        quiet = dataclasses.replace(cfg.consumer, metrics_file=None, metrics_port=None)  # for TensorBoard alone
        self._telemetry = Telemetry(
            dataclasses.replace(cfg, consumer=quiet), self._feed._telemetry_source(), time.time(), control_endpoint=None
        )
        self._telemetry.start()
        self._writer = BoardWriter(self.logdir, _KEY)
        applied = self._feed.applied_ids  # the next batch applied is the first this fit trains
        self._first = applied[-1] + 1 if applied else self._feed._desk.next_id
        self._recorded = self._epoch_start = self._begun = 0
        self._written = self._first

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch_start = self._begun  # each batch begun in an epoch that went on was trained

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        trained = self._epoch_start + batch  # batches this fit completed before this one
        self._begun = trained + 1
        if trained == 0:
            self._mark(time.monotonic())  # the first batch's period starts at its begin
        if trained <= self._recorded or self._telemetry is None:
            return
        self._record(trained)
        now = time.monotonic()
        due = (trained % self._every_steps == 0) if self._every_steps else now >= self._next_write_s
        if due:
            self._write()
            self._next_write_s = now + self._feed._cfg.consumer.status_interval_s

    def on_train_end(self, logs: Any = None) -> None:
        self.close()

    def callback(self) -> Any:
        """The ``keras.callbacks.Callback`` for ``fit`` (one per ``FeedBoard``; it calls the hooks above)."""
        return _make_callback(self)

    def __enter__(self) -> FeedBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Write the figures not written yet, stop the GPU samplers, close the file (idempotent)."""
        if self._writer is not None and self._telemetry is not None:
            self._write()
        if self._telemetry is not None:
            self._telemetry.close()
            self._telemetry = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _mark(self, now_s: float) -> None:
        self._last_s, self._wait_seen = time.perf_counter(), self._feed._wait_s_total
        self._next_write_s = now_s + self._feed._cfg.consumer.status_interval_s

    def _record(self, trained: int) -> None:
        """One record per batch completed since the last call; the period and the wait shared among them."""
        assert self._telemetry is not None
        feed, now_s = self._feed, time.perf_counter()
        n = trained - self._recorded
        wait_s = (feed._wait_s_total - self._wait_seen) / n
        period_s = (now_s - self._last_s) / n
        for k in range(self._recorded, trained):
            if k >= feed._cfg.consumer.warmup_steps:
                planned = feed.plan.batch(self._first + k)
                rows, real, padded = planned_frames(
                    planned.sample_ids, feed._bucket_set.buckets[planned.bucket], feed.manifest.frames
                )
                self._telemetry.add(
                    StepRecord(
                        now_s, wait_s, max(0.0, period_s - wait_s), rows, real, padded, feed._receiver.queue_depth()
                    )
                )
        self._recorded, self._last_s, self._wait_seen = trained, now_s, feed._wait_s_total

    def _write(self) -> None:
        step = self._first + self._recorded
        if self._writer is None or self._telemetry is None or step <= self._written:
            return
        self._writer.write(step, board_scalars(self._telemetry.snapshot(self._recorded, None, 0), {}))
        self._written = step


def _make_callback(board: FeedBoard) -> Any:
    import keras

    class _Board(keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
        """Only the hooks that read no logs: overriding a batch end would make Keras read every step's logs."""

        def on_train_begin(self, logs: Any = None) -> None:
            board.on_train_begin(logs)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            board.on_epoch_begin(epoch, logs)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            board.on_train_batch_begin(batch, logs)

        def on_train_end(self, logs: Any = None) -> None:
            board.on_train_end(logs)

    return _Board()
