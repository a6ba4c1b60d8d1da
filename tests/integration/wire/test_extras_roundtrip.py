"""Extra arrays of every kind round-trip bit-exactly through both data paths, in plan order, under a kill.

A cache with the demo extras (speaker: utterance scalar, energy: frame) plus a token extra, an
utterance vector and a variable-length sequence; real producer processes (one SIGKILLed mid-run, its
launcher starts another) feed a library ``Consumer`` over the ZeroMQ payload path and the shared-memory
slots. Oracle: every batch, in plan order, equals what the reference assembly (``melfeed.shared.cache.batch_read``,
``pad_row``'s rule) makes of the files of the batch's planned samples -- every array, base and extra, byte for byte.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from melfeed.consumer import Consumer
from melfeed.consumer.dataset import feature_keys
from melfeed.shared.cache.batch_read import read_batch
from melfeed.shared.cache.demo_data import DEMO_EXTRAS, write_demo_cache
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest, write_manifest
from melfeed.shared.config.loader import config_from_mapping
from tests import procs

_N = 48
_STEPS = 14  # > one epoch of 48 utterances in batches of 4 (12 batches)
_KINDS = {**DEMO_EXTRAS, "duration": "token", "spk_emb": "utterance", "ref": "sequence"}


@pytest.fixture(scope="module")
def extras_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("extras") / "cache"
    manifest = write_demo_cache(root, _N, n_mels=16, extras=True)
    rng = np.random.default_rng(5)
    for name in ("duration", "spk_emb", "ref"):
        (root / "extras" / name).mkdir(parents=True)
    for u in manifest.utterances:
        np.save(root / "extras" / "duration" / f"{u.id}.npy", rng.integers(1, 9, u.tokens, dtype=np.int32))
        np.save(root / "extras" / "spk_emb" / f"{u.id}.npy", rng.standard_normal(3).astype(np.float32))
        np.save(
            root / "extras" / "ref" / f"{u.id}.npy",
            rng.standard_normal((int(rng.integers(1, 30)), 2)).astype(np.float16),
        )
    full, problems = build_manifest(root, 16, kinds=_KINDS)
    assert problems == [] and [c.spec.kind for c in full.extras] == [
        "token",
        "frame",
        "sequence",
        "utterance",
        "utterance",
    ]
    write_manifest(full)
    return root


def _expected(manifest: Manifest, bucket: Any, sample_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The batch as the schema says it must arrive: each file padded by its kind, padding rows zero."""
    shapes, dtypes = bucket.shapes(), bucket.dtypes()
    out = {k: np.zeros(shapes[k], dtypes[k]) for k in shapes}
    assert read_batch(manifest, sample_ids, out) == []  # the reference assembly (shared/cache/batch_read.py)
    return out


def _kill_one_worker(launcher: int) -> bool:
    workers = procs.child_pids(launcher)
    if workers:
        os.kill(workers[0], signal.SIGKILL)
    return bool(workers)


def test_extras_of_every_kind_arrive_bit_exact_in_plan_order_through_a_producer_kill(
    extras_cache: Path, tmp_path: Path, transport_mode: str
) -> None:
    endpoint = f"ipc://{tmp_path}/x.sock"
    mapping = {
        "cache_dir": str(extras_cache),
        "n_mels": 16,
        "buckets": {"num_buckets": 2, "batch_size": 4},
        "consumer": {"steps": _STEPS, "wait_timeout_s": 0.5},
        "producer": {"restart_backoff_s": 0.2},
        "transport": {
            "endpoint": endpoint,
            "heartbeat_interval_s": 0.2,
            "liveness_intervals": 5,
            "mode": transport_mode,
        },
    }
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump(mapping))
    cfg = config_from_mapping(mapping)
    log = tmp_path / "producers.log"
    got: list[tuple[int, dict[str, np.ndarray], int]] = []
    with Consumer(cfg) as feed:
        assert [s.name for s in feed.extras] == ["duration", "energy", "ref", "speaker", "spk_emb"]
        group = procs.start("producer", config, log, "--producers", "2", "--debug-delay-ms", "40")
        killed = False
        try:
            for batch in feed.batches():
                got.append((batch.batch_id, {k: v.copy() for k, v in batch.arrays.items()}, batch.copies))
                if not killed and len(got) == 3:
                    deadline = time.monotonic() + procs.WAIT_S
                    while not (killed := _kill_one_worker(group.pid)):
                        assert time.monotonic() < deadline, "no producer worker to kill"
                        time.sleep(0.05)
        finally:
            procs.stop(group)
        manifest, plan, buckets = feed.manifest, feed.plan, feed._bucket_set.buckets
    assert killed, procs.tail(log)
    assert [bid for bid, _, _ in got] == list(range(_STEPS))
    assert {copies for _, _, copies in got} == ({1} if transport_mode == "shm" else {4})
    for bid, arrays, _ in got:
        planned = plan.batch(bid)
        want = _expected(manifest, buckets[planned.bucket], planned.sample_ids)
        assert list(arrays) == list(want)
        for key, value in want.items():
            assert arrays[key].dtype == value.dtype and arrays[key].tobytes() == value.tobytes(), (bid, key)


@pytest.mark.parametrize("token_axis", ["bucket", "longest"])
def test_the_keras_dataset_cuts_every_extra_out_of_the_slot_bit_exact(
    extras_cache: Path, tmp_path: Path, token_axis: str
) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"
    steps = 6
    mapping = {
        "cache_dir": str(extras_cache),
        "n_mels": 16,
        "buckets": {"num_buckets": 2, "batch_size": 4},
        "consumer": {"steps": steps, "wait_timeout_s": 0.5},
        "transport": {"endpoint": endpoint, "heartbeat_interval_s": 0.2, "mode": "shm"},
    }
    config = tmp_path / "d.yaml"
    config.write_text(yaml.safe_dump(mapping))
    cfg = config_from_mapping(mapping)
    got: list[tuple[dict[str, np.ndarray], np.ndarray]] = []
    with Consumer(cfg) as feed:
        keys = feature_keys(feed)
        assert {"duration", "energy", "ref", "ref_len", "speaker", "spk_emb", "rows", "row_mask"} <= set(keys)
        if token_axis == "longest":  # the cut reads the lengths it needs even when features leaves them out
            keys = tuple(k for k in keys if k not in ("tok_len", "ref_len"))
        group = procs.start("producer", config, tmp_path / "p.log", "--producers", "1")
        try:
            for features, mel in feed.as_dataset(features=keys, prefetch_device=None, token_axis=token_axis):
                got.append(({k: v.numpy().copy() for k, v in features.items()}, mel.numpy().copy()))
        finally:
            procs.stop(group)
        manifest, plan, buckets = feed.manifest, feed.plan, feed._bucket_set.buckets
    assert [int(f["batch_id"][0]) for f, _ in got] == list(range(steps))
    narrowed = 0
    for features, mel in got:
        assert list(features) == list(keys)
        planned = plan.batch(int(features["batch_id"][0]))
        want = _expected(manifest, buckets[planned.bucket], planned.sample_ids)
        if token_axis == "longest":  # tokens and the token extra to max(tok_len), the sequence to max(ref_len)
            longest, ref_longest = int(want["tok_len"].max()), int(want["ref_len"].max())
            want = {
                **want,
                "tokens": want["tokens"][:, :longest],
                "duration": want["duration"][:, :longest],
                "ref": want["ref"][:, :ref_longest],
            }
            narrowed += longest < buckets[planned.bucket].shapes()["tokens"][1]
        assert mel.tobytes() == want["mel"].tobytes()
        for key in want:
            if key in keys and key != "mel":
                assert features[key].dtype == want[key].dtype and features[key].shape == want[key].shape, key
                assert features[key].tobytes() == want[key].tobytes(), key
        assert int(features["rows"]) == len(planned.sample_ids)
        assert features["row_mask"].tolist() == [r < len(planned.sample_ids) for r in range(len(mel))]
    assert token_axis == "bucket" or narrowed > 0  # some batch's longest row is narrower than its bucket
