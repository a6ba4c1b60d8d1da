"""``python -m tests.integration.train.poison_replicas CONFIG MODE``: the built-in loop on 2 logical CPU replicas.

MODE ``clean``, ``poisoned`` (every released slot overwritten at once, tests/slot_poison.py) or ``early`` (the
hand-off claims its copy done at once, so slots go back before their steps: the hook must bite). A fresh
interpreter, because the CPU is split into 2 logical devices before TensorFlow initialises
(``configure_memory``). Prints one JSON line: steps and overwritten releases; variables go to the checkpoint.
"""

from __future__ import annotations

import json
import sys
import threading
import time


def main(config: str, mode: str) -> int:
    from melfeed.consumer.placement import configure_memory
    from melfeed.shared.config.loader import load_config

    cfg = load_config(config)
    configure_memory(cfg)
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.resume.state import RunState
    from melfeed.consumer.staging import Staged
    from melfeed.consumer.train.handoff import TfStageAdapter
    from melfeed.consumer.train.loop import train
    from tests.slot_poison import scribble_on_release

    if mode == "early":
        put = TfStageAdapter.put
        TfStageAdapter.put = lambda self, batch: Staged(put(self, batch).value, copied=lambda: True)  # type: ignore[method-assign]
    state = RunState.open(cfg, Consumer(cfg).manifest.fingerprint)
    assert state is not None
    try:
        with Consumer(cfg, start_batch=state.next_batch) as consumer:
            poisoned = scribble_on_release(consumer._ring) if mode != "clean" else (lambda: 0)
            summary = train(cfg, consumer, threading.Event(), process_start_s=time.time(), state=state)
    finally:
        state.close()
    print(json.dumps({"steps": summary.steps, "overwritten": poisoned(), "devices": summary.devices}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
