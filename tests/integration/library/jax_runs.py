"""Child process of ``test_jax_client.py``: three JAX runs over one producer group, JAX kept out of pytest.

``python -m tests.integration.library.jax_runs STEPS CLEAN.yaml POISONED.yaml EARLY.yaml`` trains
``STEPS`` steps through ``Stager`` with ``JaxStageAdapter`` once per config: clean; with every released slot
overwritten with garbage at once (``BatchRing.release`` wrapped); and the same with a hand-off that
claims its copy is done at once. Prints one JSON line: whether the poisoned and the early run's final
parameters equal the clean run's bit for bit, slots overwritten, slots held to their step's end, and
which arrays a hand-off naming ``tokens`` copies (a step of the user's own reads more than mel).
A separate process because JAX's threads must not share a pytest worker that forks later.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import numpy as np

from melfeed.consumer.clients.jax_feed import JaxStageAdapter, device_batch, init_params, mlp_step
from melfeed.consumer.feed import Consumer
from melfeed.consumer.handout import Batch
from melfeed.consumer.staging import Staged, Stager
from melfeed.shared.config.loader import load_config
from tests.slot_poison import scribble_on_release

# One jitted step for the three runs: a pure function of (params, arrays), compiled once per bucket shape
# instead of once per run; each run starts from its own fresh parameters.
_STEP = mlp_step(layers=1, learning_rate=0.05)


def _train(config: str, steps: int, *, poison: bool) -> tuple[dict[str, np.ndarray], int, int]:
    cfg = load_config(config)
    handoff = JaxStageAdapter(_STEP, init_params(cfg.n_mels, 16, 1, seed=3), jax.devices()[0])
    done = 0
    with Consumer(cfg) as consumer:
        poisoned = scribble_on_release(consumer._ring) if poison else (lambda: 0)
        for _ in Stager(consumer, handoff, depth=2).run():
            done += 1
    if done != steps:
        raise RuntimeError(f"{done} of {steps} steps")
    return {k: np.asarray(v) for k, v in handoff.params.items()}, poisoned(), handoff.aliased


def main(argv: list[str]) -> int:
    steps, clean_cfg, poisoned_cfg, early_cfg = int(argv[0]), argv[1], argv[2], argv[3]
    clean, _, held = _train(clean_cfg, steps, poison=False)
    poisoned, overwritten, _ = _train(poisoned_cfg, steps, poison=True)
    put = JaxStageAdapter.put

    def copied_at_once(self: JaxStageAdapter, batch: Batch) -> Staged[Any]:
        return Staged(put(self, batch).value, copied=lambda: True)

    JaxStageAdapter.put = copied_at_once  # type: ignore[method-assign]
    early, _, _ = _train(early_cfg, steps, poison=True)
    host = {
        "mel": np.zeros((2, 3, 4), np.float32),
        "mel_len": np.ones(2, np.int32),
        "tokens": np.ones((2, 5), np.int32),
    }
    named = sorted(device_batch(host, jax.devices()[0], ("mel", "mel_len", "tokens")))
    try:
        device_batch(host, jax.devices()[0], ("mel", "pitch"))
        missing = ""
    except KeyError as err:
        missing = str(err)
    print(
        json.dumps(
            {
                "held": held,
                "overwritten": overwritten,
                "named": named,
                "missing": missing,
                "poisoned_equal": all(np.array_equal(clean[k], poisoned[k]) for k in clean),
                "early_equal": all(np.array_equal(clean[k], early[k]) for k in clean),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
