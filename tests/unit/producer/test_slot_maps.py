"""Producer side of the shm path: slot files mapped (bounded cache) and batches built straight into them."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from consumer.flow.ring import BatchRing, slot_nbytes_for
from consumer.transport.shm_slots import ShmSlots
from producer.batcher import BatchAssembler
from producer.slot_maps import SlotMappings
from producer.reader import CacheReader
from shared.wire.buckets import build_buckets
from shared.config import BucketConfig
from shared.cache.demo_data import write_demo_cache
from shared.wire.protocol import ShmSlot


def test_a_batch_built_into_a_mapped_slot_is_what_the_consumer_sees_and_equals_a_payload_build(
        tmp_path: Path) -> None:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6)
    buckets = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=4))
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    slots = ShmSlots(shm_dir, 3, slot_nbytes_for(buckets.buckets), 5)
    ring = BatchRing(3, buckets.buckets, memory=slots)
    ring.views(1, 0)["mel"][:] = 9.0                     # a previous batch's bytes in the reused slot
    assembler = BatchAssembler(CacheReader(manifest), buckets, max_buffers=1)
    maps = SlotMappings(buckets, 4)
    target = maps.views(str(shm_dir), ShmSlot(slots.name(1), 1, 0), 0)
    built = assembler.build(3, 0, [0, 1, 2], target)     # one row short: a padding row
    assert built.buffer is None                          # no send buffer on this path
    payload = assembler.build(3, 0, [0, 1, 2])
    for key, arr in ring.views(1, 0).items():
        assert np.array_equal(arr, payload.arrays[key]), key
    assert not ring.views(1, 0)["mel"][3].any()
    slots.close()


def test_mappings_are_bounded_and_a_missing_file_raises_with_errno(tmp_path: Path) -> None:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6)
    buckets = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=4))
    slots = ShmSlots(tmp_path, 3, slot_nbytes_for(buckets.buckets), 5)
    maps = SlotMappings(buckets, 2)
    for gen in range(2):
        for slot in range(3):
            maps.views(str(tmp_path), ShmSlot(slots.name(slot), slot, gen), 0)
            assert len(maps) <= 2
        for slot in range(3):
            slots.retire(slot)
    with pytest.raises(OSError) as info:
        maps.views(str(tmp_path), ShmSlot("melfeed-1-1-s0-g0", 0, 0), 0)
    assert info.value.errno == errno.ENOENT
    slots.close()
