"""Several model devices: the compiled step under ``MirroredStrategy`` (one host) or a job's
``MultiWorkerMirroredStrategy``.

Role: ``Replicas.from_config`` picks the devices (the first ``consumer.replicas`` visible GPUs, or as many
logical CPU devices, which ``melfeed.consumer.placement.configure_memory`` creates before TensorFlow initialises
its devices); ``scope()`` is where the step factory must run so every variable is mirrored;
``program`` builds the one program per bucket that ``CompiledStep`` (consumer/train/step.py) calls with
the full global batch, so the loop and its ``CompiledStep.run(bucket, batch)`` interface stay unchanged.

What the loop's call does (``run_parts``, inside the packed program of consumer/train/device/packed.py):
each replica's rows arrive already on its device, one uint8 piece per array per replica cut from the slot
by the hand-off (``PackedSteps.stage``; docs/design.md "The path of one batch" says which copies);
``strategy.run`` runs the step on each replica (its own ``tf.function``, XLA per ``model.jit_compile``)
on its pieces, and each named scalar is summed onto the first replica's device
(``strategy.extended.reduce_to``), where the output accumulators live: no per-step host reduce.
``program`` is the same step on a full-batch call (``CompiledStep.run``, warm-up, mode timing): it splits
each array along its rows (``tf.split``) and goes through the same reduce.

In a multi-worker job (``Replicas.for_job``, the strategy from consumer/job/cluster.py) the same program
runs under ``MultiWorkerMirroredStrategy``: N is this worker's local devices (its GPUs, or its one CPU
device), each worker splits its own rank's batch over them, and ``global_sum`` and the summed named
scalars are all-reduced over every replica of every worker, so each rank reads the job's values.

Invariants:
    * Every bucket's rows divide by N (``check_rows``; ``buckets.batch_size`` is checked when the config
      loads), so every replica gets the same shapes and one program serves them all.
    * The contract (docs/guide/your-model.md, "A step in the built-in loop"): a step returns, on each replica,
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

_Shapes = tuple[tuple[int, ...], ...]  # the four batch shapes in argument order (step.py)
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
            raise ConfigError(
                f"bucket {index} has {rows} rows, which do not divide by the {replicas} model "
                "replicas (consumer.replicas, consumer.model_gpu)",
                path=("buckets", key),
                got=getattr(cfg.buckets, key),
            )


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
        self._fns: dict[tuple[bool, _Shapes], ReplicaFn] = {}  # (jit_compile, full-batch shapes) -> replica fn
        log.info(
            "replicas: %d on %s (%s)",
            len(self.devices),
            ", ".join(self.devices),
            f"MultiWorkerMirroredStrategy, {self.strategy.num_replicas_in_sync} in the job"
            if self.multi_worker
            else "MirroredStrategy",
        )

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
                raise ConfigError(
                    f"{n} replicas, but TensorFlow sees {len(gpus)} GPU(s) ({where})",
                    path=("consumer", "replicas"),
                    got=n,
                )
            return cls([g.name for g in gpus[:n]])
        cpus = tf.config.list_logical_devices("CPU")
        if len(cpus) < n:
            raise ConfigError(
                f"{n} replicas on the CPU need {n} logical CPU devices, TensorFlow has {len(cpus)}: "
                "call melfeed.consumer.placement.configure_memory(cfg) right after importing TensorFlow",
                path=("consumer", "replicas"),
                got=n,
            )
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
            raise ConfigError(
                f"{n} replicas per worker, but MultiWorkerMirroredStrategy runs on {len(devices)} local "
                f"device(s) here ({', '.join(devices)}): every visible GPU, else one CPU device",
                path=("consumer", "replicas"),
                got=n,
            )
        return cls(devices, strategy)

    def scope(self) -> Any:
        """Build the step (every variable) in here: ``with replicas.scope(): step = factory(spec)``."""
        return self.strategy.scope()

    def program(
        self,
        replica_fn: ReplicaFn,
        key: _Shapes,
        dtypes: Sequence[tf.DType],
        names: Sequence[str],
        *,
        jit_compile: bool,
        on_trace: Callable[[], None],
    ) -> Callable[..., dict[str, tf.Tensor]]:
        """One bucket's program: full-batch tensors in (``key``'s shapes), summed named scalars out.

        ``replica_fn(mel, mel_len, tokens, tok_len)`` runs on each replica's rows (compiled with
        ``jit_compile``); ``on_trace`` runs once per trace of the whole program (step.py counts them).
        """
        n = self.count
        if jit_compile and not self.on_gpus and self.multi_worker:
            raise XlaUnavailable(
                "XLA cannot compile MultiWorkerMirroredStrategy's collectives on CPU devices "
                "(TensorFlow: collectives are not yet implemented for CPU devices when compiling "
                "with XLA)"
            )
        if jit_compile and not self.on_gpus:
            raise XlaUnavailable(
                "XLA cannot compile a mirrored step on logical CPU devices: TensorFlow's "
                "MirroredStrategy updates every replica's variables from one program there"
            )
        if jit_compile:  # TensorFlow runs an XLA tf.function once per GPU replica, with collectives inside
            part = [
                tf.TensorSpec((shape[0] // n, *shape[1:]), dtype, name=name)
                for shape, dtype, name in zip(key, dtypes, names)
            ]
            per_replica_fn: ReplicaFn = tf.function(replica_fn, jit_compile=True, input_signature=part)
        else:  # graph mode: traced into the program below, once per replica
            per_replica_fn = replica_fn
        self._fns[(jit_compile, tuple(key))] = per_replica_fn

        def whole(*args: tf.Tensor) -> dict[str, tf.Tensor]:
            on_trace()
            parts = [tf.split(arg, n, axis=0) for arg in args]  # row views of the full batch
            return self.run_parts(
                tuple(key), jit_compile, lambda pieces: list(pieces), [tuple(p[i] for p in parts) for i in range(n)]
            )

        full = [tf.TensorSpec(shape, dtype, name=name) for shape, dtype, name in zip(key, dtypes, names)]
        program: Callable[..., dict[str, tf.Tensor]] = tf.function(whole, input_signature=full)
        return program

    def distribute(self, parts: Sequence[tuple[Any, ...]]) -> Any:
        """``parts[i]`` (this worker's i-th replica's tensors) as the strategy's per-replica values (a tuple
        of ``PerReplica``); the values stay where they are (TensorFlow places nothing here)."""
        n = self.count
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: tuple(parts[ctx.replica_id_in_sync_group % n])
        )  # global id -> this worker's replica

    def run_parts(
        self,
        key: _Shapes,
        jit_compile: bool,
        cut: Callable[[Sequence[tf.Tensor]], list[tf.Tensor]],
        parts: Sequence[tuple[Any, ...]],
    ) -> dict[str, tf.Tensor]:
        """Traced: the step of ``key`` (built by ``program``) on each replica's ``parts``, ``cut`` into its
        arrays on its own device; each named scalar summed onto the first replica's device."""
        fn = self._fns[(jit_compile, key)]
        per_replica = self.strategy.run(lambda *pieces: fn(*cut(pieces)), args=self.distribute(parts))
        return {name: self._on_first(value) for name, value in per_replica.items()}

    def _on_first(self, value: Any) -> tf.Tensor:
        """The sum over every replica (of every worker in a job), on this worker's first replica's device."""
        reduced = self.strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, value, destinations=self.devices[0])
        return self.strategy.experimental_local_results(reduced)[0]


def replica_scope(replicas: Replicas | None) -> Any:
    """``replicas.scope()``, or a no-op for one replica."""
    return replicas.scope() if replicas is not None else nullcontext()
