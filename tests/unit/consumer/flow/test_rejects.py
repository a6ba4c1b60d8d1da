"""Reject bookkeeping: per-code and per-peer counts, bounded peer table, flood window, log rate limit."""

from __future__ import annotations

import logging

import pytest

from melfeed.consumer.flow.rejects import RejectLog, peer_label
from melfeed.shared.wire.protocol import RejectCode


def test_rejects_are_counted_per_code_and_per_peer_and_snapshots_are_copies() -> None:
    rl = RejectLog()
    rl.record("a", RejectCode.DECODE, "x", 0.0)
    rl.record("a", RejectCode.SCHEMA, "x", 0.0)
    rl.record("b", RejectCode.DECODE, "x", 0.0)
    rl.ignore("c")
    codes, peers = rl.snapshot(), rl.peer_snapshot()
    assert codes == {RejectCode.DECODE: 2, RejectCode.SCHEMA: 1, RejectCode.FLOOD: 1}
    assert peers == {"a": 2, "b": 1, "c": 1}
    assert rl.total == 4
    rl.record("a", RejectCode.DECODE, "x", 0.0)
    assert codes[RejectCode.DECODE] == 2 and peers["a"] == 2  # earlier snapshots unchanged


def test_per_peer_counters_keep_only_the_most_recently_rejected_peers() -> None:
    rl = RejectLog(max_peers=3)
    for peer in ("p0", "p1", "p2"):
        rl.record(peer, RejectCode.DECODE, "x", 0.0)
    rl.record("p0", RejectCode.DECODE, "x", 0.0)  # p0 is now the most recent
    for i in range(3, 300):  # a client cycling routing ids
        rl.record(f"p{i}", RejectCode.DECODE, "x", 0.0)
        assert len(rl.peer_snapshot()) <= 3
    assert rl.peer_snapshot() == {"p297": 1, "p298": 1, "p299": 1}
    assert rl.snapshot() == {RejectCode.DECODE: 301}  # per-code totals stay exact
    rl = RejectLog(max_peers=2)
    rl.record("a", RejectCode.DECODE, "x", 0.0)
    rl.record("b", RejectCode.DECODE, "x", 0.0)
    rl.record("a", RejectCode.DECODE, "x", 0.0)
    rl.record("c", RejectCode.DECODE, "x", 0.0)  # evicts b, the least recent
    assert rl.peer_snapshot() == {"a": 2, "c": 1}


def test_flooding_is_more_than_the_limit_within_the_window_per_peer() -> None:
    rl = RejectLog(flood_limit=3, flood_window_s=10.0)
    assert [rl.record("a", "DECODE", "x", t) for t in (0.0, 1.0, 2.0)] == [False] * 3
    assert not rl.record("b", "DECODE", "x", 2.5)  # other peers have their own window
    assert rl.record("a", "DECODE", "x", 3.0)  # 4 within 10 s
    assert not rl.record("c", "DECODE", "x", 3.0)
    rl = RejectLog(flood_limit=3, flood_window_s=10.0)
    for t in (0.0, 5.0, 10.5, 15.6, 21.0):  # never 4 within any 10 s
        assert not rl.record("a", "DECODE", "x", t)


def test_an_evicted_peer_starts_a_fresh_flood_window() -> None:
    rl = RejectLog(flood_limit=2, max_peers=1)
    rl.record("a", "DECODE", "x", 0.0)
    rl.record("a", "DECODE", "x", 0.0)
    rl.record("b", "DECODE", "x", 0.0)  # evicts a's window
    assert not rl.record("a", "DECODE", "x", 0.0)
    assert not rl.record("a", "DECODE", "x", 0.0)
    assert rl.record("a", "DECODE", "x", 0.0)


def test_logs_at_most_one_warning_per_code_per_interval_and_says_how_many_were_suppressed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rl = RejectLog(log_interval_s=5.0)
    with caplog.at_level(logging.WARNING, logger="melfeed.consumer.flow.rejects"):
        for i in range(100):
            rl.record("a", RejectCode.DECODE, "bad", i * 0.01)  # 1 s of rejects
        rl.record("a", RejectCode.SCHEMA, "bad", 1.0)  # another code logs at once
        for _ in range(10):
            rl.ignore("a")  # ignored messages never log
        rl.record("a", RejectCode.DECODE, "bad", 5.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "code=DECODE" in lines[0] and "suppressed" not in lines[0]
    assert "code=SCHEMA" in lines[1]
    assert "code=DECODE" in lines[2] and "(+99 similar suppressed)" in lines[2]
    assert all("peer=a" in line for line in lines)


def test_peer_labels_are_printable_and_never_shared_by_two_routing_ids() -> None:
    assert peer_label(b"producer-3-4711") == "producer-3-4711"
    assert peer_label(b"\x00\x9f\x01") == "0x009f01"
    assert peer_label(b"A") == "A" and peer_label(b"0x41") == "0x30783431"  # not "0x41" == b"A" in hex
    assert peer_label(b"a\nb") == "0x610a62"  # no log injection
    assert peer_label(b"") == "0x"
    ids = [b"A", b"0x41", b"\x41", b"\x00A", b"0x0041", b"", b"0x"]
    assert len({peer_label(i) for i in set(ids)}) == len(set(ids))


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RejectLog(flood_limit=0)
    with pytest.raises(ValueError):
        RejectLog(max_peers=0)
