"""``as_dataset`` with a read-ahead stage (``prefetch_device``; on a GPU "auto" copies one batch ahead to it):
only the batches the dataset's caller took are applied, across Keras ``fit`` calls and a dropped iterator.

Here the stage is a host prefetch (``prefetch_device="/CPU:0"``, no GPU in CI): the same accounting as the
device stage, which holds each batch read ahead unapplied until the caller takes it.
"""

from __future__ import annotations

import time
from pathlib import Path

from melfeed.consumer import Consumer
from tests.conftest import ProducerGroup
from tests.integration.library.test_library import _ALL_FEATURES, _cfg, _tiny_model

_WAIT_S = 60.0


def _wait_read_ahead(feed: Consumer, taken: int) -> None:
    """Until the stage has taken batch ``taken - 1`` from the ring (bounded)."""
    deadline = time.monotonic() + _WAIT_S
    while feed._desk.next_id < taken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert feed._desk.next_id >= taken, "the prefetch stage never read ahead"


def test_batches_read_ahead_but_not_taken_are_not_applied_and_come_back_first(
    demo_cache: Path, endpoint: str, producers: ProducerGroup
) -> None:
    steps = 14
    with Consumer(_cfg(demo_cache, endpoint, steps)) as feed:
        producers.start(demo_cache, endpoint, 1)
        ds = feed.as_dataset(features=_ALL_FEATURES, prefetch_device="/CPU:0")
        model = _tiny_model()
        model.fit(ds, steps_per_epoch=4, epochs=1, verbose=0, shuffle=False)
        _wait_read_ahead(feed, 5)  # batch 4 sits in the stage, not taken by Keras
        assert feed.applied_ids == model.seen == [0, 1, 2, 3]
        model.fit(ds, steps_per_epoch=3, epochs=1, verbose=0, shuffle=False)
        assert feed.applied_ids == model.seen == [0, 1, 2, 3, 4, 5, 6]
        it = iter(ds)
        feats, _ = next(it)
        assert int(feats["batch_id"][0]) == 7
        _wait_read_ahead(feed, 9)
        assert feed.applied_ids[-1] == 7
        del it  # dropped with batch 8 read ahead: it comes back first
        rest = [batch.batch_id for batch in feed.batches()]
    assert rest == list(range(8, steps))
    assert feed.applied_ids == list(range(steps))
