"""The data GPU as a model replica, or not, from hand-made supply and demand figures."""

from __future__ import annotations

from melfeed.consumer.doctor.arrangement import advise_data_gpu
from melfeed.consumer.doctor.verdict import Bound


def test_an_idle_data_gpu_becomes_a_replica_when_supply_covers_twice_the_demand_with_headroom() -> None:
    a = advise_data_gpu("0", "1", ["0"], ["1"], supply_per_s=250.0, demand_per_s=100.0, bound=Bound.STEP)
    assert [(c.key, c.old, c.new) for c in a.changes] == [
        ("consumer.model_gpu", "0", "0,1"),
        ("producer.data_gpu", "1", '""'),
    ]
    assert "2.50 x the step's demand 100.0" in a.changes[0].reason and "do no GPU work" in a.changes[0].reason
    assert a.notes == []


def test_supply_below_twice_the_demand_keeps_one_model_gpu_and_says_why() -> None:
    a = advise_data_gpu("0", "1", ["0"], ["1"], supply_per_s=239.0, demand_per_s=100.0, bound=Bound.STEP)
    assert a.changes == [] and len(a.notes) == 1
    assert "2.39 x" in a.notes[0] and "below the 2.4 x" in a.notes[0]


def test_a_data_bound_run_never_gets_a_second_replica() -> None:
    a = advise_data_gpu("0", "1", ["0"], ["1"], supply_per_s=50.0, demand_per_s=100.0, bound=Bound.PRODUCERS)
    assert a.changes == [] and "only wait for data" in a.notes[0]


def test_no_advice_without_a_data_gpu_without_nvml_or_when_it_is_a_model_gpu_already() -> None:
    for args in [("0", "", ["0"], []), ("0", "1", None, None), ("0,1", "1", ["0", "1"], ["1"])]:
        a = advise_data_gpu(*args, supply_per_s=500.0, demand_per_s=100.0, bound=Bound.STEP)
        assert a.changes == [] and a.notes == [], args


def test_an_inherited_model_gpu_lists_the_gpus_the_consumer_sees_but_the_data_gpu() -> None:
    a = advise_data_gpu(None, "1", ["0", "1"], ["1"], supply_per_s=300.0, demand_per_s=100.0, bound=Bound.STEP)
    assert (a.changes[0].old, a.changes[0].new) == ("None", "0,1")
