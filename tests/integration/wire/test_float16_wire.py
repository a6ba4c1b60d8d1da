"""``transport.mel_dtype: float16`` through both data paths, from float16 and float32 cache files.

A cache whose mels are half float16 files, half float32 files; a real producer process feeds a library
``Consumer`` over the shared-memory slots (read by ``batches()``, then by the Keras dataset) and over
ZeroMQ payload frames. Oracle: every batch, in plan order, holds each file's values as ``numpy.astype(float16)``
makes them (a float16 file as it is; the reference assembly, ``melfeed.shared.cache.batch_read``), bit for bit,
padded with zeros, every other array as on a float32 wire. A producer configured with the other
dtype is refused at the handshake with one line naming ``transport.mel_dtype`` and exits 78.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import yaml

from melfeed.consumer import Consumer
from melfeed.shared.cache.batch_read import read_batch
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest, write_manifest
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import EXIT_CONFIG
from tests import procs

_N = 24
_STEPS = 8  # > one epoch of 24 utterances in batches of 4 (6 batches)
_BASE = ("mel", "mel_len", "tokens", "tok_len")


@pytest.fixture(scope="module")
def mixed_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("half") / "cache"
    manifest = write_demo_cache(root, _N, n_mels=16)
    for i in range(0, _N, 2):  # every other mel stored as float16
        path = manifest.mel_path(i)
        np.save(path, np.load(path).astype(np.float16))
    full, problems = build_manifest(root, 16)
    assert problems == [] and {u.mel_dtype for u in full.utterances} == {"float16", "float32"}
    write_manifest(full)
    return root


def _mapping(cache: Path, endpoint: str, mode: str, mel_dtype: str = "float16") -> dict[str, Any]:
    return {
        "cache_dir": str(cache),
        "n_mels": 16,
        "buckets": {"num_buckets": 2, "batch_size": 4},
        "consumer": {"steps": _STEPS, "wait_timeout_s": 0.5},
        "transport": {"endpoint": endpoint, "heartbeat_interval_s": 0.2, "mode": mode, "mel_dtype": mel_dtype},
    }


def _expected(manifest: Manifest, bucket: Any, sample_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The batch as the schema says it must arrive: each file padded by its kind, padding rows zero."""
    shapes, dtypes = bucket.shapes(), bucket.dtypes()
    out = {k: np.zeros(shapes[k], dtypes[k]) for k in shapes}
    assert read_batch(manifest, sample_ids, out) == []  # the reference assembly (shared/cache/batch_read.py)
    return out


def test_float16_mels_arrive_bit_exact_in_plan_order_from_float16_and_float32_files(
    mixed_cache: Path, tmp_path: Path, transport_mode: str
) -> None:
    mapping = _mapping(mixed_cache, f"ipc://{tmp_path}/h.sock", transport_mode)
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump(mapping))
    got: list[tuple[int, dict[str, np.ndarray], int]] = []
    with Consumer(config_from_mapping(mapping)) as feed:
        assert [s.dtype for s in feed.array_schema][:1] == ["float16"]
        group = procs.start("producer", config, tmp_path / "producers.log", "--producers", "1")
        try:
            for batch in feed.batches():
                if transport_mode == "shm" and len(got) == 3:
                    break  # not applied: the dataset hands it out first
                got.append((batch.batch_id, {k: v.copy() for k, v in batch.arrays.items()}, batch.copies))
            if transport_mode == "shm":  # the Keras dataset's view of the slot: float16 mel too
                for features, mel in feed.as_dataset(features=_BASE[1:] + ("batch_id",), prefetch_device=None):
                    assert mel.dtype == tf.float16
                    arrays = {"mel": mel.numpy(), **{k: features[k].numpy() for k in _BASE[1:]}}
                    got.append((int(features["batch_id"][0]), {k: arrays[k] for k in _BASE}, 1))
        finally:
            procs.stop(group)
        manifest, plan, buckets = feed.manifest, feed.plan, feed._bucket_set.buckets
    assert [bid for bid, _, _ in got] == list(range(_STEPS))
    assert {copies for _, _, copies in got} == ({1} if transport_mode == "shm" else {4})
    for bid, arrays, _ in got:
        planned = plan.batch(bid)
        want = _expected(manifest, buckets[planned.bucket], planned.sample_ids)
        assert list(arrays) == list(want)
        for key, value in want.items():
            assert arrays[key].dtype == value.dtype and arrays[key].tobytes() == value.tobytes(), (bid, key)


def test_a_producer_with_the_other_mel_dtype_is_refused_in_one_line_and_exits_78(
    mixed_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"ipc://{tmp_path}/m.sock"
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump(_mapping(mixed_cache, endpoint, "auto", mel_dtype="float32")))
    log = tmp_path / "producers.log"
    with (
        caplog.at_level(logging.WARNING),
        Consumer(config_from_mapping(_mapping(mixed_cache, endpoint, "auto"))) as feed,
    ):
        group = procs.start("producer", config, log, "--producers", "1")
        try:
            assert group.wait(timeout=procs.WAIT_S) == EXIT_CONFIG, procs.tail(log)
        finally:
            procs.stop(group)
        assert feed._receiver.stats().rejects.get("CONTRACT", 0) >= 1 and feed.applied == 0
    refusal = [line for line in log.read_text().splitlines() if "consumer refused this producer" in line]
    assert refusal and refusal[0].endswith(
        "CONTRACT: transport.mel_dtype differs from the consumer's (see its log): producer 'float32'"
    ), procs.tail(log)
    assert any(
        "transport.mel_dtype differs: producer 'float32', consumer 'float16'" in r.getMessage() for r in caplog.records
    )
