"""Chaos: producers SIGKILLed at random, the consumer SIGKILLed and restarted, a producer frozen.

Oracle: ``melfeed audit`` over the state directory
shows the applied sequence equals the plan: 0 lost, 0 duplicated, in order, same content. Every
injected event is recorded with the seed, so a failure replays with ``CHAOS_SEEDS=<seed>``.
CI runs a few short seeds; the ``slow`` variant runs more seeds and a longer plan.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import procs

# (seed, transport.mode): one run per same-host data path in CI; the slow variant runs many more seeds
_FAST_CASES = [(11, "shm"), (23, "zmq")]


@dataclass
class _Chaos:
    seed: int
    steps: int
    consumer_kills: int
    mode: str = "auto"
    events: list[str] = field(default_factory=list)
    producer_kills: int = 0
    frozen: int = 0

    def note(self, text: str) -> None:
        self.events.append(f"{time.monotonic():.2f} {text}")


def _kill_a_producer(rng: random.Random, launcher: int, chaos: _Chaos, count: int) -> None:
    """F1: SIGKILL one producer, only while all are up (the launcher's back-off doubles per crash)."""
    workers = procs.child_pids(launcher)
    if len(workers) == count:
        victim = rng.choice(workers)
        os.kill(victim, signal.SIGKILL)
        chaos.producer_kills += 1
        chaos.note(f"SIGKILL producer pid {victim}")


def _freeze_a_producer(rng: random.Random, launcher: int, chaos: _Chaos, liveness_s: float) -> None:
    """F5: SIGSTOP past liveness (its leases are reassigned), then SIGCONT (late messages fenced)."""
    workers = procs.child_pids(launcher)
    if not workers:
        return
    victim = rng.choice(workers)
    os.kill(victim, signal.SIGSTOP)
    chaos.note(f"SIGSTOP producer pid {victim}")
    time.sleep(liveness_s * 2)
    os.kill(victim, signal.SIGCONT)
    chaos.frozen += 1
    chaos.note(f"SIGCONT producer pid {victim}")


def _run(tmp_path: Path, cache: Path, chaos: _Chaos) -> None:
    rng = random.Random(chaos.seed)
    state = tmp_path / "state"
    config = procs.write_config(
        tmp_path / "chaos.yaml", cache, f"ipc://{tmp_path}/c.sock", state, chaos.steps, transport={"mode": chaos.mode}
    )
    liveness_s = 0.2 * 5
    log = tmp_path / "chaos.log"
    # Kill points in the applied sequence, spread over the run; one freeze in between.
    kill_at = sorted(rng.sample(range(chaos.steps // 6, chaos.steps * 5 // 6), chaos.consumer_kills))
    freeze_at: int | None = rng.randrange(chaos.steps // 4, chaos.steps * 3 // 4)
    producers = procs.start("producer", config, log, "--debug-delay-ms", "25")
    consumer = procs.start("consumer", config, log)
    # Generous: each consumer restart recompiles its step, which takes minutes on a loaded 2-core machine;
    # the bound only has to catch a run that stopped making progress.
    deadline = time.monotonic() + 240 + 90 * chaos.consumer_kills
    next_producer_kill = time.monotonic() + rng.uniform(0.5, 1.5)
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
                consumer = procs.start("consumer", config, log)
            elif freeze_at is not None and done >= freeze_at:
                freeze_at = None
                _freeze_a_producer(rng, producers.pid, chaos, liveness_s)
            elif time.monotonic() >= next_producer_kill:
                _kill_a_producer(rng, producers.pid, chaos, 3)
                next_producer_kill = time.monotonic() + rng.uniform(0.4, 1.2)
            time.sleep(0.01)
        code = consumer.wait(procs.WAIT_S)
        assert code == 0, f"seed {chaos.seed}: consumer exited {code}\n{procs.tail(log)}"
    finally:
        procs.stop(consumer)
        procs.stop(producers)
    rc, doc, text = procs.run_audit(state, tmp_path)
    context = f"seed {chaos.seed}, events {chaos.events}\n{text}\n{procs.tail(log)}"
    assert rc == 0, context
    assert (doc["lost"], doc["duplicated"], doc["out_of_order"], doc["wrong_content"]) == (0, 0, 0, 0), context
    assert doc["content_checked"] and doc["applied"] == chaos.steps == doc["expected"], context
    assert doc["checkpoint_next_batch"] == chaos.steps and doc["after_checkpoint"] == 0, context
    assert doc["consumer_epochs"] == chaos.consumer_kills + 1, context
    assert chaos.producer_kills >= 3 and chaos.frozen == 1, context  # the chaos really happened


@pytest.mark.timeout(420)  # > the run's own progress deadline (240 + 90 s per consumer kill)
@pytest.mark.parametrize(
    ("seed", "mode"),
    [(int(s), m) for s in os.environ.get("CHAOS_SEEDS", "").split(",") if s for m in ("shm", "zmq")] or _FAST_CASES,
)
def test_chaos_applied_sequence_equals_the_plan(seed: int, mode: str, demo_cache: Path, tmp_path: Path) -> None:
    _run(tmp_path, demo_cache, _Chaos(seed, steps=240, consumer_kills=1, mode=mode))


@pytest.mark.slow
@pytest.mark.timeout(720)  # > 240 + 3 x 90 s of progress deadline
@pytest.mark.parametrize("seed", range(100, 106))
def test_chaos_long_run_with_repeated_consumer_kills(seed: int, demo_cache: Path, tmp_path: Path) -> None:
    _run(tmp_path, demo_cache, _Chaos(seed, steps=900, consumer_kills=3))
