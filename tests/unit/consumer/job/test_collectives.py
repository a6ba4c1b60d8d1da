"""Which collective implementation a multi-worker job asks TensorFlow for, from the devices a worker sees."""

from __future__ import annotations

import pytest
import tensorflow as tf

from melfeed.consumer.job.cluster import collective_implementation

pytestmark = pytest.mark.tf


def test_workers_with_gpus_use_nccl_and_cpu_workers_use_ring() -> None:
    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    assert collective_implementation([gpu]) == "NCCL"
    assert collective_implementation([]) == "RING"


def test_each_choice_names_a_member_of_tensorflows_enum() -> None:
    members = tf.distribute.experimental.CommunicationImplementation.__members__
    assert {"NCCL", "RING"} <= set(members)
