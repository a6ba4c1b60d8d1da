"""TensorFlow's hand-off for the ``Stager`` (consumer/staging.py): slot -> one uint8 tensor -> the packed step.

Role: ``TfStageAdapter`` supplies the four operations the framework-neutral stager needs for the built-in
loop. ``put`` takes the batch's byte region of its slot (writing a row-input step's ``rows`` into the slot
right after the arrays) and hands it to ``PackedSteps.stage``: ONE uint8 tensor with DLPack (zero copy)
and, when the step runs on a GPU, copied there (``tf.identity`` under ``tf.device``: one host->device copy
per batch, into device memory because the dtype is uint8); with replicas each replica's row range of each
array, on the replica's own device. ``step`` dispatches the bucket's packed program
(consumer/train/device/packed.py), which cuts the region into the arrays and accumulates the named outputs
on the device; ``wait`` reads nothing: the loop reads the accumulators once per interval
(docs/design.md "The path of one batch", "The TensorFlow hand-off": which stream each copy runs on and
what waits for what).
Invariants:
    * On the CPU the region tensor aliases the slot: ``Staged.copied`` is None, the slot is freed when
      the step completed, which is when its dispatch returned (eager execution on the CPU is synchronous).
    * On a GPU the hand-off copies ahead (``copies_ahead``): ``put`` hands the copy to the copy thread
      (consumer/train/copy_thread.py) and returns; the stager puts batch k+1 before it dispatches step k, and
      ``step`` waits for its batch's copy and for the next batch's copy to have been issued, so that copy is
      ordered after the steps before this one only (TensorFlow orders a copy after the compute stream as it
      stood when the copy was issued). The eager copy has completed when the copy thread's call returned
      (``TensorHandle::CopyToDevice`` waits for it in synchronous eager mode, which ``TfStageAdapter``
      asserts): ``Staged.copied`` turns True then and the stager frees the slot before the step runs.
      ``dispatched_behind_copy`` counts the dispatches made after the next batch's copy was issued.
    * ``transfers`` counts the tensors handed to the devices: one per batch on one device, one per array per
      replica with replicas.
    * A step that fails while training (a TensorFlow op error) raises ``StepError``, one line naming
      ``model.step``, the op and the user's line (exit 1); on a GPU it surfaces at the next host read.
    * ``on_step(n)`` runs right after the n-th step was dispatched, its slot still held (``bench``
      models device time there).
``to_tensors`` (DLPack where safe, a copy otherwise) and ``aligned_empty`` (aligned arrays for tests and
probes) live here too: they are the slot -> tensor half of the hand-off.
Shutdown: ``close`` stops the copy thread, waiting (bounded) for the copy it runs (idempotent); the loop closes
the adapter when it ends, before the consumer unmaps the ring.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from melfeed.consumer.handout import Batch
from melfeed.consumer.staging import Staged
from melfeed.consumer.train.copy_thread import CLOSE_WAIT_S, COPY_TIMEOUT_S, NEXT_COPY_START_S, Copy, CopyThread
from melfeed.consumer.train.describe import describe_tf_error
from melfeed.consumer.train.device.accumulators import IntervalRead
from melfeed.consumer.train.device.packed import PackedSteps
from melfeed.shared.errors import StepError
from melfeed.shared.wire.layout import ALIGN_BYTES

__all__ = ["StepResult", "TfStageAdapter", "aligned_empty", "model_device", "to_tensors"]

log = logging.getLogger(__name__)

_Tensors = dict[str, tf.Tensor]
SlotBuffer = Callable[[int], npt.NDArray[np.uint8]]  # ``BatchRing.memory.buffer``: a slot's aligned bytes


@dataclass(frozen=True, slots=True)
class StepResult:
    """A dispatched step: its number (1-based) and where its outputs accumulate (nothing is read per step)."""

    number: int
    raw: _Tensors


def model_device() -> str | None:
    """The device the step runs on when it is not the CPU: the first GPU TensorFlow sees, else None."""
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else None


def _is_gpu(device: str | None) -> bool:
    return device is not None and tf.DeviceSpec.from_string(device).device_type == "GPU"


class TfStageAdapter:
    """The ``StageAdapter`` of ``PackedSteps``: the slot's region in (one tensor), outputs accumulated on the device.

    Args:
        packed: the packed programs (``warm_up`` done).
        device: the GPU to copy regions to (``model_device()``); None (or a CPU) = wrap only, synchronous.
        on_step: called with the number of steps dispatched so far, right after each dispatch.
        slot_buffer: a slot's whole buffer (``consumer._ring.memory.buffer``); a batch whose arrays do not lie
            in it (or without one) is packed into a fresh region, one host copy.
        copy_ahead: copy on the copy thread, ahead of the step before (module docstring); None = on a GPU only.
        next_copy_start_s: how long a dispatch waits for the next batch's copy to be issued (overlap, not safety).
    """

    def __init__(
        self,
        packed: PackedSteps,
        device: str | None,
        on_step: Callable[[int], None] | None = None,
        slot_buffer: SlotBuffer | None = None,
        copy_ahead: bool | None = None,
        next_copy_start_s: float = NEXT_COPY_START_S,
    ) -> None:
        self._packed = packed
        self._device = device if _is_gpu(device) else None
        if self._device is not None and not tf.config.experimental.get_synchronous_execution():
            raise RuntimeError(
                "the TensorFlow hand-off frees a slot when its copy returned: that needs synchronous "
                "eager execution (tf.config.experimental.set_synchronous_execution(True))"
            )
        self._on_step = on_step
        self._slot_buffer = slot_buffer
        self.copies_ahead = self._device is not None if copy_ahead is None else copy_ahead  # StageAdapter's
        self._copier = CopyThread() if self.copies_ahead else None
        self._issued: deque[Copy[list[tf.Tensor]]] = deque()  # put, not yet dispatched, in put order
        self._next_copy_start_s = next_copy_start_s  # a dispatch's wait for the next copy to be issued
        self.dispatched = 0
        self.dispatched_behind_copy = 0  # dispatches issued after the next batch's copy (module docstring)
        self.transfers = 0  # tensors handed to the devices (module docstring)

    def put(self, batch: Batch) -> Staged[Any]:  # the program's input, or the Copy that makes it (copies_ahead)
        region, copies = self._region(batch)
        parts, piece_copies = self._packed.host_parts(batch.bucket, region)
        self.transfers += len(parts)
        host_copies = copies + piece_copies
        if self._copier is not None:  # the copy runs on the copy thread; ``step`` takes its result
            copy = self._copier.submit(functools.partial(self._packed.place, parts))
            self._issued.append(copy)
            return Staged(copy, copied=copy.done if self._device is not None else None, host_copies=host_copies)
        value = self._packed.as_input(self._packed.place(parts))
        if self._device is None:
            return Staged(value, copied=None, host_copies=host_copies)
        return Staged(value, copied=_already_copied, host_copies=host_copies)  # the copies completed in place

    def step(self, batch: Batch, value: Any) -> StepResult:
        if isinstance(value, Copy):
            value = self._packed.as_input(self._placed(batch, value))
        try:
            self._packed.run(batch.bucket, value)
        except tf.errors.OpError as err:  # on the CPU the step runs here: its failure, in one line
            raise self._failed(err, f" on batch {batch.batch_id}") from err
        self.dispatched += 1
        if self._on_step is not None:
            self._on_step(self.dispatched)
        return StepResult(self.dispatched, {"outputs": self._packed.accumulators.variables[0]})

    def is_done(self, outputs: StepResult) -> bool:
        return self._device is None

    def wait(self, outputs: StepResult) -> StepResult:
        return outputs  # no host read per step: Accumulators.read, once per interval

    def close(self) -> None:
        """Stop the copy thread (idempotent): the copies not started are cancelled, the one running is waited for
        (bounded), so that no copy still reads a slot when the consumer unmaps the ring."""
        if self._copier is not None and not self._copier.close():
            log.warning(
                "a device copy was still running %.0f s after the loop ended; the ring may be closed under it",
                CLOSE_WAIT_S,
            )

    def _placed(self, batch: Batch, copy: Copy[list[tf.Tensor]]) -> list[tf.Tensor]:
        """The batch's device tensors once its copy completed; before the step is dispatched, the next batch's
        copy (already put) is let start, so that it is ordered after the steps before this one only."""
        if copy not in self._issued:
            raise RuntimeError(f"batch {batch.batch_id} was dispatched twice, or never put")
        while self._issued.popleft() is not copy:  # put before it and given back undispatched: never stepped
            pass
        try:
            placed = copy.result(COPY_TIMEOUT_S)
        except tf.errors.OpError as err:
            raise self._failed(err, f" copying batch {batch.batch_id} to the device") from err
        if self._issued and self._issued[0].wait_started(self._next_copy_start_s):
            self.dispatched_behind_copy += 1
        return placed

    def read(self) -> IntervalRead:
        """The interval's accumulated outputs (``Accumulators.read``: the one host read; a step's failure
        on a GPU is seen here, as ``StepError``)."""
        try:
            return self._packed.accumulators.read()
        except tf.errors.OpError as err:
            raise self._failed(err, "") from err

    def _region(self, batch: Batch) -> tuple[npt.NDArray[np.uint8], int]:
        """The batch's byte region of its slot (no copy; a row-input step's ``rows`` written after the arrays),
        else its arrays (and ``rows``) packed into an aligned one (1 copy)."""
        layout = self._packed.layouts[batch.bucket]
        if self._slot_buffer is not None:
            buf = self._slot_buffer(batch.slot)
            if batch.arrays["mel"].ctypes.data == buf.ctypes.data and buf.nbytes >= layout.nbytes:
                layout.put_rows(buf, batch.rows)
                return buf[: layout.nbytes], 0
        region: npt.NDArray[np.uint8] = aligned_empty(layout.nbytes, np.uint8)  # type: ignore[assignment]
        layout.fill(region, batch.arrays, batch.rows)
        return region, 1

    def _failed(self, err: tf.errors.OpError, where: str) -> StepError:
        """The step's TensorFlow error as one line (the op, the user's line, the reason); the TensorFlow error is
        its ``__cause__`` (a multi-worker job's guard reads a lost peer there, consumer/job/cluster.py)."""
        return StepError(self._packed.factory, f"the step failed{where}: {describe_tf_error(err)}")


def _already_copied() -> bool:
    return True


def aligned_empty(
    shape: int | Sequence[int], dtype: npt.DTypeLike, alignment: int = ALIGN_BYTES
) -> npt.NDArray[np.generic]:
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
    return raw[offset : offset + nbytes].view(dt).reshape(shape_t)


def _can_alias(arr: np.ndarray) -> bool:
    """Whether DLPack may wrap ``arr`` without a copy (and without aborting TensorFlow)."""
    return (
        arr.flags.c_contiguous
        and arr.flags.writeable
        and arr.size > 0
        and arr.dtype.isnative
        and arr.ctypes.data % ALIGN_BYTES == 0
    )


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
