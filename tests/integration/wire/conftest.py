"""Fixtures of the bad-input tests: one consumer and one good producer per test module, and bad peers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from melfeed.consumer.feed import Consumer
from tests.conftest import ProducerGroup
from tests.integration.wire.bad_peer import BadPeer, Reference, Stream, Wire, start_producer, wire_config


@pytest.fixture(scope="module")
def wire(demo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    tmp = tmp_path_factory.mktemp("wire")
    endpoint = f"ipc://{tmp}/melfeed.sock"
    group = ProducerGroup(tmp)
    ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
    consumer = Consumer(wire_config(demo_cache, endpoint))
    consumer.start()
    stream = Stream(consumer)
    try:
        start_producer(group, demo_cache, endpoint)
        w = Wire(consumer, stream, Reference(consumer), endpoint, ctx)
        stream.take_and_wait(5)  # the good producer is streaming
        yield w
        w.check_stream(0)
        assert w.stats().producers_alive == 1
    finally:
        stream.close()
        consumer.close()
        assert group.stop_all() == [0]
        ctx.term()


@pytest.fixture()
def attack(wire: Wire) -> Iterator[Callable[..., BadPeer]]:
    """Makes bad peers (closed afterwards); checks that the good producer never got a reject."""
    made: list[BadPeer] = []

    def make(tag: str, monitor_events: int = 0) -> BadPeer:
        made.append(wire.peer(tag, monitor_events))
        return made[-1]

    yield make
    for p in made:
        p.close()
    assert all(name.startswith("bad-") for name in wire.stats().rejects_by_peer)
