"""What each compiled program runs on during warm-up, and how one warm-up run of it is made.

Role: ``CompiledStep.warm_up`` (consumer/train/step.py) compiles, checks and times one program per bucket shape.
``WarmInputs`` holds, per program key (the bucket's array shapes), the tensors of its first bucket's warm-up
batch (``WarmBatch``, consumer/train/warm_batches.py) or, without real batches, all-padding tensors; ``runs``
gives the calls that run a program once and wait for it. When the caller trains with outer programs of its own
built over these (``PackedSteps``: one uint8 region in, consumer/train/device/packed.py), it passes
``run_bucket`` and those outer programs are what warm-up compiles and times, so each program is compiled once.
Invariants: every call returned by ``runs`` ends with a host read (the compile and the step have completed);
the inputs are built once per key. Shutdown: nothing to release; the tensors go with this object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

from melfeed.consumer.train.outputs import read_outputs

__all__ = ["WarmInputs"]

_Shapes = tuple[tuple[int, ...], ...]


class WarmInputs:
    """Per program key, its warm-up inputs and what they are; ``run_bucket`` (or None) runs a caller's program.

    Args:
        keys: each bucket's program key, bucket order.
        names: the batch keys a program takes, in order (its arrays); ``dtypes`` maps each to its dtype.
        takes_rows: an int32 ``rows`` follows the arrays (a step with row inputs, consumer/train/rows.py).
        batches: one real batch per bucket (``WarmBatch``), or None: all padding (every length 0, ``rows`` 0).
        run_bucket: runs bucket ``i``'s outer program once on its warm-up batch with a host read; None = these
            programs are the ones trained with.
    """

    def __init__(
        self,
        keys: Sequence[_Shapes],
        names: Sequence[str],
        dtypes: Mapping[str, tf.DType],
        takes_rows: bool,
        batches: Sequence[Any] | None = None,
        run_bucket: Callable[[int], None] | None = None,
    ) -> None:
        if batches is not None and len(batches) != len(keys):
            raise ValueError(f"need one warm-up batch per bucket ({len(keys)}), got {len(batches)}")
        self._keys, self._names, self._dtypes, self._takes_rows = list(keys), tuple(names), dtypes, takes_rows
        self._batches, self._run_bucket = batches, run_bucket
        self._found: dict[_Shapes, tuple[list[tf.Tensor], str]] = {}

    def inputs(self, key: _Shapes) -> tuple[list[tf.Tensor], str]:
        """The program's inputs on its first bucket's warm-up batch, and which batch that is."""
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = self._build(key)
        return found

    def runs(self, key: _Shapes, program: Callable[..., Any], every_bucket: bool) -> list[Callable[[], None]]:
        """Calls that each run a program of ``key`` once and wait for it: the caller's outer program of each of its
        buckets (the first only unless ``every_bucket``), else ``program`` on ``inputs(key)``."""
        if self._run_bucket is None:
            args = self.inputs(key)[0]

            def run_own() -> None:
                read_outputs(program(*args))

            return [run_own]
        buckets = [i for i, k in enumerate(self._keys) if k == key]
        return [functools.partial(self._run_bucket, i) for i in (buckets if every_bucket else buckets[:1])]

    def _build(self, key: _Shapes) -> tuple[list[tf.Tensor], str]:
        rows: list[tf.Tensor] = []
        if self._batches is None:
            arrays = [tf.zeros(shape, self._dtypes[name]) for name, shape in zip(self._names, key)]
            rows = [tf.constant(0, tf.int32)] if self._takes_rows else []
            return arrays + rows, "all padding: every length 0, as in a padded partial batch"
        batch = self._batches[self._keys.index(key)]
        arrays = [tf.constant(batch.arrays[name], self._dtypes[name]) for name in self._names]
        rows = [tf.constant(batch.rows, tf.int32)] if self._takes_rows else []
        return arrays + rows, batch.describe()
