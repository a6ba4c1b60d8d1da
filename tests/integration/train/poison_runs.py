"""The built-in loop in one MODE on one CONFIG (``train_in_mode``, run by tests/replica_check.py).

MODE ``clean``, ``poisoned`` (every released slot overwritten at once, tests/slot_poison.py) or ``early`` (the
hand-off claims its copy done at once, so slots go back before their steps: the hook must bite). The CONFIG asks for
one replica or for two (the 2 logical CPU devices tests/replica_check.py split). The runs share that interpreter
(one TensorFlow start), each with its own consumer, state and step. Each returns its steps, overwritten releases,
devices and the final variables of its checkpoint (bytes as hex, so equal means bit-identical).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any


def train_in_mode(config: str, mode: str) -> dict[str, Any]:
    import tensorflow as tf

    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.handout import Batch
    from melfeed.consumer.resume.checkpoint import latest_checkpoint
    from melfeed.consumer.resume.state import RunState
    from melfeed.consumer.staging import Staged
    from melfeed.consumer.train.handoff import TfStageAdapter
    from melfeed.consumer.train.loop import train
    from melfeed.shared.config.loader import load_config
    from tests.slot_poison import scribble_on_release

    cfg = load_config(config)
    put = TfStageAdapter.put

    def copied_at_once(self: TfStageAdapter, batch: Batch) -> Staged[dict[str, tf.Tensor]]:
        staged = put(self, batch)
        return Staged(staged.value, copied=lambda: True, host_copies=staged.host_copies)

    if mode == "early":
        TfStageAdapter.put = copied_at_once  # type: ignore[method-assign]
    state = RunState.open(cfg, Consumer(cfg).manifest.fingerprint)
    assert state is not None
    try:
        with Consumer(cfg, start_batch=state.next_batch) as consumer:
            poisoned = scribble_on_release(consumer._ring) if mode != "clean" else (lambda: 0)
            summary = train(cfg, consumer, threading.Event(), process_start_s=time.time(), state=state)
    finally:
        state.close()
        TfStageAdapter.put = put  # type: ignore[method-assign]
    assert cfg.consumer.state_dir is not None
    found = latest_checkpoint(Path(cfg.consumer.state_dir))
    assert found is not None
    reader = tf.train.load_checkpoint(str(found[0] / "vars"))
    variables = {
        name: reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE").tobytes().hex()
        for name in ("w", "momentum", "iterations")
    }
    return {
        "steps": summary.steps,
        "interrupted": summary.interrupted,
        "overwritten": poisoned(),
        "devices": summary.devices,
        "variables": variables,
    }
