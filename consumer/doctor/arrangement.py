"""Which GPU arrangement the doctor's figures favour: the data GPU for producers, or as a model replica.

Role: pure arithmetic (no I/O) over the verdict's measured supply and demand and the GPU settings.
Producers reading a cache do no GPU work (``producer.data_gpu`` only pins them, see docs/guide/two-gpus.md),
so a data GPU idles. Giving it to the model as a second replica (``consumer.model_gpu``
lists both, consumer/train/replicas.py) can at most double the step rate; that only pays when the
measured supply covers that doubled demand with the usual headroom.
Invariants: advice only where NVML saw the data GPU and it is not a model GPU already; the one number
not measured is the factor 2 (the most a second replica can add), and the text says so.
Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from melfeed.consumer.doctor.verdict import HEADROOM, Bound, Change

__all__ = ["Arrangement", "advise_data_gpu"]

_MAX_GAIN = 2.0  # a second replica at most doubles the step rate (equal GPUs, perfect scaling)


@dataclass(frozen=True, slots=True)
class Arrangement:
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _entries(value: str | None) -> list[str]:
    return [e for e in (value or "").split(",") if e]


def advise_data_gpu(
    model_gpu: str | None,
    data_gpu: str,
    consumer_gpus: Sequence[str] | None,
    producer_gpus: Sequence[str] | None,
    supply_per_s: float,
    demand_per_s: float,
    bound: Bound,
) -> Arrangement:
    """The data GPU as a model replica, or why not, from the measured supply and demand.

    Args:
        model_gpu, data_gpu: ``consumer.model_gpu`` and ``producer.data_gpu``.
        consumer_gpus, producer_gpus: NVML indices each side sees (None: no NVML).
        supply_per_s, demand_per_s, bound: the verdict's delivered batches/s, the step's batches/s, its bound.
    """
    data = _entries(data_gpu)
    if not data or not producer_gpus:
        return Arrangement()  # no data GPU, or none seen: nothing to arrange
    model = _entries(model_gpu) or [g for g in (consumer_gpus or []) if g not in data]
    if set(model) & set(data) or not model:
        return Arrangement()  # shared already (the environment check says so)
    ratio = supply_per_s / demand_per_s if demand_per_s > 0 else 0.0
    idle = (
        f"producer.data_gpu={data_gpu}: producers reading a cache do no GPU work, so that GPU idles; "
        f"supply {supply_per_s:.1f} batches/s is {ratio:.2f} x the step's demand {demand_per_s:.1f}"
    )
    need = _MAX_GAIN * HEADROOM
    if bound == Bound.STEP and ratio >= need:
        new = ",".join([*model, *data])
        why = (
            f"{idle}, at least {need:g} x: enough for a second replica, which can at most double the step "
            "rate (not measured: equal GPUs, perfect scaling)"
        )
        return Arrangement(
            changes=[
                Change("consumer.model_gpu", str(model_gpu), new, why),
                Change(
                    "producer.data_gpu", data_gpu, '""', "producers on the CPU only; they need no GPU to read a cache"
                ),
            ]
        )
    if bound == Bound.STEP:
        return Arrangement(
            notes=[
                f"{idle}, below the {need:g} x a second model replica on it could use: keep "
                "one model GPU, or add producers first"
            ]
        )
    return Arrangement(
        notes=[f"{idle}; the data side is the limit, so a second model replica on it would only wait for data"]
    )
