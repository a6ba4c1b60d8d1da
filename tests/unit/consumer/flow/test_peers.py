"""Peer table: fair lease order, silence detection, flood blocking, printable names."""

from __future__ import annotations

from melfeed.consumer.flow.peers import PeerTable


class _Held:
    def __init__(self, held: dict[bytes, int]) -> None:
        self.held = held

    def held_by(self, peer: bytes) -> int:
        return self.held.get(peer, 0)


def test_equally_loaded_producers_take_turns() -> None:
    table = PeerTable()
    table.add(b"a", "producer-1", now_s=0.0, nonce=1)
    table.add(b"b", "producer-2", now_s=1.0, nonce=2)
    book = _Held({})
    order = []
    for t in range(4):  # the receiver grants to the first peer, then stamps it
        first = table.by_fewest_leases(book)[0]
        table.get(first).last_grant_s = 10.0 + t  # type: ignore[union-attr]
        order.append(first)
    assert order == [b"a", b"b", b"a", b"b"]
    assert table.by_fewest_leases(_Held({b"a": 0, b"b": 2}))[0] == b"a"  # load first, then turn


def test_silence_and_blocking_are_time_bounded() -> None:
    table = PeerTable()
    table.add(b"a", "producer-1", now_s=0.0, nonce=1)
    assert table.silent_since(-1.0) == [] and table.silent_since(1.0) == [b"a"]
    table.block(b"x", until_s=5.0)
    assert table.is_blocked(b"x", 4.9) and not table.is_blocked(b"x", 5.0)


def test_unknown_binary_routing_ids_are_named_in_hex() -> None:
    table = PeerTable()
    assert table.name(b"\x00\x9f\x01") == "0x009f01"
    assert table.name(b"producer-7-123") == "producer-7-123"
