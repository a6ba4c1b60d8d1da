"""What users would run instead of melfeed: tf.data pipelines over the same cache, for ``bench``.

Role: build, from the consumer's own plan, the batches each baseline delivers: the same ``.npy``
files, padded to the same bucket shapes (melfeed's ``BucketSet``), same batch size and dtypes
(mel float32 [B, T, M], mel_len int32 [B], tokens int32 [B, L], tok_len int32 [B]), plus the
bucket index. Only full batches of the plan are used (a bucket's last, partial batch is left out),
so a window of B consecutive samples is exactly one plan batch.
    * ``tuned``: read_file + decode_raw per file in a parallel map (AUTOTUNE or a fixed
      ``num_parallel_calls``), group_by_window + padded_batch to the bucket shape, prefetch.
      Copies from page cache to the step: read_file (1), decode_raw (2), padded_batch (3);
      prefetch and the hand-off to the step pass tensors by reference.
    * ``naive``: ``tf.numpy_function(np.load)`` per file in a sequential map, same batching, no
      prefetch. Copies: np.load (1), numpy -> tensor (2), padded_batch (3).
    * ``service``: the tuned pipeline run by a tf.data service worker (``ServiceProcesses``: a
      dispatcher and worker(s), each ``python -c`` in its own process) and read by the trainer with
      ``distribute(processing_mode="parallel_epochs", compression=None)``. Copies: the tuned 3,
      plus serialising the element, the gRPC send, the receive and the deserialisation (7).
TensorFlow is imported inside the functions that build datasets, so the service servers can be
started (and import it themselves) before the trainer pays for its own import.
Invariants: datasets repeat forever (the caller takes what it measures); element order is the
plan's full batches in plan order. Shutdown: ``ServiceProcesses.close()`` runs the stop ladder
(``melfeed.shared.service.stop_ladder``: SIGTERM, bounded wait, SIGKILL) on its servers and reaps them;
idempotent.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from melfeed.consumer.flow.plan import EpochPlan
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.service.children import python_argv, spawn
from melfeed.shared.service.stop_ladder import SERVER_LADDER, stop_all
from melfeed.shared.wire.buckets import BucketSet

if TYPE_CHECKING:  # annotations only: the import itself happens inside the builders
    import tensorflow as tf

__all__ = ["COPIES", "PlanFiles", "plan_files", "tuned_dataset", "naive_dataset", "ServiceProcesses"]

log = logging.getLogger(__name__)

COPIES = {"tfdata": 3, "naive": 3, "service": 7}  # counted from the ops, see the module docstring


@dataclass(frozen=True, slots=True)
class PlanFiles:
    """Per-sample columns of the plan's full batches, in plan order."""

    mel_paths: list[str]
    mel_offsets: list[int]  # data offset in 4-byte elements (header bytes // 4)
    tok_paths: list[str]
    tok_offsets: list[int]
    buckets: list[int]


def plan_files(manifest: Manifest, plan: EpochPlan, buckets: BucketSet, min_batches: int) -> PlanFiles:
    """The full batches of epochs 0, 1, ... until at least ``min_batches`` (one epoch at least)."""
    cols: PlanFiles = PlanFiles([], [], [], [], [])
    batches, epoch = 0, 0
    while batches < max(1, min_batches):
        full = [b for b in plan.epoch(epoch) if len(b.sample_ids) == buckets.buckets[b.bucket].batch_size]
        if not full:
            raise ValueError("the plan has no full batch; use a larger cache or a smaller batch size")
        for b in full:
            for i in b.sample_ids:
                u = manifest.utterances[i]
                if u.mel_dtype != "float32" or u.mel_offset % 4 or u.tok_offset % 4:
                    raise ValueError(
                        f"{manifest.mel_path(i)}: the tf.data baselines need float32 mels and 4-byte aligned headers"
                    )
                cols.mel_paths.append(str(manifest.mel_path(i)))
                cols.mel_offsets.append(u.mel_offset // 4)
                cols.tok_paths.append(str(manifest.tokens_path(i)))
                cols.tok_offsets.append(u.tok_offset // 4)
                cols.buckets.append(b.bucket)
        batches += len(full)
        epoch += 1
    return cols


def _tables(buckets: BucketSet) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    import tensorflow as tf

    bs = buckets.buckets
    return (
        tf.constant([b.max_frames for b in bs], tf.int64),
        tf.constant([b.max_tokens for b in bs], tf.int64),
        tf.constant([b.batch_size for b in bs], tf.int64),
    )


def _batched(ds: tf.data.Dataset, buckets: BucketSet) -> tf.data.Dataset:
    """Samples -> one padded batch per B consecutive samples of one bucket, padded to its shape."""
    import tensorflow as tf

    frames, tokens, rows = _tables(buckets)
    n_mels = buckets.buckets[0].n_mels

    def reduce(key: tf.Tensor, window: tf.data.Dataset) -> tf.data.Dataset:
        shapes = {
            "mel": tf.stack([frames[key], n_mels]),
            "mel_len": [],
            "tokens": tf.reshape(tokens[key], [1]),
            "tok_len": [],
            "bucket": [],
        }
        return window.padded_batch(rows[key], padded_shapes=shapes, drop_remainder=True)

    return ds.group_by_window(
        key_func=lambda e: tf.cast(e["bucket"], tf.int64), reduce_func=reduce, window_size_func=lambda key: rows[key]
    )


def _element(mel: tf.Tensor, tok: tf.Tensor, bucket: tf.Tensor, buckets: BucketSet) -> dict[str, tf.Tensor]:
    import tensorflow as tf

    frames, tokens, _ = _tables(buckets)
    mel = tf.reshape(mel, [-1, buckets.buckets[0].n_mels])[: frames[bucket]]  # overlong: truncate as melfeed
    tok = tok[: tokens[bucket]]
    return {
        "mel": mel,
        "mel_len": tf.shape(mel, tf.int32)[0],
        "tokens": tok,
        "tok_len": tf.shape(tok, tf.int32)[0],
        "bucket": tf.cast(bucket, tf.int32),
    }


def tuned_dataset(files: PlanFiles, buckets: BucketSet, parallel_calls: int | None) -> tf.data.Dataset:
    """The tuned pipeline; ``parallel_calls`` None = ``tf.data.AUTOTUNE``."""
    import tensorflow as tf

    def read(
        mel_path: tf.Tensor, mel_off: tf.Tensor, tok_path: tf.Tensor, tok_off: tf.Tensor, bucket: tf.Tensor
    ) -> dict[str, tf.Tensor]:
        mel = tf.io.decode_raw(tf.io.read_file(mel_path), tf.float32)[mel_off:]
        tok = tf.io.decode_raw(tf.io.read_file(tok_path), tf.int32)[tok_off:]
        return _element(mel, tok, bucket, buckets)

    ds = tf.data.Dataset.from_tensor_slices(
        (files.mel_paths, files.mel_offsets, files.tok_paths, files.tok_offsets, files.buckets)
    ).repeat()
    ds = ds.map(read, num_parallel_calls=parallel_calls or tf.data.AUTOTUNE, deterministic=True)
    return _batched(ds, buckets).prefetch(tf.data.AUTOTUNE)


def naive_dataset(files: PlanFiles, buckets: BucketSet) -> tf.data.Dataset:
    """The loader users write first: np.load inside tf.numpy_function, sequential, no prefetch."""
    import tensorflow as tf

    def load(mel_path: bytes, tok_path: bytes) -> tuple[np.ndarray, np.ndarray]:
        return np.load(mel_path.decode()), np.load(tok_path.decode())

    def read(mel_path: tf.Tensor, tok_path: tf.Tensor, bucket: tf.Tensor) -> dict[str, tf.Tensor]:
        mel, tok = tf.numpy_function(load, [mel_path, tok_path], [tf.float32, tf.int32])
        return _element(mel, tok, bucket, buckets)

    ds = tf.data.Dataset.from_tensor_slices((files.mel_paths, files.tok_paths, files.buckets)).repeat()
    return _batched(ds.map(read), buckets)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Each server first asks for SIGTERM when the trial that started it dies (argv[2]: the trial's pid), even by
# SIGKILL: a server never outlives its trial (melfeed.shared.service.children.CommandChildren).
_ORPHAN_GUARD = (
    "import signal, sys; from melfeed.shared.service.lifecycle import die_with_parent; "
    "die_with_parent(signal.SIGTERM, parent_pid=int(sys.argv[2])); "
)
_DISPATCHER = (
    _ORPHAN_GUARD + "import tensorflow as tf; s = tf.data.experimental.service; "
    "s.DispatchServer(s.DispatcherConfig(port=int(sys.argv[1]))).join()"
)
_WORKER = (
    _ORPHAN_GUARD + "import tensorflow as tf; s = tf.data.experimental.service; "
    "s.WorkerServer(s.WorkerConfig(dispatcher_address='localhost:' + sys.argv[1], port=0, "
    "heartbeat_interval_ms=200)).join()"
)  # default 30 s: a new job would wait for the next heartbeat


class ServiceProcesses:
    """A tf.data service dispatcher and ``workers`` workers on localhost, children of this process."""

    def __init__(self, workers: int, env: dict[str, str]) -> None:
        self.port = _free_port()
        self._procs: list[subprocess.Popen[bytes]] = []
        for code in [_DISPATCHER] + [_WORKER] * workers:
            self._procs.append(
                spawn(python_argv("-c", code, str(self.port), str(os.getpid())), env=env, stdout=subprocess.DEVNULL)
            )
        self._closed = False

    @property
    def address(self) -> str:
        return f"grpc://localhost:{self.port}"

    def distribute(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        import tensorflow as tf

        service: Any = tf.data.experimental.service  # untyped in TensorFlow's stubs
        return ds.apply(
            service.distribute(processing_mode="parallel_epochs", service=self.address, compression=None)
        ).prefetch(2)

    def close(self) -> None:
        """The stop ladder on every server at once (SIGTERM, wait, SIGKILL, wait); reaps all. Idempotent."""
        if self._closed:
            return
        self._closed = True
        stop_all(self._procs, "tf.data service servers", SERVER_LADDER)
