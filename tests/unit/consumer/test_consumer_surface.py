"""``Consumer``'s public surface is exactly the library's names: adding one is a reviewed decision.

Everything the built-in loop, the app, bench, doctor, ``Stager`` and ``as_dataset()`` need beyond these is
private (``_``-prefixed attributes, and the hand-out desk, consumer/handout.py).
"""

from __future__ import annotations

from pathlib import Path

from melfeed.consumer.feed import Consumer
from melfeed.consumer.handout import HandoutDesk
from melfeed.shared.config.loader import config_from_mapping

PUBLIC_NAMES = [
    "applied",
    "applied_ids",
    "array_schema",
    "as_dataset",
    "batches",
    "batches_per_epoch",
    "bucket_shapes",
    "close",
    "extras",
    "manifest",
    "next_batch",
    "plan",
    "release",
    "slot_buffers",
    "start",
]


def _public(names: list[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith("_"))


def test_the_class_offers_exactly_the_library_names() -> None:
    assert _public(dir(Consumer)) == PUBLIC_NAMES


def test_an_instance_adds_no_public_attribute_and_keeps_its_hand_out_desk_private(demo_cache: Path) -> None:
    feed = Consumer(config_from_mapping({"cache_dir": str(demo_cache), "transport": {"mode": "zmq"}}))
    try:
        assert _public(dir(feed)) == PUBLIC_NAMES and _public(list(vars(feed))) == []
        assert isinstance(feed._desk, HandoutDesk)
    finally:
        feed.close()
