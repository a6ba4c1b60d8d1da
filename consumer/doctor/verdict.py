"""The verdict of ``melfeed doctor``: which stage bounds throughput, and what to change.

Role: pure arithmetic over the stage measurements (``Measurements``) and the config's shape
(``ConfigFacts``), so hand-made numbers test every branch. No I/O, no clock.
Definitions (batches/s unless named otherwise):
    * demand = 1000 / Σ_b mix_b * step_ms_b: what the compiled step consumes, weighted by the
      epoch's bucket mix; host->device rate likewise from h2d_ms_b;
    * supply = batches/s delivered into the consumer's ring by N producers (stage 2);
    * per-producer rate = min(one probe's build rate, delivered rate with 1 producer);
    * transport ms per batch = 1000 / delivered rate with 1 producer - build ms p50 (one producer
      builds and sends in series, so the rest of its period is the hand-over), floored at 0;
    * producers needed = ceil(HEADROOM * demand / per-producer rate), capped by the cores.
Invariants: exit 0 iff supply >= HEADROOM * demand and host->device >= HEADROOM * demand; 3 otherwise.
Shutdown: nothing to release.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "HEADROOM",
    "Measurements",
    "ConfigFacts",
    "Change",
    "Bound",
    "Verdict",
    "weighted_ms",
    "decide",
    "memory_bound_bytes",
    "EXIT_OK",
    "EXIT_DATA_BOUND",
]

HEADROOM = 1.2  # supply must beat demand by 20 %: jitter and the trainer's own CPU use
EXIT_OK = 0
EXIT_DATA_BOUND = 3  # a verdict, not a crash: the data side cannot keep the step busy
_PRODUCERS_NOT_TRANSPORT = 1.15  # build rate within 15 % of delivered: the producers are the limit
_PADDING_GAIN = 0.02  # recommend more buckets only for at least 2 points of padding efficiency


class Bound(str, Enum):  # enum.StrEnum needs Python 3.11; __str__ below does what it adds
    """The stage that bounds throughput: ``Verdict.bound``, printed and written (``--json``) as the value."""

    PRODUCERS = "producers (cache read / assembly)"  # building batches: more producers help (exit 3)
    TRANSPORT = "transport"  # delivery, not building: the checksum, tcp or the wire (exit 3)
    H2D = "host->device"  # the copy into the step's device (exit 3)
    STEP = "the training step (the GPU is the bottleneck; data keeps up)"  # the goal (exit 0)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Measurements:
    """What the probes measured. Per-bucket lists are in bucket index order."""

    producers: int  # N, the producer count measured
    build_ms_p50: float  # one producer probe alone: ms per batch (debug delay included)
    read_ms_p50: float  # the cache-read part of it
    build_rate_1: float  # batches/s of one probe alone
    build_rate_n: float  # Σ batches/s of N probes at once
    delivered_1: float  # stage 2, 1 producer
    delivered_n: float  # stage 2, N producers
    h2d_ms: tuple[float, ...]  # stage 3 per bucket
    step_ms: tuple[float, ...]  # stage 4 per bucket (p50)
    mix: tuple[float, ...]  # fraction of an epoch's batches per bucket


@dataclass(frozen=True, slots=True)
class ConfigFacts:
    """The config and dataset shape the recommendations refer to."""

    cores: int  # CPUs this process may run on
    producer_count: int  # producer.count now
    ring_slots: int  # consumer.ring_slots now
    lease_window: int  # transport.lease_window
    largest_batch_bytes: int
    padding: float  # padding efficiency of the configured buckets
    num_buckets: int | None  # buckets.num_buckets when boundaries are derived; None = configured
    padding_alternatives: tuple[tuple[int, float], ...] = ()  # (shape budget, padding efficiency)
    budget_key: str = "buckets.num_buckets"  # the key of that budget (buckets.max_shapes for a 2-D plan)
    token_padding: float = 0.0  # real tokens / padded token positions of the plan
    checksum: bool = False  # crc32 on payloads (transport.checksum, resolved)
    is_tcp: bool = False  # transport.endpoint is tcp://


@dataclass(frozen=True, slots=True)
class Change:
    key: str
    old: str
    new: str
    reason: str

    def line(self) -> str:
        return f"{self.key}: {self.old} -> {self.new}  ({self.reason})"


@dataclass(frozen=True, slots=True)
class Verdict:
    bound: Bound
    exit_code: int
    supply_per_s: float
    demand_per_s: float
    h2d_per_s: float
    per_producer_per_s: float
    transport_ms: float
    producers_needed: int  # uncapped
    producers_recommended: int  # capped by the cores
    memory_bound_bytes: int  # with the recommended producer.count and consumer.ring_slots
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def weighted_ms(per_bucket_ms: tuple[float, ...], mix: tuple[float, ...]) -> float:
    """Mean ms per batch over an epoch: Σ mix_b * ms_b (mix sums to 1)."""
    if len(per_bucket_ms) != len(mix) or not mix:
        raise ValueError(f"need one time per bucket: {len(per_bucket_ms)} times, {len(mix)} weights")
    return sum(w * t for w, t in zip(mix, per_bucket_ms))


def memory_bound_bytes(ring_slots: int, producers: int, lease_window: int, largest_batch_bytes: int) -> int:
    """docs/design.md invariant 4, as the consumer logs it: (ring slots + Σ lease windows) x largest batch."""
    return (ring_slots + producers * lease_window) * largest_batch_bytes


def _rate(ms: float) -> float:
    return 1000.0 / ms if ms > 0 else math.inf


def decide(m: Measurements, c: ConfigFacts) -> Verdict:
    """Name the bounding stage, the exit code and the concrete config changes."""
    demand = _rate(weighted_ms(m.step_ms, m.mix))
    h2d = _rate(weighted_ms(m.h2d_ms, m.mix))
    per_producer = min(m.build_rate_1, m.delivered_1)
    transport_ms = max(0.0, 1000.0 / m.delivered_1 - m.build_ms_p50) if m.delivered_1 > 0 else math.inf
    needed = math.ceil(HEADROOM * demand / per_producer) if per_producer > 0 else 10**6
    recommended = max(1, min(needed, c.cores))
    notes: list[str] = []
    if m.delivered_n >= HEADROOM * demand and h2d >= HEADROOM * demand:
        bound, code = Bound.STEP, EXIT_OK
    elif m.delivered_n < HEADROOM * demand:
        code = EXIT_DATA_BOUND
        bound = Bound.PRODUCERS if m.build_rate_n <= _PRODUCERS_NOT_TRANSPORT * m.delivered_n else Bound.TRANSPORT
    else:
        bound, code = Bound.H2D, EXIT_DATA_BOUND
        notes.append(
            f"the hand-off to the device ({h2d:.1f} batches/s) is slower than the step needs "
            f"({HEADROOM:g} x {demand:.1f}); check that the host buffers are aligned (DLPack) "
            "and that the model GPU is not shared"
        )
    if needed > c.cores:
        notes.append(
            f"the step needs {needed} producers at {per_producer:.1f} batches/s each, but this machine "
            f"has {c.cores} cores: recommending {recommended}; faster storage, fewer padded frames or "
            "producers on another host (tcp + CURVE) are the ways beyond that"
        )
    if bound == Bound.PRODUCERS and m.build_rate_n < 0.8 * m.producers * m.build_rate_1:
        notes.append(
            f"{m.producers} producer probes together built {m.build_rate_n:.1f} batches/s, "
            f"{m.producers} x one alone would be {m.producers * m.build_rate_1:.1f}: they compete for cores "
            "or the disk"
        )
    changes = _changes(m, c, bound, recommended)
    slots = next((int(ch.new) for ch in changes if ch.key == "consumer.ring_slots"), c.ring_slots)
    producers = next((int(ch.new) for ch in changes if ch.key == "producer.count"), c.producer_count)
    return Verdict(
        bound=bound,
        exit_code=code,
        supply_per_s=m.delivered_n,
        demand_per_s=demand,
        h2d_per_s=h2d,
        per_producer_per_s=per_producer,
        transport_ms=transport_ms,
        producers_needed=needed,
        producers_recommended=recommended,
        memory_bound_bytes=memory_bound_bytes(slots, producers, c.lease_window, c.largest_batch_bytes),
        changes=changes,
        notes=notes,
    )


def _slots_for(producers: int, c: ConfigFacts) -> int:
    """Ring slots that let every producer hold its whole lease window: + 1 ready + 1 in the step."""
    return producers * c.lease_window + 2


def _changes(m: Measurements, c: ConfigFacts, bound: Bound, producers: int) -> list[Change]:
    out: list[Change] = []
    data_bound = bound in (Bound.PRODUCERS, Bound.TRANSPORT)
    if producers != c.producer_count and (data_bound or producers < c.producer_count):
        why = (
            "supply must reach 1.2 x the step's demand"
            if producers > c.producer_count
            else "fewer producers already supply 1.2 x the step's demand; the rest only take CPU from the trainer"
        )
        rate = min(m.build_rate_1, m.delivered_1)
        out.append(
            Change(
                "producer.count",
                str(c.producer_count),
                str(producers),
                f"{why}: {producers} x {rate:.1f} = {producers * rate:.1f} batches/s for a demand of "
                f"{_rate(weighted_ms(m.step_ms, m.mix)):.1f}",
            )
        )
    slots = _slots_for(max(producers, c.producer_count) if data_bound else producers, c)
    if data_bound and c.ring_slots < slots:
        n = max(producers, c.producer_count)
        out.append(
            Change(
                "consumer.ring_slots",
                str(c.ring_slots),
                str(min(slots, 256)),
                f"each lease reserves a slot: {n} producers x lease window {c.lease_window} + 1 ready "
                "+ 1 in the step, or producers wait for slots",
            )
        )
    if bound == Bound.TRANSPORT and c.checksum:
        out.append(
            Change(
                "transport.checksum",
                "true",
                "false",
                "crc32 costs ~2.3 ms per 8 MB on each side; "
                "CURVE (tcp without transport.insecure) already authenticates every message",
            )
        )
    if bound == Bound.TRANSPORT and c.is_tcp:
        out.append(
            Change(
                "transport.endpoint",
                "tcp://...",
                "ipc://... (default)",
                "producers on this host: ipc carries 8 MB batches about twice as fast as tcp",
            )
        )
    better = [(k, p) for k, p in c.padding_alternatives if p >= c.padding + _PADDING_GAIN]
    if c.num_buckets is not None and better:
        k, p = max(better, key=lambda kp: (kp[1] - 0.005 * kp[0], -kp[0]))
        out.append(
            Change(
                c.budget_key,
                str(c.num_buckets),
                f"{k} (padding {c.padding:.2f} -> {p:.2f})",
                f"the step computes {100 * (1 - c.padding / p):.0f} % fewer padded frames per epoch; "
                f"{k - c.num_buckets} more compile(s) at start",
            )
        )
    return out
