"""The JAX client of the consumer (``consumer/clients/``): trained exactly through the stager, and measured.

Real producer processes over shared-memory slots feed ``Stager`` with ``JaxHandOff`` in this process
(JAX on the CPU here; on a GPU machine the same code copies to the device). The slot-reuse guard of
``tests/integration/train/test_staging.py``, for JAX: every released slot is overwritten with garbage at
once and the final parameters are bit-identical to a clean run's, because JAX on the CPU aliases the
slot's memory and the hand-off then holds the slot until the step completed; a hand-off that claims its
copy is done at once ends with other parameters (the guard bites). ``jax_bench`` runs end to end as a
command and reports every figure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax                 # in the test extra (pyproject): a missing JAX is an error here, never a skip
import numpy as np
import pytest

from consumer.clients.jax_feed import JaxHandOff, init_params, mlp_step
from consumer.feed import Consumer
from consumer.handout import Batch
from consumer.staging import Staged, Stager
from shared.config_loader import load_config
from tests import procs

_STEPS = 30
_GARBAGE = 0x7F
_REPO = Path(__file__).resolve().parents[3]


def _train(config: Path, monkeypatch: pytest.MonkeyPatch, *, poison: bool) -> tuple[dict[str, np.ndarray], int, int]:
    """One run of ``_STEPS`` steps; (final parameters, slots overwritten, slots held to their step's end)."""
    cfg = load_config(config)
    handoff = JaxHandOff(mlp_step(layers=1, learning_rate=0.05), init_params(cfg.n_mels, 16, 1, seed=3),
                         jax.devices()[0])
    poisoned = steps = 0
    with Consumer(cfg) as consumer:
        if poison:
            ring, release = consumer.ring, consumer.ring.release

            def release_then_scribble(slot: int) -> None:
                nonlocal poisoned
                ring.memory.buffer(slot)[:] = _GARBAGE
                poisoned += 1
                release(slot)

            monkeypatch.setattr(ring, "release", release_then_scribble)
        for _ in Stager(consumer, handoff, depth=2).run():
            steps += 1
    assert steps == _STEPS
    return {k: np.asarray(v) for k, v in handoff.params.items()}, poisoned, handoff.aliased


def test_no_jax_step_reads_a_released_slot_and_the_guard_bites_when_a_copy_is_claimed_early(
        demo_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"ipc://{tmp_path}/j.sock"
    configs = {name: procs.write_config(tmp_path / f"{name}.yaml", demo_cache, endpoint, tmp_path / name, _STEPS,
                                        producer={"count": 2})
               for name in ("clean", "poisoned", "released_early")}
    producers = procs.start("producer", configs["clean"], tmp_path / "producers.log")
    try:
        clean, _, held = _train(configs["clean"], monkeypatch, poison=False)
        assert held == _STEPS                                  # JAX on the CPU aliased every slot
        poisoned, overwritten, _ = _train(configs["poisoned"], monkeypatch, poison=True)
        assert overwritten >= _STEPS
        put = JaxHandOff.put

        def copied_at_once(self: JaxHandOff, batch: Batch) -> Staged[Any]:
            return Staged(put(self, batch).value, copied=lambda: True)

        monkeypatch.setattr(JaxHandOff, "put", copied_at_once)
        early, _, _ = _train(configs["released_early"], monkeypatch, poison=True)
    finally:
        procs.stop(producers)
    for name in clean:
        assert np.array_equal(clean[name], poisoned[name]), name
    assert not all(np.array_equal(clean[name], early[name]) for name in clean)


def _bench(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "consumer.clients.jax_bench", *flags], cwd=_REPO,
                          env=procs.env(tmp_path), capture_output=True, text=True, timeout=300)


def test_jax_bench_reports_feed_efficiency_copy_and_overlap_for_each_depth(demo_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "jax.json"
    proc = _bench(tmp_path, "--demo", "--cache-dir", str(demo_cache), "--steps", "40", "--warmup", "4",
                  "--depths", "1,2", "--hidden", "32", "--layers", "1", "--producers", "1", "--resident-steps", "5",
                  "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["platform"] == "cpu" and doc["transport"] == "shm" and doc["producers"] == 1
    n_buckets = len(doc["resident_step_ms"])
    assert n_buckets == len(doc["copy_ms"]) >= 1 and all(x > 0 for x in doc["resident_step_ms"] + doc["copy_ms"])
    assert [r["depth"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        assert 0 < run["feed_efficiency"] < 3 and run["fed_steps_per_s"] > 0
        assert 0 <= run["copy_overlap"] <= 1 and run["gpu_util_pct"] is None       # no NVML on a CPU
        assert 1 <= run["max_in_flight"] <= run["depth"]
        assert run["slots_held_to_step_end"] == 44                                # aliased on the CPU
        assert np.isfinite(run["last_loss"])
    assert doc["runs"][0]["first_loss"] > doc["runs"][-1]["last_loss"]            # it trains
    assert "depth 2: feed efficiency" in proc.stdout and "copy overlap" in proc.stdout


@pytest.mark.parametrize(("flags", "needle"), [
    (("--depths", "0"), "--depths: must be comma-separated stage depths >= 1"),
    (("--depths", "two"), "--depths: must be comma-separated stage depths >= 1"),
    (("--steps", "0"), "--steps: must be >= 1"),
])
def test_jax_bench_refuses_bad_flags_with_one_line_and_78(tmp_path: Path, flags: tuple[str, ...], needle: str) -> None:
    proc = _bench(tmp_path, *flags)
    assert proc.returncode == 78, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
