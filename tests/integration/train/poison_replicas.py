"""``python -m tests.integration.train.poison_replicas MODE CONFIG [MODE CONFIG ...]``: the built-in loop on 2
logical CPU replicas, once per MODE in turn, each run on its own CONFIG (state directory).

MODE ``clean``, ``poisoned`` (every released slot overwritten at once, tests/slot_poison.py) or ``early`` (the
hand-off claims its copy done at once, so slots go back before their steps: the hook must bite). A fresh
interpreter, because the CPU is split into 2 logical devices before TensorFlow initialises
(``configure_memory``); the runs share it (one TensorFlow start), each with its own consumer, state and step.
Prints one JSON line, per MODE: steps, overwritten releases and devices; variables go to each checkpoint.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any


def _train(config: str, mode: str) -> dict[str, Any]:
    from melfeed.consumer.feed import Consumer
    from melfeed.consumer.resume.state import RunState
    from melfeed.consumer.staging import Staged
    from melfeed.consumer.train.handoff import TfStageAdapter
    from melfeed.consumer.train.loop import train
    from melfeed.shared.config.loader import load_config
    from tests.slot_poison import scribble_on_release

    cfg = load_config(config)
    put = TfStageAdapter.put
    if mode == "early":
        TfStageAdapter.put = lambda self, batch: Staged(put(self, batch).value, copied=lambda: True)  # type: ignore[method-assign]
    state = RunState.open(cfg, Consumer(cfg).manifest.fingerprint)
    assert state is not None
    try:
        with Consumer(cfg, start_batch=state.next_batch) as consumer:
            poisoned = scribble_on_release(consumer._ring) if mode != "clean" else (lambda: 0)
            summary = train(cfg, consumer, threading.Event(), process_start_s=time.time(), state=state)
    finally:
        state.close()
        TfStageAdapter.put = put  # type: ignore[method-assign]
    return {"steps": summary.steps, "overwritten": poisoned(), "devices": summary.devices}


def main(args: list[str]) -> int:
    from melfeed.consumer.placement import configure_memory
    from melfeed.shared.config.loader import load_config

    runs = list(zip(args[::2], args[1::2], strict=True))
    configure_memory(load_config(runs[0][1]))  # before any TensorFlow op: every run's config asks for 2 replicas
    print(json.dumps({mode: _train(config, mode) for mode, config in runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
