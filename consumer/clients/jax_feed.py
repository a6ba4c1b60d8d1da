"""A JAX client of the consumer: the stager's hand-off and a small training step.

Role: what a JAX trainer needs to train on ``Consumer`` batches through ``melfeed.consumer.staging.Stager``,
and the step ``jax_bench.py`` measures the data path with on a GPU that has no TensorFlow.
    * ``JaxStageAdapter.put`` starts ``jax.device_put`` of the batch's arrays to the model device (the copy
      runs while the step before it does). Where the device array aliases the slot's memory (JAX on the
      CPU takes an aligned numpy array without copying it), ``Staged.copied`` is None and the slot is held
      until the step that reads it completed; otherwise ``copied`` is True once every array is ready on
      the device, and the stager frees the slot then, before the step ends.
    * ``mlp_step``: a per-frame MLP that predicts each mel frame from the one before, masked by
      ``mel_len``, with plain SGD; ``hidden`` and ``layers`` size the compute. One jitted function; JAX
      compiles it once per bucket shape (``compile_buckets`` does that before anything is timed).
Invariants: every method runs on the thread that iterates ``Stager.run``; ``step`` never waits for the
device; the parameters live on ``device`` and are replaced by each step's outputs (donated).
Shutdown: nothing owned; device arrays go with their last reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from melfeed.consumer.staging import Staged

__all__ = [
    "JaxStageAdapter",
    "mlp_step",
    "init_params",
    "aliases_host",
    "device_batch",
    "block_until_ready",
    "STEP_ARRAYS",
]

Params = dict[str, Any]
StepFn = Callable[[Params, Mapping[str, Any]], tuple[Params, jax.Array]]
_Tree = TypeVar("_Tree")


def block_until_ready(tree: _Tree) -> _Tree:
    """``jax.block_until_ready``, typed: waits until every array in ``tree`` is computed; returns ``tree``."""
    ready: _Tree = jax.block_until_ready(tree)  # type: ignore[no-untyped-call]  # jax leaves it unannotated
    return ready


def init_params(n_mels: int, hidden: int, layers: int, seed: int = 0) -> Params:
    """Weights of ``mlp_step``'s model, float32, drawn from ``seed`` (the same on every run)."""
    rng = np.random.default_rng(seed)
    sizes = [n_mels] + [hidden] * layers + [n_mels]
    return {
        f"w{i}": jnp.asarray(rng.standard_normal((a, b), dtype=np.float32) / np.sqrt(a))
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))
    }


def mlp_step(layers: int, learning_rate: float = 1e-3) -> StepFn:
    """A jitted step ``(params, arrays) -> (params, loss)``; ``params`` is donated."""

    def loss_fn(params: Params, mel: jax.Array, mel_len: jax.Array) -> jax.Array:
        x = mel[:, :-1].astype(jnp.float32)
        for i in range(layers):
            x = jax.nn.relu(x @ params[f"w{i}"])
        pred = x @ params[f"w{layers}"]
        frames = jnp.arange(mel.shape[1] - 1)[None, :]
        mask = (frames + 1 < mel_len[:, None]).astype(jnp.float32)[..., None]
        err = (pred - mel[:, 1:].astype(jnp.float32)) ** 2 * mask
        loss: jax.Array = err.sum() / jnp.maximum(mask.sum() * mel.shape[2], 1.0)
        return loss

    def step(params: Params, arrays: Mapping[str, Any]) -> tuple[Params, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, arrays["mel"], arrays["mel_len"])
        return jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads), loss

    return jax.jit(step, donate_argnums=0)


STEP_ARRAYS = ("mel", "mel_len")  # what mlp_step reads; a step of your own names its own


def device_batch(
    arrays: Mapping[str, np.ndarray], device: Any, names: tuple[str, ...] = STEP_ARRAYS
) -> dict[str, jax.Array]:
    """The arrays the step reads (``names``) put on ``device``; starts the copy, does not wait.

    Raises:
        KeyError: a name the batch does not hold (one line listing the batch's arrays).
    """
    missing = [key for key in names if key not in arrays]
    if missing:
        raise KeyError(f"JaxStageAdapter(array_names=...): the batch has no {missing}; it holds {sorted(arrays)}")
    return {key: jax.device_put(arrays[key], device) for key in names}


def aliases_host(on_device: Mapping[str, jax.Array], host: Mapping[str, np.ndarray]) -> bool:
    """Whether any device array is the host array's own memory (JAX on the CPU, an aligned array)."""
    for key, value in on_device.items():
        try:
            if value.unsafe_buffer_pointer() == host[key].ctypes.data:
                return True
        except (AttributeError, NotImplementedError, RuntimeError):
            return True  # cannot tell: hold the slot until the step completed
    return False


class JaxStageAdapter:
    """``melfeed.consumer.staging.StageAdapter`` for a JAX step on one device.

    Args:
        step: ``(params, arrays) -> (params, loss)``, e.g. ``mlp_step``.
        params: the initial parameters (on ``device``).
        device: the model device (``jax.devices()[i]``).
        array_names: the batch arrays the step reads, copied to ``device`` (default ``mel`` and
            ``mel_len``, ``mlp_step``'s); e.g. add ``tokens`` and ``tok_len`` for a text-to-mel step.
    """

    def __init__(self, step: StepFn, params: Params, device: Any, array_names: tuple[str, ...] = STEP_ARRAYS) -> None:
        self.step_fn = step
        self.array_names = tuple(array_names)
        self.params = params
        self.device = device
        self.aliased = 0  # batches whose slot was held to the step's end (aliased memory)

    def put(self, batch: Any) -> Staged[dict[str, jax.Array]]:
        value = device_batch(batch.arrays, self.device, self.array_names)
        if aliases_host(value, batch.arrays):
            self.aliased += 1
            return Staged(value, copied=None)
        leaves: list[Any] = list(value.values())  # is_ready: not in jax.Array's type stubs
        return Staged(value, copied=lambda: all(a.is_ready() for a in leaves))

    def step(self, batch: Any, value: dict[str, jax.Array]) -> jax.Array:
        self.params, loss = self.step_fn(self.params, value)
        return loss

    def is_done(self, loss: Any) -> bool:
        return bool(loss.is_ready())

    def wait(self, loss: jax.Array) -> float:
        return float(jax.device_get(loss))
