"""A job's strategy over this worker's devices: the replica count must match, XLA on CPU falls back before trying."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import tensorflow as tf

from melfeed.consumer.train.replicas import Replicas, XlaUnavailable
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError

pytestmark = pytest.mark.tf

_CPU = "/job:worker/replica:0/task:1/device:CPU:0"


def _strategy() -> SimpleNamespace:
    """What ``Replicas`` reads of a MultiWorkerMirroredStrategy (a unit test: no cluster here)."""
    return SimpleNamespace(extended=SimpleNamespace(worker_devices=(_CPU,)), num_replicas_in_sync=2)


def test_a_cpu_worker_is_one_replica_and_more_is_refused_naming_the_key() -> None:
    replicas = Replicas.for_job(_strategy(), config_from_mapping({}))
    assert replicas.multi_worker and replicas.count == 1 and replicas.devices == [_CPU]
    with pytest.raises(
        ConfigError,
        match=r"consumer\.replicas: 2 replicas per worker, but MultiWorkerMirroredStrategy "
        r"runs on 1 local device\(s\) here",
    ):
        Replicas.for_job(_strategy(), config_from_mapping({"consumer": {"replicas": 2}}))


def test_xla_is_refused_before_any_compile_on_cpu_workers() -> None:
    replicas = Replicas.for_job(_strategy(), config_from_mapping({}))
    key = ((8, 4, 2), (8,), (8, 3), (8,))
    with pytest.raises(XlaUnavailable, match="XLA cannot compile MultiWorkerMirroredStrategy's collectives on CPU"):
        replicas.program(
            lambda *a: {},
            key,
            [tf.float32, tf.int32, tf.int32, tf.int32],
            ("mel", "mel_len", "tokens", "tok_len"),
            jit_compile=True,
            on_trace=lambda: None,
        )
