"""Chaos: producers SIGKILLed at random, the consumer SIGKILLed and restarted, producers frozen.

Oracle: ``melfeed audit`` over the state directory
shows the applied sequence equals the plan: 0 lost, 0 duplicated, in order, same content. Every
injected event is recorded with the seed, so a failure replays with ``CHAOS_SEEDS=<seed>``.
CI runs one short seed with both same-host data paths in one run (shared-memory and payload-frame producers
feeding one consumer); the ``slow`` variants run one data path per run, more seeds and a longer plan.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import procs

_SEEDS = [int(s) for s in os.environ.get("CHAOS_SEEDS", "").split(",") if s]  # a failure's seed, to replay it
# (transport.mode, producers) of each producer group of a run: one launcher each. Two of each: a producer is
# killed only while all are up, so each data path keeps one producer feeding through kills and the freeze.
_MIXED = (("shm", 2), ("zmq", 2))
_STOPPED = re.compile(r"producer stopped batches=(\d+) shm_batches=(\d+)")  # a producer's counts at its clean stop


@dataclass
class _Chaos:
    seed: int
    steps: int
    consumer_kills: int
    groups: tuple[tuple[str, int], ...] = (("auto", 3),)
    events: list[str] = field(default_factory=list)
    producer_kills: list[int] = field(default_factory=list)  # per group
    frozen: int = 0

    def note(self, text: str) -> None:
        self.events.append(f"{time.monotonic():.2f} {text}")


def _kill_a_producer(rng: random.Random, launchers: list[int], chaos: _Chaos) -> None:
    """F1: SIGKILL one producer, only while all are up (the launcher's back-off doubles per crash); the groups
    take turns in proportion to their size, so each data path loses producers and no slot's back-off outgrows
    the others'."""
    workers = [procs.child_pids(pid) for pid in launchers]
    if [len(w) for w in workers] == [count for _, count in chaos.groups]:
        slots = [n for n, (_, count) in enumerate(chaos.groups) for _ in range(count)]
        group = slots[sum(chaos.producer_kills) % len(slots)]
        victim = rng.choice(workers[group])
        os.kill(victim, signal.SIGKILL)
        chaos.producer_kills[group] += 1
        chaos.note(f"SIGKILL {chaos.groups[group][0]} producer pid {victim}")


def _freeze_producers(rng: random.Random, launchers: list[int], chaos: _Chaos, liveness_s: float) -> bool:
    """F5: SIGSTOP one producer of each group past liveness (its leases are reassigned), then SIGCONT (late
    messages fenced). False (nothing done) while a group has no producer up."""
    workers = [procs.child_pids(pid) for pid in launchers]
    if not all(workers):
        return False
    victims = [rng.choice(w) for w in workers]
    for victim in victims:
        os.kill(victim, signal.SIGSTOP)
        chaos.note(f"SIGSTOP producer pid {victim}")
    time.sleep(liveness_s * 2)
    for victim in victims:
        os.kill(victim, signal.SIGCONT)
        chaos.frozen += 1
        chaos.note(f"SIGCONT producer pid {victim}")
    return True


def _run(tmp_path: Path, cache: Path, chaos: _Chaos) -> None:
    rng = random.Random(chaos.seed)
    state = tmp_path / "state"
    endpoint = f"ipc://{tmp_path}/c.sock"
    consumer_mode = chaos.groups[0][0] if len(chaos.groups) == 1 else "auto"
    lean: dict[str, dict[str, object]] = {
        "consumer": {"feed_efficiency_steps": 0},  # feed efficiency is not checked
        # Two 2-D shapes whose weights and rows the consumer measures (kept in its state directory for its
        # restarts) and the producers, started on their own, learn in every handshake: exactly-once over a plan
        # of measured settings. Two compiled programs per consumer start.
        "buckets": {"max_shapes": 2, "cost": "measured", "batch_size": "auto", "max_batch_size": 8},
    }
    config = procs.write_config(
        tmp_path / "chaos.yaml", cache, endpoint, state, chaos.steps, transport={"mode": consumer_mode}, **lean
    )
    liveness_s = 0.2 * 5
    log = tmp_path / "chaos.log"
    summary = tmp_path / "summary.json"
    # Kill points in the applied sequence, spread over the run; one freeze in between.
    kill_at = sorted(rng.sample(range(chaos.steps // 6, chaos.steps * 5 // 6), chaos.consumer_kills))
    freeze_at: int | None = rng.randrange(chaos.steps // 4, chaos.steps * 3 // 4)
    launchers = []
    for n, (mode, count) in enumerate(chaos.groups):
        group = procs.write_config(
            tmp_path / f"producers{n}.yaml",
            cache,
            endpoint,
            state,
            chaos.steps,
            transport={"mode": mode},
            producer={"count": count},
            **lean,
        )
        launchers.append(procs.start("producer", group, log, "--debug-delay-ms", "25"))
    chaos.producer_kills = [0] * len(launchers)
    consumer = procs.start("consumer", config, log, "--summary-json", str(summary))
    # Generous: each consumer restart recompiles its step, which takes minutes on a loaded 2-core machine;
    # the bound only has to catch a run that stopped making progress.
    deadline = time.monotonic() + 240 + 90 * chaos.consumer_kills
    next_producer_kill = time.monotonic() + rng.uniform(0.5, 1.5)
    pids = [p.pid for p in launchers]
    try:
        while consumer.poll() is None or kill_at:
            assert time.monotonic() < deadline, (
                f"no progress: seed {chaos.seed} events {chaos.events}\n{procs.tail(log)}"
            )
            done = procs.audit_records(state)
            if consumer.poll() is not None:  # exited early: only a bug gets here
                break
            if kill_at and done >= kill_at[0]:
                kill_at.pop(0)
                consumer.kill()
                consumer.wait(procs.WAIT_S)
                chaos.note(f"SIGKILL consumer at {done} records; restart")
                consumer = procs.start("consumer", config, log, "--summary-json", str(summary))
            elif freeze_at is not None and done >= freeze_at:
                if _freeze_producers(rng, pids, chaos, liveness_s):
                    freeze_at = None
            elif time.monotonic() >= next_producer_kill:
                _kill_a_producer(rng, pids, chaos)
                next_producer_kill = time.monotonic() + rng.uniform(0.4, 1.2)
            time.sleep(0.01)
        code = consumer.wait(procs.WAIT_S)
        assert code == 0, f"seed {chaos.seed}: consumer exited {code}\n{procs.tail(log)}"
    finally:
        procs.stop(consumer)
        for launcher in launchers:
            procs.stop(launcher)
    rc, doc, text = procs.run_audit(state, tmp_path)
    context = f"seed {chaos.seed}, events {chaos.events}\n{text}\n{procs.tail(log)}"
    assert rc == 0, context
    assert (doc["lost"], doc["duplicated"], doc["out_of_order"], doc["wrong_content"]) == (0, 0, 0, 0), context
    assert doc["content_checked"] and doc["applied"] == chaos.steps == doc["expected"], context
    assert doc["checkpoint_next_batch"] == chaos.steps and doc["after_checkpoint"] == 0, context
    assert doc["consumer_epochs"] == chaos.consumer_kills + 1, context
    # the chaos really happened, to every group
    assert sum(chaos.producer_kills) >= 3 and min(chaos.producer_kills) >= 1, context
    assert chaos.frozen == len(chaos.groups), context
    if len(chaos.groups) > 1:  # both data paths fed the run: the producers' own counts at their clean stop
        stops = [(int(b), int(s)) for b, s in _STOPPED.findall(log.read_text(errors="replace"))]
        assert sum(s for _, s in stops) > 0 and sum(b - s for b, s in stops) > 0, f"stops {stops}: {context}"


@pytest.mark.timeout(420)  # > the run's own progress deadline (240 + 90 s per consumer kill)
@pytest.mark.parametrize("seed", _SEEDS or [11])
def test_chaos_with_shm_and_zmq_producers_feeding_one_consumer_applies_the_plan(
    seed: int, demo_cache: Path, tmp_path: Path
) -> None:
    """Two shared-memory producers and two payload-frame producers (two launchers) feed one consumer: producers
    of each kind SIGKILLed in turn, one of each frozen past liveness and thawed, the consumer SIGKILLed and
    restarted; the audit is exact."""
    _run(tmp_path, demo_cache, _Chaos(seed, steps=240, consumer_kills=1, groups=_MIXED))


@pytest.mark.slow  # one data path per run: the default lane runs both in one (the test above)
@pytest.mark.timeout(420)  # > the run's own progress deadline (240 + 90 s per consumer kill)
@pytest.mark.parametrize(
    ("seed", "mode"),
    [(seed, mode) for seed in _SEEDS for mode in ("shm", "zmq")] or [(11, "shm"), (23, "zmq")],
)
def test_chaos_applied_sequence_equals_the_plan(seed: int, mode: str, demo_cache: Path, tmp_path: Path) -> None:
    """The consumer in one ``transport.mode`` (zmq: no slot files at all), all three producers in it. The default
    lane covers both data paths' kill, freeze and restart handling in one run:
    test_chaos_with_shm_and_zmq_producers_feeding_one_consumer_applies_the_plan."""
    _run(tmp_path, demo_cache, _Chaos(seed, steps=240, consumer_kills=1, groups=((mode, 3),)))


@pytest.mark.slow
@pytest.mark.timeout(720)  # > 240 + 3 x 90 s of progress deadline
@pytest.mark.parametrize("seed", range(100, 106))
def test_chaos_long_run_with_repeated_consumer_kills(seed: int, demo_cache: Path, tmp_path: Path) -> None:
    _run(tmp_path, demo_cache, _Chaos(seed, steps=900, consumer_kills=3))
