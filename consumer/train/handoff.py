"""TensorFlow's hand-off for the ``Stager`` (consumer/staging.py): slot -> tensors, the compiled step, its scalars.

Role: ``TfHandOff`` supplies the four operations the framework-neutral stager needs for the built-in
loop. ``put`` wraps the slot's arrays with DLPack (``to_tensors``: zero copy, 64-byte aligned) and,
when the step runs on a GPU, starts the host->device copy there (``tf.identity`` under ``tf.device``),
while the previous step is still running on the device. ``step`` dispatches ``CompiledStep.run`` (the
one call the replica path also goes through); ``wait`` reads the step's named scalars to the host.
Invariants:
    * The slot is never freed before the step that reads it completed (``Staged.copied`` is None):
      on the CPU the tensors alias the slot; on a GPU TensorFlow offers no event for the end of the
      staging copy, so the slot is held until that step's outputs were read, which is safe whatever
      the copy does (the ring keeps ``consumer.ring_slots - stage_depth`` slots for producers).
    * A step that fails while training (a TensorFlow op error: an assertion, an id outside an embedding)
      raises ``StepError``, one line naming ``model.step``, the op and the user's line (exit 1).
    * On the CPU (no GPU visible) eager execution is synchronous: a step has completed when ``run``
      returns (``is_done`` True), so its slot is freed at once and the loop holds one slot.
    * ``on_step(n)`` runs right after the n-th step was dispatched, its slot still held (``bench``
      models device time there).
``to_tensors`` (DLPack where safe, a copy otherwise) and ``aligned_empty`` (aligned arrays for tests and
probes) live here too: they are the slot -> tensor half of the hand-off.
Shutdown: nothing to release.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from melfeed.consumer.handout import Batch
from melfeed.consumer.staging import Staged
from melfeed.consumer.train.jit import describe_tf_error
from melfeed.consumer.train.outputs import read_outputs
from melfeed.consumer.train.step import CompiledStep
from melfeed.shared.errors import StepError
from melfeed.shared.wire.layout import ALIGN_BYTES

__all__ = ["StepResult", "TfHandOff", "aligned_empty", "model_device", "to_tensors"]

log = logging.getLogger(__name__)

_Tensors = dict[str, tf.Tensor]


@dataclass(frozen=True, slots=True)
class StepResult:
    """A completed step: its outputs as TensorFlow returned them, and the same named scalars as floats."""

    raw: _Tensors
    outputs: dict[str, float]


def model_device() -> str | None:
    """The device the step runs on when it is not the CPU: the first GPU TensorFlow sees, else None."""
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else None


class TfHandOff:
    """``HandOff`` of ``CompiledStep``: DLPack in, a copy to ``device`` if given, named scalars out.

    Args:
        compiled: the step, compiled per bucket (``warm_up`` done).
        device: a GPU to stage batches on (``model_device()``); None = the CPU, synchronous.
        on_step: called with the number of steps dispatched so far, right after each dispatch.
    """

    def __init__(self, compiled: CompiledStep, device: str | None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self._compiled = compiled
        self._device = device
        self._on_step = on_step
        self.dispatched = 0

    def put(self, batch: Batch) -> Staged[_Tensors]:
        tensors, copies = to_tensors(batch.arrays)
        if self._device is not None:
            with tf.device(self._device):
                tensors = {name: tf.identity(t) for name, t in tensors.items()}
        return Staged(tensors, copied=None, host_copies=copies)

    def step(self, batch: Batch, value: _Tensors) -> _Tensors:
        try:
            raw = self._compiled.run(batch.bucket, value, rows=batch.rows)
        except tf.errors.OpError as err:     # on the CPU the step runs here: its failure, in one line
            raise self._failed(err, f" on batch {batch.batch_id}") from err
        self.dispatched += 1
        if self._on_step is not None:
            self._on_step(self.dispatched)
        return raw

    def is_done(self, outputs: _Tensors) -> bool:
        return self._device is None

    def wait(self, outputs: _Tensors) -> StepResult:
        try:
            return StepResult(outputs, read_outputs(outputs))   # the first read is the host sync
        except tf.errors.OpError as err:     # on a GPU a failing step is seen here
            raise self._failed(err, "") from err

    def _failed(self, err: tf.errors.OpError, where: str) -> StepError:
        """The step's TensorFlow error as one line (the op, the user's line, the reason); the TensorFlow error is
        its ``__cause__`` (a multi-worker job's guard reads a lost peer there, consumer/job/cluster.py)."""
        return StepError(self._compiled.factory, f"the step failed{where}: {describe_tf_error(err)}")


def aligned_empty(shape: int | Sequence[int], dtype: npt.DTypeLike,
                  alignment: int = ALIGN_BYTES) -> npt.NDArray[np.generic]:
    """Uninitialised C-contiguous array whose data starts on an ``alignment``-byte boundary.

    Over-allocates a uint8 buffer by ``alignment`` bytes and views it from the first aligned
    offset; the returned array keeps the buffer alive through ``.base``.
    """
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    dt = np.dtype(dtype)
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes].view(dt).reshape(shape_t)


def _can_alias(arr: np.ndarray) -> bool:
    """Whether DLPack may wrap ``arr`` without a copy (and without aborting TensorFlow)."""
    return (arr.flags.c_contiguous and arr.flags.writeable and arr.size > 0
            and arr.dtype.isnative and arr.ctypes.data % ALIGN_BYTES == 0)


def to_tensors(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, tf.Tensor], int]:
    """Hand numpy arrays to TensorFlow, zero-copy where it is safe.

    An array that is C-contiguous, writeable, non-empty and 64-byte aligned is wrapped with
    ``tf.experimental.dlpack.from_dlpack(arr.__dlpack__())`` (2-4 us, no copy): the tensor
    aliases the array's memory, so **the caller must keep the buffer untouched (not refilled,
    not reused as a ring slot) until the step that reads it has finished** (the built-in loop's
    stager frees the slot only once that step's outputs were read). Alignment is checked before
    DLPack is touched, because a misaligned DLPack buffer aborts the process. Every other array is
    copied with ``tf.constant``.

    The result is a host tensor even on a GPU: the TensorFlow hand-off (consumer/train/handoff.py)
    copies it to the GPU when it stages the batch, while the previous step runs.

    Returns:
        The tensors by the same keys, and the number of arrays that were copied.
    """
    tensors: dict[str, tf.Tensor] = {}
    copies = 0
    for name, arr in arrays.items():
        if _can_alias(arr):
            try:
                tensors[name] = tf.experimental.dlpack.from_dlpack(arr.__dlpack__())
                continue
            except (BufferError, TypeError, ValueError, tf.errors.InvalidArgumentError) as err:
                log.debug("dlpack refused %s (%s); copying", name, err)
        tensors[name] = tf.constant(arr)
        copies += 1
    return tensors, copies
