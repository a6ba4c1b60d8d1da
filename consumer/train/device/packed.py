"""One uint8 region per batch into the compiled step: the program cuts it into the arrays and accumulates outputs.

Role: a batch's arrays lie in one 64-byte aligned byte range of its slot (shared/wire/layout.py). The
hand-off (consumer/train/handoff.py) gives the step that range as ONE uint8 tensor; ``PackedSteps``
wraps each bucket's compiled program (``CompiledStep.program_for``) in an outer ``tf.function`` whose
only input is that ``uint8[nbytes]`` tensor: inside the program each array is ``tf.slice`` +
``tf.reshape`` + ``tf.bitcast`` of the region at the offsets and shapes the bucket's layout fixes at trace
time, the step runs on them, and its named outputs go into ``Accumulators``
(consumer/train/device/accumulators.py) instead of back to the host. A step that takes row inputs
(consumer/train/rows.py) reads its int32 ``rows`` from the region too: the hand-off writes it into the slot
right after the arrays (``RegionLayout.rows_offset``). On a GPU that is one host->device copy of uint8
(device memory; int32 would stay in host memory) instead of four, and no array of the step aliases the slot
after it. With replicas (consumer/train/replicas.py) ``stage`` hands each replica its own rows: one uint8
piece per array per replica (its row range of that array), placed on the replica's device, and the
program cuts each piece on its replica's device (``Replicas.run_parts``).
Invariants: ``stage`` is the one way a region becomes the program's input (the hand-off, warm-up and the
resident-batch measure all use it), so every program call sees its inputs where the fed loop puts them.
The outer program of a bucket is traced and compiled in ``warm_up`` (before READY, on the bucket's real batch,
consumer/train/warm_batches.py), which
leaves every variable of the step and the accumulators as it found them; XLA (``CompiledStep.mode``)
compiles the outer program whole (one replica), so the cut is fused into the step. The cut reads each
array exactly where ``batch_layout`` put it, so the step sees the same bytes as the per-array path.
Shutdown: nothing to release; programs go with this object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from melfeed.consumer.train.device.accumulators import Accumulators
from melfeed.consumer.train.jit import stably_named
from melfeed.consumer.train.preflight import BucketOutOfMemory
from melfeed.shared.wire.layout import ALIGN_BYTES, aligned_buffer

__all__ = ["PackedSteps", "RegionLayout", "host_tensor"]

log = logging.getLogger(__name__)

_Layout = Sequence[tuple[str, int, tuple[int, ...], np.dtype]]  # shared.wire.layout.batch_layout's rows


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """Where each array of one bucket's batch lies in its region: name -> (byte offset, shape, dtype)."""

    nbytes: int
    arrays: dict[str, tuple[int, tuple[int, ...], np.dtype]]
    rows_offset: int | None = None  # where the int32 ``rows`` lies (a step with row inputs), else None

    @classmethod
    def of(cls, layout: _Layout) -> RegionLayout:
        """From ``batch_layout(bucket)``; ``nbytes`` ends at the last array's last byte (``layout_nbytes``)."""
        arrays = {key: (offset, tuple(shape), np.dtype(dtype)) for key, offset, shape, dtype in layout}
        _, offset, shape, dtype = layout[-1]
        return cls(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize, arrays)

    def with_rows(self) -> RegionLayout:
        """The same arrays and an int32 ``rows`` right after them (4-byte aligned), inside ``nbytes``."""
        if self.rows_offset is not None:
            return self
        offset = -(-self.nbytes // 4) * 4
        return RegionLayout(offset + 4, self.arrays, offset)

    def fill(self, region: np.ndarray, arrays: Any, rows: int | None = None) -> None:
        """Write ``arrays`` (name -> numpy array) and ``rows`` (None = every row) into ``region`` (uint8)."""
        for name, (offset, _shape, dtype) in self.arrays.items():
            raw = np.ascontiguousarray(arrays[name], dtype).reshape(-1).view(np.uint8)
            region[offset : offset + raw.size] = raw
        self.put_rows(region, rows)

    def put_rows(self, region: np.ndarray, rows: int | None) -> None:
        """Write the batch's real rows (None = every row) where the program reads them; no-op without them."""
        if self.rows_offset is not None:
            count = self.arrays["mel"][1][0] if rows is None else rows
            region[self.rows_offset : self.rows_offset + 4] = np.array([count], np.int32).view(np.uint8)

    def pieces(self, names: Sequence[str], replicas: int) -> list[list[tuple[int, int]]]:
        """Per replica, per array of ``names``: (byte offset, bytes) of that replica's rows of the array."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
        for name in names:
            offset, shape, dtype = self.arrays[name]
            part = int(np.prod(shape)) * dtype.itemsize // replicas
            for i in range(replicas):
                out[i].append((offset + i * part, part))
        return out

    def cut(self, region: tf.Tensor, name: str) -> tf.Tensor:
        """Array ``name`` of the batch in ``region`` (traced: slice, bitcast, reshape)."""
        offset, shape, dtype = self.arrays[name]
        return _as_array(tf.slice(region, [offset], [int(np.prod(shape)) * dtype.itemsize]), shape, dtype)

    def cut_piece(self, piece: tf.Tensor, name: str, replicas: int) -> tf.Tensor:
        """One replica's share of array ``name`` from its piece (``pieces``; traced: bitcast, reshape)."""
        _, shape, dtype = self.arrays[name]
        return _as_array(piece, (shape[0] // replicas, *shape[1:]), dtype)

    def cut_rows(self, region: tf.Tensor) -> tf.Tensor:
        """The int32 ``rows`` scalar of ``region`` (traced)."""
        assert self.rows_offset is not None
        return tf.reshape(tf.bitcast(tf.reshape(tf.slice(region, [self.rows_offset], [4]), [1, 4]), tf.int32), [])


def _as_array(piece: tf.Tensor, shape: tuple[int, ...], dtype: np.dtype) -> tf.Tensor:
    tf_dtype = tf.as_dtype(dtype)
    if dtype.itemsize > 1:
        piece = tf.bitcast(tf.reshape(piece, [-1, dtype.itemsize]), tf_dtype)
    elif tf_dtype != tf.uint8:
        piece = tf.bitcast(piece, tf_dtype)
    return tf.reshape(piece, shape)


def host_tensor(buffer: np.ndarray) -> tuple[tf.Tensor, int]:
    """A uint8 host tensor of ``buffer``: DLPack (no copy) when 64-byte aligned and writeable, else a copy (1)."""
    if buffer.size and buffer.flags.c_contiguous and buffer.flags.writeable and buffer.ctypes.data % ALIGN_BYTES == 0:
        return tf.experimental.dlpack.from_dlpack(buffer.__dlpack__()), 0
    return tf.constant(buffer), 1


class PackedSteps:
    """The per-bucket programs that take one uint8 region; outputs accumulate on ``device``.

    Args:
        compiled: the ``CompiledStep`` (its ``warm_up`` done: the mode is settled, programs traced).
        layouts: one ``RegionLayout`` per bucket, bucket order (the ring's layout of the slot).
        device: where the accumulators live (the model GPU, or the replicas' first device); None = default.
            A GPU here is also where ``stage`` copies a region to (one device).
    """

    def __init__(self, compiled: Any, layouts: Sequence[RegionLayout], device: str | None = None) -> None:
        self._compiled = compiled
        self.layouts = [layout.with_rows() if compiled.takes_rows else layout for layout in layouts]
        self.replicas = compiled.replicas  # consumer/train/replicas.py; None = one device
        on_gpu = device is not None and tf.DeviceSpec.from_string(device).device_type == "GPU"
        self._copy_to = device if on_gpu else None
        self._device = device
        self._accumulators: Accumulators | None = None  # built with the first program (its output names)
        self._programs: dict[tuple[str, int], Any] = {}  # (mode, bucket) -> concrete function
        self._warm_regions: dict[int, Any] = {}  # during warm_up: bucket -> its staged warm-up batch
        self.dispatched = 0

    @classmethod
    def for_buckets(cls, compiled: Any, buckets: Sequence[Any], device: str | None) -> PackedSteps:
        """Over the ring's slot layout of ``buckets`` (``Bucket``s); outputs accumulate on ``device``, or on the
        first replica's device with replicas."""
        from melfeed.shared.wire.layout import batch_layout

        layouts = [RegionLayout.of(batch_layout(b)) for b in buckets]
        return cls(compiled, layouts, compiled.devices[0] if compiled.devices else device)

    @property
    def accumulators(self) -> Accumulators:
        """The named outputs' device accumulators; the first call traces bucket 0's step (nothing is traced at
        construction: the compile mode is settled by ``warm_up``)."""
        if self._accumulators is None:
            self._accumulators = Accumulators(_output_names(self._compiled.program_for(0)[0]), self._device)
        return self._accumulators

    @property
    def factory(self) -> str:
        """The step factory's name (``model.step``), for error messages."""
        return str(self._compiled.factory)

    def program(self, bucket: int) -> Any:
        """The concrete function of ``bucket`` (traced on first use): ``stage``'s tensors in, nothing out."""
        mode = self._compiled.mode
        found = self._programs.get((mode, bucket))
        if found is not None:
            return found
        inner, names, takes_rows = self._compiled.program_for(bucket)
        accumulators = self.accumulators  # built before the trace below: it creates variables
        layout, replicas = self.layouts[bucket], self.replicas
        xla = mode == "xla"

        def packed(*regions: tf.Tensor) -> tf.Tensor:
            if replicas is None:
                rows = (layout.cut_rows(regions[0]),) if takes_rows else ()
                outputs = inner(*(layout.cut(regions[0], name) for name in names), *rows)
            else:  # one piece per array per replica, replica-major
                k, n = len(names), replicas.count
                key = tuple(layout.arrays[name][1] for name in names)

                def cut(p: Sequence[tf.Tensor]) -> list[tf.Tensor]:
                    return [layout.cut_piece(p[j], names[j], n) for j in range(k)]

                outputs = replicas.run_parts(key, xla, cut, [tuple(regions[i * k : (i + 1) * k]) for i in range(n)])
            accumulators.update(outputs)
            return tf.constant(0, tf.int32)  # nothing to read: a tensor so the call has an output

        if replicas is None:
            signature = [tf.TensorSpec([layout.nbytes], tf.uint8, name="region")]
        else:
            signature = [
                tf.TensorSpec([nbytes], tf.uint8, name=f"replica{i}_{names[j]}")
                for i, part in enumerate(layout.pieces(names, replicas.count))
                for j, (_, nbytes) in enumerate(part)
            ]
        program = stably_named(
            tf.function(
                packed,
                jit_compile=xla and replicas is None,  # replicas: XLA inside
                input_signature=signature,
            ).get_concrete_function(),
            f"packed_{mode}_{layout.nbytes}",
        )
        self._programs[(mode, bucket)] = program
        return program

    def stage(self, bucket: int, region: np.ndarray) -> tuple[Any, int]:
        """``region`` (the batch's uint8 bytes, ``layouts[bucket]``) as the program's input, and the host copies made.

        One device: one uint8 tensor (DLPack of ``region``), copied to the model GPU when there is one.
        Replicas: for each replica, its row range of each array as a uint8 tensor (DLPack where 64-byte aligned,
        else a host copy of that piece) on the replica's device (``tf.identity`` under ``tf.device``: a
        host->device copy on a GPU, the same buffer on a CPU device), as the strategy's per-replica values.
        The three parts (``host_parts``, ``place``, ``as_input``) may run apart: the hand-off places on its copy
        thread (consumer/train/handoff.py).
        """
        parts, copies = self.host_parts(bucket, region)
        return self.as_input(self.place(parts)), copies

    def host_parts(self, bucket: int, region: np.ndarray) -> tuple[list[tuple[str | None, tf.Tensor]], int]:
        """The host tensors over ``region`` (DLPack, no copy where aligned), each with the device it goes to
        (None: it stays where it is), and the host copies made."""
        if self.replicas is None:
            tensor, copies = host_tensor(region)
            return [(self._copy_to, tensor)], copies
        names = self._compiled.input_names
        parts: list[tuple[str | None, tf.Tensor]] = []
        copies = 0
        for device, pieces in zip(self.replicas.devices, self.layouts[bucket].pieces(names, self.replicas.count)):
            for offset, nbytes in pieces:
                tensor, copied = host_tensor(region[offset : offset + nbytes])
                copies += copied
                parts.append((device, tensor))
        return parts, copies

    @staticmethod
    def place(parts: Sequence[tuple[str | None, tf.Tensor]]) -> list[tf.Tensor]:
        """Each host tensor on its device (``tf.identity`` under ``tf.device``; returns once every copy completed,
        in synchronous eager mode), in order."""
        placed = []
        for device, tensor in parts:
            if device is None:
                placed.append(tensor)
                continue
            with tf.device(device):
                placed.append(tf.identity(tensor))
        return placed

    def as_input(self, placed: Sequence[tf.Tensor]) -> Any:
        """``place``'s tensors as the program's input: the one region, or the strategy's per-replica values."""
        if self.replicas is None:
            return placed[0]
        per_replica = len(placed) // self.replicas.count
        return self.replicas.distribute(
            [tuple(placed[i * per_replica : (i + 1) * per_replica]) for i in range(self.replicas.count)]
        )

    def run(self, bucket: int, value: Any) -> None:
        """Dispatch one step on ``value`` (``stage``'s; returns when the step is enqueued; on the CPU, when it ran)."""
        program = self.program(bucket)
        if self.replicas is None:
            program(value)
        else:
            program(
                *(
                    t
                    for part in zip(*(self.replicas.strategy.experimental_local_results(v) for v in value))
                    for t in part
                )
            )
        self.dispatched += 1

    def warm_up(self, variables: Sequence[Any], batches: Sequence[Any] | None = None) -> float:
        """Compile every bucket's program on its warm-up batch (``WarmBatch``: ``arrays`` and ``rows``, bucket
        order; None = an all-zero region, every length 0), then restore ``variables`` and reset the accumulators;
        returns the seconds it took.

        If the compiled step has not been warmed up yet, its ``warm_up`` settles the mode (XLA or graph, timed
        under ``auto``) by running these programs (``run_bucket``): each program is compiled once, as the loop
        runs it. Otherwise (a caller that warmed the step up itself) these programs are compiled here.
        """
        started = time.perf_counter()
        self._warm_regions = {bucket: self._warm_region(bucket, batches) for bucket in range(len(self.layouts))}
        try:
            if not self._compiled.is_ready:
                self._compiled.warm_up(batches, run_bucket=self._run_warm)
            else:
                self._warm_own(variables)
        finally:
            self._warm_regions = {}
            self._programs = {k: v for k, v in self._programs.items() if k[0] == self._compiled.mode}
            if self._accumulators is not None:  # None: no program was built (it failed first)
                self._accumulators.reset()
            self.dispatched = 0
        seconds = time.perf_counter() - started
        log.info("packed step programs compiled buckets=%d s=%.2f", len(self.layouts), seconds)
        return seconds

    def _warm_own(self, variables: Sequence[Any]) -> None:
        saved = [v.numpy() for v in variables]  # host copies, as CompiledStep.warm_up
        try:
            for bucket in range(len(self.layouts)):
                self._run_warm(bucket)
        finally:
            for var, value in zip(variables, saved):
                var.assign(value)

    def _run_warm(self, bucket: int) -> None:
        """``CompiledStep.warm_up``'s ``run_bucket``: this bucket's program (current mode) once, then a host read
        (its failure is this bucket's; the first also compiles the read program)."""
        try:
            self.run(bucket, self._warm_regions[bucket])
            self.accumulators.read()
        except tf.errors.ResourceExhaustedError as err:  # consumer/train/preflight.py: one line
            raise BucketOutOfMemory(bucket) from err

    def _warm_region(self, bucket: int, batches: Sequence[Any] | None) -> Any:
        """Bucket ``bucket``'s warm-up batch staged as its program's input (all zero, rows 0, without one)."""
        layout = self.layouts[bucket]
        region = _aligned_zeros(layout.nbytes)
        if batches is not None:
            layout.fill(region, batches[bucket].arrays, batches[bucket].rows)
        return self.stage(bucket, region)[0]


def _aligned_zeros(nbytes: int) -> np.ndarray:
    region = aligned_buffer(nbytes)
    region[:] = 0
    return region


def _output_names(program: Any) -> list[str]:
    """The named outputs of a compiled program, ``loss`` first then sorted (``normalize_outputs``' order)."""
    concrete = program if hasattr(program, "structured_outputs") else program.get_concrete_function()
    names = list(concrete.structured_outputs)
    return ["loss", *sorted(n for n in names if n != "loss")]
