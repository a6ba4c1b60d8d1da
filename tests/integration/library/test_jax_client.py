"""The JAX client of the consumer (``consumer/clients/``): trained exactly through the stager, and measured.

Real producer processes over shared-memory slots feed ``Stager`` with ``JaxStageAdapter`` (JAX on the CPU here;
on a GPU machine the same code copies to the device), in a child process (``jax_runs.py``: JAX's threads
stay out of the pytest worker, which forks later). The slot-reuse guard of
``tests/integration/train/test_replicas.py``, for JAX: every released slot is overwritten with garbage at
once and the final parameters are bit-identical to a clean run's, because JAX on the CPU aliases the
slot's memory and the hand-off then holds the slot until the step completed; a hand-off that claims its
copy is done at once ends with other parameters (the guard bites). ``jax_bench`` runs end to end as a
command and reports every figure. JAX is in the test extra: its absence fails these tests, never skips them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests import procs

_STEPS = 30
# Two bucket shapes: slots of both sizes go round the ring, and JAX compiles two programs, not the default's eight.
_BUCKETS = {"max_shapes": 2}
_REPO = Path(__file__).resolve().parents[3]


def test_no_jax_step_reads_a_released_slot_and_the_guard_bites_when_a_copy_is_claimed_early(
    demo_cache: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/j.sock"
    configs = [
        procs.write_config(
            tmp_path / f"{name}.yaml",
            demo_cache,
            endpoint,
            tmp_path / name,
            _STEPS,
            producer={"count": 2},
            buckets=_BUCKETS,
        )
        for name in ("clean", "poisoned", "released_early")
    ]
    producers = procs.start("producer", configs[0], tmp_path / "producers.log")
    try:
        child = subprocess.run(
            [sys.executable, "-m", "tests.integration.library.jax_runs", str(_STEPS), *map(str, configs)],
            cwd=_REPO,
            env=procs.env(tmp_path),
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        procs.stop(producers)
    assert child.returncode == 0, child.stderr[-3000:]
    doc = json.loads(child.stdout.strip().splitlines()[-1])
    assert doc["held"] == _STEPS  # JAX on the CPU aliased every slot
    assert doc["overwritten"] >= _STEPS
    assert doc["poisoned_equal"] is True
    assert doc["early_equal"] is False  # the guard bites when the order is wrong
    assert doc["named"] == ["mel", "mel_len", "tokens"]  # JaxStageAdapter(array_names=...): a step's own arrays
    assert "no ['pitch']" in doc["missing"] and "'tokens'" in doc["missing"]


def _bench(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "melfeed.consumer.clients.jax_bench", *flags],
        cwd=_REPO,
        env=procs.env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_jax_bench_reports_feed_efficiency_copy_and_overlap_for_each_depth(tmp_path: Path) -> None:
    out = tmp_path / "jax.json"
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({"buckets": _BUCKETS}))
    # its own demo cache: --demo writes the extras into the cache it is given (the shared demo_cache has none)
    proc = _bench(
        tmp_path,
        "--config",
        str(config),
        "--demo",
        "--cache-dir",
        str(tmp_path / "demo"),
        "--demo-utterances",
        "200",
        "--steps",
        "24",
        "--warmup",
        "2",
        "--depths",
        "1,2",
        "--hidden",
        "32",
        "--layers",
        "1",
        "--producers",
        "1",
        "--resident-steps",
        "3",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["platform"] == "cpu" and doc["transport"] == "shm" and doc["producers"] == 1
    n_buckets = len(doc["resident_step_ms"])
    assert n_buckets == len(doc["copy_ms"]) >= 1 and all(x > 0 for x in doc["resident_step_ms"] + doc["copy_ms"])
    assert [r["depth"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        assert 0 < run["feed_efficiency"] < 3 and run["fed_steps_per_s"] > 0
        assert 0 <= run["copy_overlap"] <= 1 and run["gpu_util_pct"] is None  # no NVML on a CPU
        assert 1 <= run["max_in_flight"] <= run["depth"]
        assert run["slots_held_to_step_end"] == 26  # aliased on the CPU
        assert np.isfinite(run["last_loss"])
    assert doc["runs"][0]["first_loss"] > doc["runs"][-1]["last_loss"]  # it trains
    assert "depth 2: feed efficiency" in proc.stdout and "copy overlap" in proc.stdout


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--depths", "0"), "--depths: must be comma-separated stage depths >= 1"),
        (("--depths", "two"), "--depths: must be comma-separated stage depths >= 1"),
        (("--steps", "0"), "--steps: must be >= 1"),
    ],
)
def test_jax_bench_refuses_bad_flags_with_one_line_and_78(tmp_path: Path, flags: tuple[str, ...], needle: str) -> None:
    proc = _bench(tmp_path, *flags)
    assert proc.returncode == 78, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
