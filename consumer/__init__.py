"""melfeed's consumer: the training side, and the library a training loop takes batches from.

A library user imports these from ``melfeed`` (``melfeed.__all__``, docs/guide/your-model.md "A loop of your own").
``Consumer.as_dataset()`` gives the same batches as a ``tf.data.Dataset`` for Keras ``fit``.
Invariants: importing this package never imports TensorFlow (``as_dataset`` imports it when
called); ``melfeed.consumer.feed`` and the modules under it never import this package back (no cycle).
Shutdown: ``Consumer.close()`` (or leaving its ``with`` block); see ``consumer/feed.py``.
Rooms: ``feed`` (the library), ``dataset``, ``app`` (the CLI), ``flow/``, ``transport/``, ``train/``,
``resume/``, ``observe/``, ``doctor/``, ``bench/``.
"""

from melfeed.consumer.feed import Batch, Consumer
from melfeed.consumer.flow.plan import PlannedBatch

__all__ = ["Consumer", "Batch", "PlannedBatch"]
