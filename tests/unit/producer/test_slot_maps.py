"""Producer side of the shm path: slot files mapped (bounded cache) and batches built straight into them,
and every file a consumer could name that is not its own slot file refused before a byte is written."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from melfeed.consumer.flow.ring import BatchRing, slot_nbytes_for
from melfeed.consumer.transport.shm_slots import ShmSlots
from melfeed.producer.batcher import BatchAssembler
from melfeed.producer.reader import CacheReader
from melfeed.producer.slot_maps import SlotMappings
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.config import BucketConfig
from melfeed.shared.wire.buckets import BucketSet, build_buckets
from melfeed.shared.wire.layout import slot_nbytes_for as slot_file_nbytes
from melfeed.shared.wire.protocol import ShmSlot


def test_a_batch_built_into_a_mapped_slot_is_what_the_consumer_sees_and_equals_a_payload_build(tmp_path: Path) -> None:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6)
    buckets = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=4))
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    slots = ShmSlots(shm_dir, 3, slot_nbytes_for(buckets.buckets), 5)
    ring = BatchRing(3, buckets.buckets, memory=slots)
    ring.views(1, 0)["mel"][:] = 9.0  # a previous batch's bytes in the reused slot
    assembler = BatchAssembler(CacheReader(manifest), buckets, max_buffers=1)
    maps = SlotMappings(buckets, 4, shm_dir=str(shm_dir), endpoint="ipc:///run/melfeed/melfeed.sock")
    target = maps.views(str(shm_dir), ShmSlot(slots.name(1), 1, 0), 0)
    built = assembler.build(3, 0, [0, 1, 2], target)  # one row short: a padding row
    assert built.buffer is None  # no send buffer on this path
    payload = assembler.build(3, 0, [0, 1, 2])
    for key, arr in ring.views(1, 0).items():
        assert np.array_equal(arr, payload.arrays[key]), key
    assert not ring.views(1, 0)["mel"][3].any()
    slots.close()


def test_mappings_are_bounded_and_a_missing_file_raises_with_errno(tmp_path: Path) -> None:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6)
    buckets = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=4))
    slots = ShmSlots(tmp_path, 3, slot_nbytes_for(buckets.buckets), 5)
    maps = SlotMappings(buckets, 2, shm_dir=str(tmp_path), endpoint=f"ipc://{tmp_path}/m.sock")
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


def test_learned_rows_lay_the_slots_out_as_the_consumer_sized_them(tmp_path: Path) -> None:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6)
    one_row = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=1))
    consumers = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=3))
    slots = ShmSlots(tmp_path, 2, slot_nbytes_for(consumers.buckets), 5)
    maps = SlotMappings(one_row, 4, shm_dir=str(tmp_path), endpoint=f"ipc://{tmp_path}/m.sock")
    with pytest.raises(OSError) as info:  # laid out for one row, the consumer's 3-row slot is another size
        maps.views(str(tmp_path), ShmSlot(slots.name(0), 0, 0), 0)
    assert info.value.errno == errno.EPERM
    maps.use_rows([3])
    assert maps.views(str(tmp_path), ShmSlot(slots.name(0), 0, 0), 0)["mel"].shape[0] == 3
    slots.close()


def test_a_learned_plan_lays_the_slots_out_as_the_consumer_sized_them(tmp_path: Path) -> None:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6)
    consumers = build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(max_shapes=2, batch_size=3))
    slots = ShmSlots(tmp_path, 2, slot_nbytes_for(consumers.buckets), 5)
    maps = SlotMappings(None, 4, shm_dir=str(tmp_path), endpoint=f"ipc://{tmp_path}/m.sock")  # no plan yet
    with pytest.raises(OSError) as info:  # no plan: no slot file is the right size
        maps.views(str(tmp_path), ShmSlot(slots.name(0), 0, 0), 0)
    assert info.value.errno == errno.EPERM
    maps.use_buckets(consumers.buckets)
    last = consumers.buckets[-1]
    views = maps.views(str(tmp_path), ShmSlot(slots.name(0), 0, 0), last.index)
    assert views["mel"].shape == (3, last.max_frames, 80) and views["tokens"].shape == (3, last.max_tokens)
    slots.close()


# --- trust: what a fake consumer could name instead of its own slot file --------------------------------------

NAME = "melfeed-4242-7-s0-g0"


def _buckets(tmp_path: Path) -> BucketSet:
    manifest = write_demo_cache(tmp_path / "cache", n_utterances=6)
    return build_buckets(manifest.frames, manifest.token_counts, 80, BucketConfig(num_buckets=1, batch_size=4))


def _precious(path: Path, nbytes: int) -> bytes:
    """A file of the victim's that a slot mapping must never write: one slot's size, mode 0600, ours."""
    data = os.urandom(nbytes)
    path.write_bytes(data)
    path.chmod(0o600)
    return data


def _hard_link(shm: Path, victim: Path) -> Path:
    os.link(victim, shm / NAME)
    return victim


def _symlink(shm: Path, victim: Path) -> Path:
    (shm / NAME).symlink_to(victim)
    return victim


def _other_owner(shm: Path, victim: Path) -> Path:
    os.chown(victim, 65534, 65534)
    return victim.rename(shm / NAME)


def _group_readable(shm: Path, victim: Path) -> Path:
    victim.chmod(0o640)
    return victim.rename(shm / NAME)


def _wrong_size(shm: Path, victim: Path) -> Path:
    with victim.open("ab") as f:
        f.write(b"x" * 4096)
    return victim.rename(shm / NAME)


@pytest.mark.parametrize(
    "plant, reason",
    [
        (_hard_link, "has 2 hard links"),
        (_symlink, "is a symbolic link"),
        (_other_owner, "owned by uid 65534"),
        (_group_readable, "has mode 0640"),
        (_wrong_size, "bytes, a slot file of these buckets"),
    ],
)
def test_a_slot_name_that_is_not_our_consumers_slot_file_is_refused_and_the_file_keeps_its_bytes(
    tmp_path: Path, plant: Callable[[Path, Path], Path], reason: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to uid 65534 needs root")
    buckets = _buckets(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir()
    _precious(tmp_path / "precious.bin", slot_file_nbytes(buckets.buckets))
    target = plant(shm, tmp_path / "precious.bin")
    before = target.read_bytes()  # as planted (_wrong_size grew it)
    maps = SlotMappings(buckets, 4, shm_dir=str(shm), endpoint="ipc:///run/melfeed/melfeed.sock")
    with pytest.raises(OSError) as info:
        maps.views(str(shm), ShmSlot(NAME, 0, 0), 0)
    assert info.value.errno == errno.EPERM and reason in str(info.value.strerror), info.value
    assert target.read_bytes() == before and len(maps) == 0


@pytest.mark.parametrize(
    "name, slot_gen",
    [
        ("precious.bin", (0, 0)),
        ("../precious.bin", (0, 0)),
        (f"{NAME}\n", (0, 0)),
        (f"{NAME}.bak", (0, 0)),
        (NAME, (1, 0)),
        (NAME, (0, 3)),  # the lease says another slot or generation
    ],
)
def test_a_name_that_is_not_the_leases_slot_file_name_is_refused_before_anything_is_opened(
    tmp_path: Path, name: str, slot_gen: tuple[int, int]
) -> None:
    buckets = _buckets(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir()
    before = _precious(shm / "precious.bin", slot_file_nbytes(buckets.buckets))
    maps = SlotMappings(buckets, 4, shm_dir=str(shm), endpoint="ipc:///run/melfeed/melfeed.sock")
    with pytest.raises(OSError) as info:
        maps.views(str(shm), ShmSlot(name, *slot_gen), 0)
    assert info.value.errno == errno.EPERM and "is not the slot file of slot" in str(info.value.strerror)
    assert (shm / "precious.bin").read_bytes() == before


def test_a_directory_other_than_the_one_we_derive_is_refused_even_holding_a_perfect_slot_file(tmp_path: Path) -> None:
    buckets = _buckets(tmp_path)
    ours, theirs = tmp_path / "shm", tmp_path / "elsewhere"
    ours.mkdir()
    theirs.mkdir()
    before = _precious(theirs / NAME, slot_file_nbytes(buckets.buckets))
    maps = SlotMappings(buckets, 4, shm_dir=str(ours), endpoint="ipc:///run/melfeed/melfeed.sock")
    with pytest.raises(OSError) as info:
        maps.views(str(theirs), ShmSlot(NAME, 0, 0), 0)
    assert info.value.errno == errno.EPERM
    assert f"directory {theirs} is not this producer's shared-memory directory {ours}" in str(info.value.strerror)
    assert (theirs / NAME).read_bytes() == before and len(maps) == 0


def test_the_same_directory_by_another_path_is_accepted_and_the_slot_file_is_mapped(tmp_path: Path) -> None:
    buckets = _buckets(tmp_path)
    ours = tmp_path / "shm"
    ours.mkdir()
    (tmp_path / "link").symlink_to(ours)  # resolved paths are compared, not strings
    before = _precious(ours / NAME, slot_file_nbytes(buckets.buckets))
    maps = SlotMappings(buckets, 4, shm_dir=str(tmp_path / "link"), endpoint="ipc:///run/melfeed/melfeed.sock")
    views = maps.views(f"{ours}/", ShmSlot(NAME, 0, 0), 0)
    views["mel_len"][...] = 7  # the mapping is the file (MAP_SHARED)
    assert len(maps) == 1 and (ours / NAME).read_bytes() != before
