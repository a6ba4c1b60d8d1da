"""Host cost of one ``CompiledStep.run`` on a step so small that dispatch dominates (docs/performance.md).

``python -m tests.step_dispatch [--calls N] [--blocks K]``: compiles ``tests.steps.tiny_step`` for one tiny
bucket in graph mode and XLA, then times K blocks of N calls of ``run`` (CPU: each call returns when the
step has finished) and prints the median ms per call for each mode, one JSON line. Run it with another
checkout first on ``PYTHONPATH`` to compare two versions of ``consumer/train/step.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import tensorflow as tf

from melfeed.consumer.train.model import StepSpec
from melfeed.consumer.train.step import CompiledStep
from tests.steps import tiny_step

_SHAPES = {"mel": (4, 16, 8), "mel_len": (4,), "tokens": (4, 6), "tok_len": (4,)}


def _ms_per_call(jit_compile: bool, calls: int, blocks: int) -> float:
    spec = StepSpec(8, 32, 0.01, False, 0, bucket_shapes=(_SHAPES,))
    compiled = CompiledStep(tiny_step(spec), [_SHAPES], jit_compile=jit_compile)
    compiled.warm_up()
    rng = np.random.default_rng(0)
    batch = {
        "mel": tf.constant(rng.normal(size=_SHAPES["mel"]).astype(np.float32)),
        "mel_len": tf.fill([4], 12),
        "tokens": tf.ones(_SHAPES["tokens"], tf.int32),
        "tok_len": tf.fill([4], 5),
    }
    for _ in range(calls // 10):
        compiled.run(0, batch)
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            compiled.run(0, batch)
        times.append((time.perf_counter() - t0) / calls * 1e3)
    float(compiled.run(0, batch)["loss"])
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    print(
        json.dumps(
            {
                mode: round(_ms_per_call(jit, args.calls, args.blocks), 3)
                for mode, jit in (("graph_ms", False), ("xla_ms", True))
            }
        )
    )


if __name__ == "__main__":
    main()
