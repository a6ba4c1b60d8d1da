"""The persistent XLA cache across processes (real TensorFlow, XLA on the CPU): a second process finds every
program the first compiled, whatever it traced before, and compiles none; an XLA compile after warm-up that
no trace announces (an argument XLA takes as a compile-time constant) is counted in ``compiles_after_ready``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

_PROCESS_TIMEOUT_S = 240  # one TensorFlow import and one or two XLA compiles on a loaded 2-core machine

_SCRIPT = """
import json, sys, time
import tensorflow as tf
from melfeed.consumer.train.model import StepSpec, build_reference_step
from melfeed.consumer.train.step import CompiledStep
from melfeed.consumer.xla_cache import active_xla_cache_dir
from tests.steps import tiny_step

cache = active_xla_cache_dir()
files = lambda: sorted(p.name for p in cache.glob("*.pb"))

class RowsStep:
    def __init__(self):
        self.w = tf.Variable(1.0)

    def __call__(self, mel, mel_len, tokens, tok_len, rows):
        loss = tf.reduce_sum(mel[:rows]) * self.w     # rows sets a shape: XLA compiles once per value
        self.w.assign_add(0.0 * loss)
        return loss

    def variables(self):
        return [self.w]

    def checkpoint_items(self):
        return {"w": self.w}

shapes = lambda frames: {"mel": (4, frames, 16), "mel_len": (4,), "tokens": (4, 8), "tok_len": (4,)}

def rows():
    compiled = CompiledStep(RowsStep(), [shapes(16)], jit_compile=True)
    compiled.warm_up()
    batch = {k: tf.zeros(s, tf.float32 if k == "mel" else tf.int32) for k, s in shapes(16).items()}
    float(compiled.run(0, batch, rows=3)["loss"])
    deadline = time.monotonic() + 30.0            # the count lists the cache at most once a second
    while compiled.compiles_after_ready == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"compiles_after_ready": compiled.compiles_after_ready, "traces": compiled.traces}

def step(mode):
    if mode.startswith("shifted"):                         # a trace more than the first process made, before the step's
        tf.function(lambda x: x + 1).get_concrete_function(tf.TensorSpec([2]))
    spec = StepSpec(n_mels=16, vocab_size=32, learning_rate=1e-3, mixed_precision=False, seed=0)
    step = build_reference_step(spec) if mode.endswith("reference") else tiny_step(spec)
    before = files()
    compiled = CompiledStep(step, [shapes(16), shapes(24)], jit_compile=True)
    compiled.warm_up()
    return {"before": before, "after": files(), "compiles_after_ready": compiled.compiles_after_ready}

print(json.dumps({mode: rows() if mode == "rows" else step(mode) for mode in sys.argv[1:]}))
"""


def _compile(cache: Path, *modes: str) -> dict[str, Any]:
    """One process running ``modes`` in turn on the persistent cache ``cache``: each mode's figures."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_XLA_FLAGS": f"--tf_xla_persistent_cache_directory={cache}"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *modes],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=_PROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def tiny_processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """A cold process compiling the tiny step, then a second one on its cache: the shifted tiny step (every
    figure taken before anything else runs there), then the rows step, a program no process compiled before."""
    cache = tmp_path_factory.mktemp("xla-cache")
    return _compile(cache, "cold-tiny"), _compile(cache, "shifted-tiny", "rows")


@pytest.mark.parametrize("step", ["tiny", pytest.param("reference", marks=pytest.mark.slow)])  # reference: ~80 s
def test_a_second_process_loads_every_program_from_the_cache_and_compiles_none(
    tmp_path: Path, step: str, request: pytest.FixtureRequest
) -> None:
    if step == "tiny":
        first, second = request.getfixturevalue("tiny_processes")
        cold, warm = first["cold-tiny"], second["shifted-tiny"]
    else:
        cold, warm = (
            _compile(tmp_path, f"cold-{step}")[f"cold-{step}"],
            _compile(tmp_path, f"shifted-{step}")[f"shifted-{step}"],
        )
    assert cold["before"] == [] and len(cold["after"]) == 2  # one program per bucket, both compiled
    assert warm["before"] == cold["after"] and warm["after"] == cold["after"]  # loaded, none compiled
    assert warm["compiles_after_ready"] == 0


def test_an_xla_compile_after_warm_up_without_a_trace_is_counted(
    tiny_processes: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    assert tiny_processes[1]["rows"] == {"compiles_after_ready": 1, "traces": 1}
