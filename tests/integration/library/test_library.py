"""The consumer as a library with real producers: Keras ``fit`` on ``as_dataset()`` and a user's own loop.

Exactly once on the library path (docs/guide/your-model.md, "A loop of your own"): every batch id of the plan is
applied once,
in order, across several ``fit`` calls on one dataset and across a loop that breaks out and resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from melfeed.consumer import Consumer
from melfeed.consumer.feed_board import FeedBoard
from melfeed.consumer.flow.ring import SlotState
from melfeed.shared.config.loader import config_from_mapping, with_overrides
from tests.conftest import ProducerGroup

_ALL_FEATURES = ("tokens", "tok_len", "mel_len", "frames", "batch_id", "rows", "row_mask")


def _cfg(cache: Path, endpoint: str, steps: int) -> Any:
    return config_from_mapping(
        {
            "cache_dir": str(cache),
            "consumer": {"steps": steps, "wait_timeout_s": 0.5},
            "transport": {"endpoint": endpoint, "heartbeat_interval_s": 0.2},
        }
    )


def _tiny_model() -> Any:
    """Tokens -> one spectrum per utterance, repeated over the bucket's ``frames``; records the batch ids it trained
    on."""
    import keras
    import tensorflow as tf

    class Tiny(keras.Model):  # type: ignore[misc]  # Keras is untyped
        def __init__(self) -> None:
            super().__init__()
            self.embed = keras.layers.Embedding(64, 8)
            self.out = keras.layers.Dense(80)
            self.seen: list[int] = []

        def call(self, x: dict[str, Any]) -> Any:
            h = self.out(tf.reduce_mean(self.embed(x["tokens"]), axis=1))  # [B, 80]
            return tf.repeat(h[:, None, :], x["frames"][0], axis=1)  # [B, T, 80]

        def train_step(self, data: Any) -> Any:
            self.seen.append(int(data[0]["batch_id"][0]))  # run_eagerly: plain Python
            return super().train_step(data)

    model = Tiny()
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    return model


def test_two_keras_fits_on_one_dataset_apply_every_batch_once_in_plan_order(
    demo_cache: Path, endpoint: str, producers: ProducerGroup, tmp_path: Path
) -> None:
    steps = 18  # > 2 epochs of the 200-utterance cache (8 batches each)
    cfg = with_overrides(_cfg(demo_cache, endpoint, steps), {"consumer.warmup_steps": 0})  # FeedBoard: every batch
    with Consumer(cfg) as feed:
        producers.start(demo_cache, endpoint, 1)
        ds = feed.as_dataset(features=_ALL_FEATURES)
        model = _tiny_model()
        model.fit(ds, steps_per_epoch=4, epochs=1, verbose=0, shuffle=False)
        assert feed.applied_ids == model.seen == [0, 1, 2, 3]
        board = FeedBoard(feed, tmp_path / "logs", every_steps=2)  # beside keras.callbacks.TensorBoard(logs)
        callback = board.callback()
        model.fit(ds, steps_per_epoch=3, epochs=2, verbose=0, shuffle=False, callbacks=[callback])
        assert feed.applied_ids == model.seen == list(range(10))
        _check_feed_board(tmp_path / "logs" / "feed", callback)
        assert feed._ring.counts()[SlotState.IN_STEP] <= 1  # the last element of the last fit, at most
        rest = [batch.batch_id for batch in feed.batches()]  # the plan goes on where fit stopped
        assert feed._ring.counts()[SlotState.IN_STEP] == 0  # ... and its slot went back to the ring
    assert rest == list(range(10, steps))
    assert feed.applied_ids == list(range(steps)) and feed.applied == steps


def _check_feed_board(logdir: Path, callback: Any) -> None:
    """Batches 4..9 in two epochs: written every 2 batches (global steps 6, 8) and at the end (9: the last batch
    begun is not recorded); the feed figures only, read back as TensorBoard's scalar plugin reads them."""
    from tests.board_events import read_scalars

    scalars = read_scalars(logdir)
    assert [step for step, _ in scalars["feed/batches_per_s"]] == [6, 8, 9]
    assert all(v > 0 for _, v in scalars["feed/samples_per_s"]) and 0 < scalars["feed/padding_efficiency"][-1][1] <= 1
    assert {"feed/stall_pct", "feed/queue_depth"} <= set(scalars) and any(t.startswith("producer/") for t in scalars)
    assert not [tag for tag in scalars if tag.startswith("train/")] and "feed/feed_efficiency" not in scalars
    assert "on_train_batch_end" not in type(callback).__dict__  # Keras reads no logs per batch for it


def test_an_element_taken_from_the_dataset_is_applied_and_nothing_is_read_ahead(
    demo_cache: Path, endpoint: str, producers: ProducerGroup
) -> None:
    with Consumer(_cfg(demo_cache, endpoint, 8)) as feed:
        producers.start(demo_cache, endpoint, 1)
        it = iter(feed.as_dataset(features=_ALL_FEATURES))
        feats, mel = next(it)
        while not feed._ring.ready_ids():  # producers fill the ring behind it (bounded wait: pytest timeout)
            pass
        assert feed.applied_ids == [0] and feed._desk.next_id == 1
        first = float(mel[0, 0, 0])  # zero copy: writing the slot shows through the tensor
        slots = [feed._ring.memory.buffer(i)[:4].view(np.float32) for i in range(feed._ring.n_slots)]
        held = [s for s in slots if s[0] == first]  # mel is the slot's first array
        assert held
        held[0][0] = first + 1.0  # stored as float32
        assert float(mel[0, 0, 0]) == float(np.float32(first + 1.0))
        bucket = feed.bucket_shapes[feed.plan.batch(0).bucket]
        assert tuple(mel.shape) == bucket["mel"]
        assert feats["frames"].numpy().tolist() == [bucket["mel"][1]] * bucket["mel"][0]
        assert feats["batch_id"].numpy().tolist() == [0] * bucket["mel"][0]
        del it  # dropped: its slot goes back, batch 0 stays applied
        elements = [
            (int(f["batch_id"][0]), int(f["rows"]), f["row_mask"].numpy().tolist())
            for f, _ in feed.as_dataset(features=_ALL_FEATURES)
        ]
        planned = [feed.plan.batch(i) for i in range(1, 8)]
        sizes = [feed.bucket_shapes[b.bucket]["mel"][0] for b in planned]
    assert [e[0] for e in elements] == list(range(1, 8))
    assert [e[1] for e in elements] == [len(b.sample_ids) for b in planned]  # the plan's real rows ...
    assert [e[2] for e in elements] == [[i < len(b.sample_ids) for i in range(n)] for b, n in zip(planned, sizes)]
    assert any(len(b.sample_ids) < n for b, n in zip(planned, sizes))  # ... partial batches included


def test_a_loop_that_breaks_out_gets_its_unstepped_batch_first_when_it_resumes(
    demo_cache: Path, endpoint: str, producers: ProducerGroup
) -> None:
    steps = 12
    stepped: list[int] = []
    with Consumer(_cfg(demo_cache, endpoint, steps)) as feed:
        producers.start(demo_cache, endpoint, 1)
        for batch in feed.batches():
            if len(stepped) == 5:
                held = batch.batch_id
                break  # batch 5 was handed out but not stepped
            stepped.append(batch.batch_id)
        assert held == 5 and feed.applied_ids == [0, 1, 2, 3, 4]
        for batch in feed.batches():  # resume: batch 5 first, then the rest of the plan
            stepped.append(batch.batch_id)
            assert batch.utterance_ids == tuple(feed.manifest.utterances[i].id for i in batch.sample_ids)
    assert stepped == list(range(steps))
    assert feed.applied_ids == list(range(steps))


def test_a_newer_iterator_takes_over_the_batch_an_older_one_holds(
    demo_cache: Path, endpoint: str, producers: ProducerGroup
) -> None:
    with Consumer(_cfg(demo_cache, endpoint, 6)) as feed:
        producers.start(demo_cache, endpoint, 1)
        old = feed.batches()
        assert next(old).batch_id == 0
        new = feed.batches()
        assert next(new).batch_id == 0  # handed out again: the old loop never consumed it
        with pytest.raises(RuntimeError, match="superseded"):
            next(old)
        assert [b.batch_id for b in new] == [1, 2, 3, 4, 5]
    assert feed.applied_ids == list(range(6))


def test_shapes_schema_and_epoch_length_are_known_before_start(demo_cache: Path, endpoint: str) -> None:
    feed = Consumer(_cfg(demo_cache, endpoint, 1))
    try:
        shapes = feed.bucket_shapes
        assert len(shapes) == len(feed._bucket_set.buckets) >= 1
        members = [int((feed._bucket_set.assignment == b.index).sum()) for b in feed._bucket_set.buckets]
        assert feed.batches_per_epoch == sum(-(-n // b.batch_size) for n, b in zip(members, feed._bucket_set.buckets))
        schema = {spec.name: spec for spec in feed.array_schema}
        assert list(schema) == ["mel", "mel_len", "tokens", "tok_len"]
        assert schema["mel"].dtype == "float32" and schema["tokens"].dtype == "int32"
        assert schema["mel"].shapes == tuple(s["mel"] for s in shapes)
        assert all(s["mel"][2] == 80 for s in shapes)
    finally:
        feed.close()
