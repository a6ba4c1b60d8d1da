"""The doctor's verdict with hand-made measurements: bound, exit code, producer count, changes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from melfeed.consumer.doctor.verdict import (
    Bound,
    ConfigFacts,
    Measurements,
    decide,
    memory_bound_bytes,
    weighted_ms,
)

# Two buckets, 3/4 of the batches in bucket 0: step 8 ms and 16 ms -> 10 ms weighted -> demand 100/s.
STEP_BOUND = Measurements(
    producers=2,
    build_ms_p50=10.0,
    read_ms_p50=6.0,
    build_rate_1=100.0,
    build_rate_n=190.0,
    delivered_1=80.0,
    delivered_n=150.0,
    h2d_ms=(0.5, 1.0),
    step_ms=(8.0, 16.0),
    mix=(0.75, 0.25),
)
FACTS = ConfigFacts(
    cores=8,
    producer_count=2,
    ring_slots=3,
    lease_window=2,
    largest_batch_bytes=9_000_000,
    padding=0.86,
    num_buckets=4,
    padding_alternatives=((5, 0.875), (6, 0.91), (8, 0.93)),
)


def test_weighted_ms_is_the_mix_weighted_mean() -> None:
    assert weighted_ms((8.0, 16.0), (0.75, 0.25)) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        weighted_ms((1.0,), (0.5, 0.5))


def test_memory_bound_is_ring_plus_lease_windows_times_largest_batch() -> None:
    assert memory_bound_bytes(3, 2, 2, 9_000_000) == (3 + 4) * 9_000_000


def test_step_bound_when_supply_beats_demand_by_twenty_percent() -> None:
    v = decide(STEP_BOUND, FACTS)
    assert v.demand_per_s == pytest.approx(100.0)
    assert v.supply_per_s == 150.0 >= 1.2 * v.demand_per_s
    assert (v.bound, v.exit_code) == (Bound.STEP, 0)
    # per-producer = min(100 built alone, 80 delivered) -> ceil(1.2 * 100 / 80) = 2: no producer change
    assert v.per_producer_per_s == 80.0 and v.producers_needed == 2
    assert [c.key for c in v.changes] == ["buckets.num_buckets"]


def test_the_bound_prints_and_serialises_as_its_words() -> None:
    v = decide(STEP_BOUND, FACTS)
    assert f"bound by {v.bound}" == f"bound by {Bound.STEP.value}"
    assert json.loads(json.dumps(dataclasses.asdict(v)))["bound"] == Bound.STEP.value


def test_supply_just_below_headroom_is_a_data_bound_exit_3() -> None:
    m = dataclasses.replace(STEP_BOUND, delivered_n=119.9, build_rate_n=125.0)
    v = decide(m, FACTS)
    assert (v.bound, v.exit_code) == (Bound.PRODUCERS, 3)


def test_slow_producers_name_the_producers_and_recommend_more_and_ring_slots() -> None:
    m = dataclasses.replace(
        STEP_BOUND, build_ms_p50=100.0, build_rate_1=10.0, build_rate_n=19.0, delivered_1=9.5, delivered_n=18.0
    )
    v = decide(m, FACTS)
    assert (v.bound, v.exit_code) == (Bound.PRODUCERS, 3)
    assert v.producers_needed == math.ceil(1.2 * 100.0 / 9.5) == 13
    assert v.producers_recommended == 8  # capped by the cores
    assert any("8 cores" in n and "13 producers" in n for n in v.notes)
    changes = {c.key: c for c in v.changes}
    assert (changes["producer.count"].old, changes["producer.count"].new) == ("2", "8")
    assert changes["consumer.ring_slots"].new == str(8 * 2 + 2)
    assert v.memory_bound_bytes == (18 + 8 * 2) * 9_000_000


def test_producers_that_build_fast_but_deliver_slowly_blame_transport() -> None:
    m = dataclasses.replace(STEP_BOUND, delivered_1=40.0, delivered_n=60.0, build_rate_n=190.0)
    facts = dataclasses.replace(FACTS, checksum=True, is_tcp=True)
    v = decide(m, facts)
    assert (v.bound, v.exit_code) == (Bound.TRANSPORT, 3)
    # one producer: 1000/40 = 25 ms per delivered batch, 10 ms of it building -> 15 ms transport
    assert v.transport_ms == pytest.approx(15.0)
    keys = [c.key for c in v.changes]
    assert "transport.checksum" in keys and "transport.endpoint" in keys


def test_slow_hand_off_with_enough_supply_names_host_to_device() -> None:
    m = dataclasses.replace(STEP_BOUND, h2d_ms=(12.0, 12.0))  # 83/s < 1.2 x 100
    v = decide(m, FACTS)
    assert (v.bound, v.exit_code) == (Bound.H2D, 3)


def test_too_many_producers_for_a_slow_step_recommends_fewer() -> None:
    m = dataclasses.replace(STEP_BOUND, step_ms=(100.0, 100.0))  # demand 10/s: 1 producer suffices
    v = decide(m, dataclasses.replace(FACTS, producer_count=4))
    assert v.bound == Bound.STEP and v.producers_needed == 1
    change = next(c for c in v.changes if c.key == "producer.count")
    assert (change.old, change.new) == ("4", "1")
    assert v.memory_bound_bytes == (3 + 1 * 2) * 9_000_000  # ring unchanged, 1 producer x window 2


def test_more_buckets_recommended_only_for_a_real_padding_gain_and_derived_boundaries() -> None:
    v = decide(STEP_BOUND, FACTS)
    change = next(c for c in v.changes if c.key == "buckets.num_buckets")
    # gain minus half a point per bucket: 6 -> 0.91 - 0.03, 8 -> 0.93 - 0.04: 8 wins
    assert change.new == "8 (padding 0.86 -> 0.93)" and "4 more compile(s)" in change.reason
    none_better = dataclasses.replace(FACTS, padding_alternatives=((5, 0.87),))
    assert not [c for c in decide(STEP_BOUND, none_better).changes if c.key == "buckets.num_buckets"]
    configured = dataclasses.replace(FACTS, num_buckets=None)
    assert not [c for c in decide(STEP_BOUND, configured).changes if c.key == "buckets.num_buckets"]
