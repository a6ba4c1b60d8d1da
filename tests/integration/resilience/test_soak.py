"""Soak: many tiny batches through a real pipeline; memory and file descriptors must stay flat.

The library ``Consumer`` (this process, no TensorFlow) takes ``MELFEED_SOAK_BATCHES`` batches of
4 rows from two real producer processes. After a warm-up that has touched every bucket shape many
times (so every ring slot, producer send buffer and ZeroMQ pipe exists), RSS and open fds of the
consumer and of each producer are sampled; at the end they must be within 10 % of that sample,
plus an absolute RSS slack (see ``_RSS_SLACK_KB``); only growth fails. The unmarked test is a
bounded CI version (3,000 batches); the ``slow`` one runs ``MELFEED_SOAK_BATCHES`` (default 20,000).
Measured here (2 cores): 20,000 batches in ~28 s; consumer RSS +0.6 MiB, producers +0-2.7 MiB.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from melfeed.consumer.feed import Consumer
from melfeed.shared.config.loader import config_from_mapping
from tests import procs
from tests.conftest import ProducerGroup

_BATCH_SIZE = 4
_PRODUCERS = 2
_CI_BATCHES = 3000  # ~5 s on 2 cores
_WARMUP_BATCHES = 500  # ~10 epochs of the demo cache: every bucket's buffers exist by then
# Slack on top of 10 %: pymalloc grows in 1 MiB arenas and glibc malloc keeps freed blocks in its
# arenas instead of returning them, so a process that leaks nothing still moves by a few MiB.
_RSS_SLACK_KB = 8 * 1024
_FD_SLACK = 2  # a ZeroMQ reconnect or a log rotation may hold one more for a moment


@dataclass(frozen=True)
class _Sample:
    rss_kb: dict[str, int]  # process -> VmRSS
    fds: dict[str, int]  # process -> open file descriptors


def _rss_kb(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _fds(pid: int | str) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _sample(producer_pids: list[int]) -> _Sample:
    pids: dict[str, int | str] = {"consumer": "self", **{f"producer-{p}": p for p in producer_pids}}
    return _Sample({k: _rss_kb(p) for k, p in pids.items()}, {k: _fds(p) for k, p in pids.items()})


def _soak(cache: Path, endpoint: str, group: ProducerGroup, n_batches: int) -> None:
    assert n_batches > 2 * _WARMUP_BATCHES
    cfg = config_from_mapping(
        {
            "cache_dir": str(cache),
            "buckets": {"batch_size": _BATCH_SIZE},
            "consumer": {"steps": n_batches, "wait_timeout_s": 0.5},
            "transport": {"endpoint": endpoint, "heartbeat_interval_s": 0.2},
        }
    )
    first: _Sample | None = None
    last: _Sample | None = None
    expected = 0
    t0 = time.monotonic()
    with Consumer(cfg) as consumer:
        launcher = group.start(cache, endpoint, _PRODUCERS, buckets={"batch_size": _BATCH_SIZE})
        workers: list[int] = []
        for batch in consumer.batches():
            assert batch.batch_id == expected  # once, in plan order
            expected += 1
            if expected == _WARMUP_BATCHES:
                workers = procs.child_pids(launcher.pid)
                assert len(workers) == _PRODUCERS
                first = _sample(workers)
            elif expected == n_batches - 1:  # before shutdown frees anything
                last = _sample(workers)
                assert procs.child_pids(launcher.pid) == workers  # no producer was restarted
        stats = consumer._receiver.stats()
    elapsed_s = time.monotonic() - t0
    assert group.stop_all() == [0]
    assert expected == n_batches and first is not None and last is not None
    assert stats.rejects == {} and stats.duplicates_dropped == 0 and stats.leases_reissued == 0
    report = f"{n_batches} batches in {elapsed_s:.1f} s; after warm-up {first}; at the end {last}"
    for name, rss in first.rss_kb.items():
        assert last.rss_kb[name] <= rss * 1.10 + _RSS_SLACK_KB, f"{name} RSS grew: {report}"
    for name, fds in first.fds.items():
        assert last.fds[name] <= fds * 1.10 + _FD_SLACK, f"{name} fds grew: {report}"


def test_soak_bounded_keeps_rss_and_fds_flat(demo_cache: Path, endpoint: str, producers: ProducerGroup) -> None:
    _soak(demo_cache, endpoint, producers, _CI_BATCHES)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_20000_batches_keeps_rss_and_fds_flat(demo_cache: Path, endpoint: str, producers: ProducerGroup) -> None:
    _soak(demo_cache, endpoint, producers, int(os.environ.get("MELFEED_SOAK_BATCHES", "20000")))
