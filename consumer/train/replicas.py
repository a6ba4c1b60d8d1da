"""Several model devices: the compiled step under ``MirroredStrategy`` (one host) or a job's ``MultiWorkerMirroredStrategy``.

Role: ``Replicas.from_config`` picks the devices (the first ``consumer.replicas`` visible GPUs, or as many
logical CPU devices, which ``melfeed.consumer.placement.configure_memory`` creates before TensorFlow initialises
its devices); ``scope()`` is where the step factory must run so every variable is mirrored;
``program`` builds the one program per bucket that ``CompiledStep`` (consumer/train/step.py) calls with
the full global batch, so the loop and its ``CompiledStep.run(bucket, batch)`` interface stay unchanged.

What one call does: split each of the four batch tensors along its rows into N equal views (``tf.split``
on axis 0; TensorFlow's CPU kernel aliases the input when every part is 64-byte aligned, which the mel
rows always are, so the slot is not copied on the host; a GPU replica's call copies its part
host->device), hand them to the strategy (``experimental_distribute_values_from_function``), run the
step on each replica under ``strategy.run`` (its own ``tf.function``, XLA per ``model.jit_compile``) and
sum each named scalar over the replicas.

In a multi-worker job (``Replicas.for_job``, the strategy from consumer/job/cluster.py) the same program
runs under ``MultiWorkerMirroredStrategy``: N is this worker's local devices (its GPUs, or its one CPU
device), each worker splits its own rank's batch over them, and ``global_sum`` and the summed named
scalars are all-reduced over every replica of every worker, so each rank reads the job's values.

Invariants:
    * Every bucket's rows divide by N (``check_rows``; ``buckets.batch_size`` is checked when the config
      loads), so every replica gets the same shapes and one program serves them all.
    * The contract (consumer/README.md, "Plugging in your own step"): a step returns, on each replica,
      its share of every named scalar (normalised by the GLOBAL count, ``model.global_sum``), so the
      sum over replicas equals one replica's value on the whole batch; Keras optimizers sum gradients
      over replicas. The reference model keeps this contract.
    * Mirrored variables read and write as one value outside ``strategy.run`` (warm-up's snapshot and
      restore, checkpoints), so checkpoints are the same with 1 or N replicas.
    * XLA on logical CPU devices: TensorFlow's MirroredStrategy updates every replica's variables from
      one thread there (a merge_call), which XLA cannot compile across devices; ``jit_compile: auto``
      then falls back to graph mode with that reason, ``true`` fails (step.py). On GPUs every replica
      updates its own copy inside its XLA program. Under ``MultiWorkerMirroredStrategy`` on CPU devices
      TensorFlow has no XLA collectives ("Collectives are not yet implemented for CPU devices when
      compiling with XLA", after which the process aborted when tried here): the same fallback, before trying.
Shutdown: nothing to release; the strategy lives as long as the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import tensorflow as tf

from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError

__all__ = ["Replicas", "XlaUnavailable", "check_rows", "replica_scope"]

log = logging.getLogger(__name__)

_Shapes = tuple[tuple[int, ...], ...]   # the four batch shapes in argument order (step.py)
ReplicaFn = Callable[..., dict[str, tf.Tensor]]


def check_rows(bucket_rows: Sequence[int], replicas: int, cfg: PipelineConfig) -> None:
    """Every bucket's batch rows must divide by ``replicas`` (frame_budget buckets differ in rows).

    Raises:
        ConfigError: naming ``buckets.frame_budget`` (or ``buckets.batch_size``) and the first bucket
            whose rows do not divide.
    """
    for index, rows in enumerate(bucket_rows):
        if rows % replicas:
            key = "frame_budget" if cfg.buckets.frame_budget is not None else "batch_size"
            raise ConfigError(f"bucket {index} has {rows} rows, which do not divide by the {replicas} model "
                              "replicas (consumer.replicas, consumer.model_gpu)", path=("buckets", key),
                              got=getattr(cfg.buckets, key))


class XlaUnavailable(RuntimeError):
    """XLA cannot compile this mirrored step (logical CPU devices); "auto" falls back to graph mode."""


class Replicas:
    """A MirroredStrategy over ``devices`` and the programs that run the step on each of them."""

    def __init__(self, devices: Sequence[str], strategy: Any = None) -> None:
        """``strategy``: a job's ``MultiWorkerMirroredStrategy`` over this worker's ``devices``; None = a
        ``MirroredStrategy`` over ``devices`` (at least 2)."""
        if strategy is None and len(devices) < 2:
            raise ValueError(f"need at least 2 devices, got {list(devices)}")
        self.devices = list(devices)
        self.multi_worker = strategy is not None
        self.strategy = strategy if strategy is not None else tf.distribute.MirroredStrategy(self.devices)
        log.info("replicas: %d on %s (%s)", len(self.devices), ", ".join(self.devices),
                 f"MultiWorkerMirroredStrategy, {self.strategy.num_replicas_in_sync} in the job" if self.multi_worker
                 else "MirroredStrategy")

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def on_gpus(self) -> bool:
        return all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in self.devices)

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> Replicas | None:
        """The replicas ``cfg`` asks for, on the devices TensorFlow sees; None for one replica.

        Raises:
            ConfigError: more replicas than visible GPUs, or (no GPU) the CPU was not split in time.
        """
        n = cfg.consumer.replica_count
        if n == 1:
            return None
        gpus = tf.config.list_logical_devices("GPU")
        where = f"consumer.model_gpu={cfg.consumer.model_gpu}"
        if gpus:
            if len(gpus) < n:
                raise ConfigError(f"{n} replicas, but TensorFlow sees {len(gpus)} GPU(s) ({where})",
                                  path=("consumer", "replicas"), got=n)
            return cls([g.name for g in gpus[:n]])
        cpus = tf.config.list_logical_devices("CPU")
        if len(cpus) < n:
            raise ConfigError(f"{n} replicas on the CPU need {n} logical CPU devices, TensorFlow has {len(cpus)}: "
                              "call melfeed.consumer.placement.configure_memory(cfg) right after importing TensorFlow",
                              path=("consumer", "replicas"), got=n)
        return cls([c.name for c in cpus[:n]])

    @classmethod
    def for_job(cls, strategy: Any, cfg: PipelineConfig) -> Replicas:
        """This worker's share of a job's ``MultiWorkerMirroredStrategy``: its local devices.

        Raises:
            ConfigError: ``consumer.replicas`` differs from the strategy's local devices (on the CPU the
                strategy uses one device per worker).
        """
        devices = [str(d) for d in strategy.extended.worker_devices]
        n = cfg.consumer.replica_count
        if n != len(devices):
            raise ConfigError(f"{n} replicas per worker, but MultiWorkerMirroredStrategy runs on {len(devices)} local "
                              f"device(s) here ({', '.join(devices)}): every visible GPU, else one CPU device",
                              path=("consumer", "replicas"), got=n)
        return cls(devices, strategy)

    def scope(self) -> Any:
        """Build the step (every variable) in here: ``with replicas.scope(): step = factory(spec)``."""
        return self.strategy.scope()

    def program(self, replica_fn: ReplicaFn, key: _Shapes, dtypes: Sequence[tf.DType], names: Sequence[str], *,
                jit_compile: bool, on_trace: Callable[[], None]) -> Callable[..., dict[str, tf.Tensor]]:
        """One bucket's program: full-batch tensors in (``key``'s shapes), summed named scalars out.

        ``replica_fn(mel, mel_len, tokens, tok_len)`` runs on each replica's rows (compiled with
        ``jit_compile``); ``on_trace`` runs once per trace of the whole program (step.py counts them).
        """
        n = self.count
        if jit_compile and not self.on_gpus and self.multi_worker:
            raise XlaUnavailable("XLA cannot compile MultiWorkerMirroredStrategy's collectives on CPU devices "
                                 "(TensorFlow: collectives are not yet implemented for CPU devices when compiling "
                                 "with XLA)")
        if jit_compile and not self.on_gpus:
            raise XlaUnavailable("XLA cannot compile a mirrored step on logical CPU devices: TensorFlow's "
                                 "MirroredStrategy updates every replica's variables from one program there")
        if jit_compile:   # TensorFlow runs an XLA tf.function once per GPU replica, with collectives inside
            part = [tf.TensorSpec((shape[0] // n, *shape[1:]), dtype, name=name)
                    for shape, dtype, name in zip(key, dtypes, names)]
            per_replica_fn: ReplicaFn = tf.function(replica_fn, jit_compile=True, input_signature=part)
        else:             # graph mode: traced into the program below, once per replica
            per_replica_fn = replica_fn
        strategy = self.strategy

        def whole(*args: tf.Tensor) -> dict[str, tf.Tensor]:
            on_trace()
            parts = [tf.split(arg, n, axis=0) for arg in args]   # row views; see the module docstring
            values = strategy.experimental_distribute_values_from_function(
                lambda ctx: tuple(p[ctx.replica_id_in_sync_group % n] for p in parts))   # the local replica
            per_replica = strategy.run(per_replica_fn, args=values)
            return {name: strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                    for name, value in per_replica.items()}

        full = [tf.TensorSpec(shape, dtype, name=name) for shape, dtype, name in zip(key, dtypes, names)]
        return tf.function(whole, input_signature=full)


def replica_scope(replicas: Replicas | None) -> Any:
    """``replicas.scope()``, or a no-op for one replica."""
    return replicas.scope() if replicas is not None else nullcontext()

