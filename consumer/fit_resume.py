"""Keras ``fit`` that resumes exactly: the model, the optimizer and the data position committed together.

```python
cfg = melfeed.load_config("train.yaml")                  # consumer.state_dir and consumer.steps set
with FitResume(cfg) as resume:                            # locks the state directory, finds where to go on
    with Consumer(cfg, start_batch=resume.next_batch) as feed:
        model = build_model(); model.compile(...)
        model.fit(feed.as_dataset(), epochs=1, callbacks=[resume.callback(model, feed)])
```
Role: the built-in loop's state directory (consumer/resume/state.py: lock, run identity, audit log, checkpoints
of variables + cursor) driven from Keras callbacks. ``on_train_begin`` restores the newest checkpoint into the
model's and the optimizer's variables (after ``fit`` built them); ``on_train_batch_end`` records each batch the
step has trained (the audit log) and, every ``consumer.checkpoint_every_steps`` batches, commits the variables
with the position of the first batch not trained; ``on_train_end`` commits the last ones. A process killed
anywhere restarts with ``FitResume(cfg).next_batch``: the dataset continues at the first batch the committed
variables have not seen, the audit log is cut back to them, and ``melfeed audit`` proves each batch applied once.
Invariants: a batch is recorded only once the step that trained it returned (``fit``'s batch counter, not the
dataset's hand-out: the dataset hands a batch out before the step runs); the plan ends where ``consumer.steps``
ends it, so ``fit(epochs=1)`` with no ``steps_per_epoch`` trains exactly the rest of the run.
Shutdown: ``close()`` releases the state directory's lock; idempotent; a context manager.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from melfeed.consumer.resume.state import RunState
from melfeed.shared.cache.features import load_manifest_for
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError

if TYPE_CHECKING:
    from melfeed.consumer.feed import Consumer

__all__ = ["FitResume"]

log = logging.getLogger(__name__)


class FitResume:
    """The state directory of one ``fit`` run (module doc); hands out the Keras callback that commits it."""

    def __init__(self, cfg: PipelineConfig) -> None:
        if cfg.consumer.state_dir is None:
            raise ConfigError(
                "must be set: fit resumes from the checkpoints and audit log there", path=("consumer", "state_dir")
            )
        state = RunState.open(cfg, load_manifest_for(cfg, feeds_model=False).fingerprint)
        assert state is not None  # state_dir is set: open returns a state or raises
        self._state: RunState | None = state
        self.next_batch = state.next_batch  # where the dataset starts: the first batch not committed

    def callback(self, model: Any, feed: Consumer, dataset: Any) -> Any:
        """A ``keras.callbacks.Callback`` that restores, records and commits ``model`` trained on ``dataset``
        (``feed.as_dataset(...)``). A model not built yet is built from the dataset's element spec first (no
        batch is read for it), so its variables exist to restore into before the first step."""
        if feed._desk.next_id != self.next_batch:
            raise ValueError(
                f"the Consumer's next batch is {feed._desk.next_id}, the state directory's "
                f"{self.next_batch}: construct it with start_batch=resume.next_batch"
            )
        return _make_callback(self, model, feed, dataset.element_spec)

    @property
    def state(self) -> RunState:
        if self._state is None:
            raise RuntimeError("FitResume is closed")
        return self._state

    def close(self) -> None:
        """Release the state directory (idempotent)."""
        if self._state is not None:
            self._state.close()
            self._state = None

    def __enter__(self) -> FitResume:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _keras_of(model: Any) -> ModuleType:
    """The Keras ``model`` belongs to: ``tf_keras`` (Keras 2, ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``) or
    ``keras`` (Keras 3). Their callbacks and symbolic inputs do not mix."""
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None and isinstance(model, tf_keras.Model):
        return tf_keras
    import keras

    keras_module: ModuleType = keras  # Keras is untyped
    return keras_module


def _items(model: Any) -> dict[str, object]:
    """What a checkpoint holds: the model's variables and the optimizer's (its step count and slots too), as
    lists in their creation order. Not the Keras objects themselves: restoring a Keras 3 model's object graph
    through ``tf.train.Checkpoint`` can add a second copy of a layer's variable."""
    optimizer = model.optimizer
    if not getattr(optimizer, "built", getattr(optimizer, "_built", False)):  # tf_keras: only _built
        optimizer.build(model.trainable_variables)
    from melfeed.consumer.train.model import optimizer_variables  # TensorFlow: not at melfeed's import

    return {"model": [_tf_variable(v) for v in model.weights], "optimizer": optimizer_variables(optimizer)}


def _tf_variable(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable; a tf.keras (Keras 2) variable is one already."""
    value = getattr(variable, "value", None)
    return value if value is not None and not callable(value) else variable


def _build(model: Any, element_spec: Any) -> None:
    """Create ``model``'s variables by calling it on symbolic inputs shaped like the dataset's features."""
    keras = _keras_of(model)
    features = element_spec[0] if isinstance(element_spec, tuple) else element_spec

    def symbolic(spec: Any) -> Any:
        if keras.__name__ == "keras":
            return keras.KerasTensor(spec.shape, spec.dtype.name)
        return keras.Input(batch_shape=spec.shape, dtype=spec.dtype)  # tf_keras has no KerasTensor(shape, dtype)

    model(
        {name: symbolic(spec) for name, spec in features.items()} if isinstance(features, dict) else symbolic(features)
    )


def _make_callback(resume: FitResume, model: Any, feed: Consumer, element_spec: Any) -> Any:
    callback: Any = _keras_of(model).callbacks.Callback  # Keras is untyped

    class _Commit(callback):  # type: ignore[misc]  # Keras is untyped
        """Restore at the start, record every trained batch, commit every interval and at the end."""

        def __init__(self) -> None:
            super().__init__()
            self._trained = 0  # batches trained by this process (fit's counter over its epochs)
            self._epoch_start = 0

        def on_train_begin(self, logs: Any = None) -> None:
            state = resume.state
            if not model.built:
                _build(model, element_spec)
            if state.resumed:
                state.restore_into(_items(model))
                log.info("fit resumes at batch %d", resume.next_batch)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch_start = self._trained

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            trained = self._epoch_start + batch + 1  # steps_per_execution > 1: batch is the last one
            applied = feed.applied_ids
            if trained > len(applied):
                raise RuntimeError(
                    f"fit trained {trained} batches but the dataset handed out {len(applied)}: "
                    "train on feed.as_dataset() alone"
                )
            for batch_id in applied[self._trained : trained]:
                resume.state.record(batch_id, feed.plan.batch(batch_id).sample_ids, feed._run_id)
            self._trained = trained
            if resume.state.due():
                resume.state.checkpoint(_items(model), feed._run_id, final=False)

        def on_train_end(self, logs: Any = None) -> None:
            resume.state.checkpoint(_items(model), feed._run_id, final=True)
            resume.next_batch = resume.state.next_batch

    return _Commit()
