"""The pre-flight: every bucket shape runs once at its rows before READY, and one that does not fit is one line.

Role: the warm-up (``CompiledStep.warm_up``, ``PackedSteps.warm_up``) runs each bucket's program on a real batch;
a TensorFlow ``ResourceExhaustedError`` there is wrapped in ``BucketOutOfMemory`` naming the bucket, and
``out_of_memory_is_config`` turns it into one ``ConfigError`` line (exit 78): the bucket, its shape, the rows
tried and the largest rows known to fit (from ``buckets.batch_size: auto``'s search, when it ran).
Invariant: only an out-of-memory error is rewritten; every other error goes on unchanged.
Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import BucketSet

__all__ = ["BucketOutOfMemory", "is_out_of_memory", "oom_line", "out_of_memory_is_config"]


class BucketOutOfMemory(Exception):
    """A bucket's program ran out of device memory (its cause: TensorFlow's ``ResourceExhaustedError``)."""

    def __init__(self, bucket: int) -> None:
        super().__init__(f"bucket {bucket} ran out of device memory")
        self.bucket = bucket


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` or anything it was raised from is TensorFlow's ``ResourceExhaustedError``."""
    import tensorflow as tf

    return any(isinstance(e, (tf.errors.ResourceExhaustedError, BucketOutOfMemory)) for e in _chain(err))


@contextmanager
def out_of_memory_is_config(bucket_set: BucketSet, largest_fitting: Sequence[int] | None = None) -> Iterator[None]:
    """Turn an out-of-memory error of the block into one ``ConfigError`` line naming the bucket (``largest_fitting``:
    per bucket the most rows the search saw fit, or None when unknown)."""
    try:
        yield
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        found = next((e for e in _chain(err) if isinstance(e, BucketOutOfMemory)), None)
        raise oom_line(bucket_set, found.bucket if found is not None else None, largest_fitting) from err


def oom_line(bucket_set: BucketSet, bucket: int | None, largest_fitting: Sequence[int] | None) -> ConfigError:
    """The one line for a bucket that does not fit (``bucket`` None: TensorFlow did not say which)."""
    key = ("buckets", "batch_size")
    if bucket is None:
        rows = [b.batch_size for b in bucket_set.buckets]
        return ConfigError(
            f"a bucket does not fit the device's memory at warm-up (rows by bucket {rows}); lower "
            "the rows, or set buckets.batch_size: auto",
            path=key,
        )
    b = bucket_set.buckets[bucket]
    known = (
        f"; the largest that fits is {largest_fitting[bucket]} rows"
        if largest_fitting is not None
        else "; the largest that fits is not known: lower the rows, or let buckets.batch_size: auto measure them"
    )
    return ConfigError(
        f"bucket {bucket} (T={b.max_frames} frames, L={b.max_tokens} tokens) does not fit the device's "
        f"memory at {b.batch_size} rows (out of memory at warm-up){known}",
        path=key,
        got=b.batch_size,
    )
