"""Reading TensorBoard event files back as TensorBoard's scalar plugin reads them (no tensorboard package)."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] over every event file directly in ``logdir``, in file then write order.

    Every value is checked to be what the Scalars dashboard reads: plugin "scalars", a float32 rank-0 tensor.
    """
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars", value
                assert value.tensor.dtype == tf.float32.as_datatype_enum and not value.tensor.tensor_shape.dim, value
                out.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    return out
