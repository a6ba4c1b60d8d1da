"""No step ever reads a reused slot: every released slot is overwritten with garbage at once, and the run
still ends bit-identical to a clean one.

The built-in loop (``train``: the ``Stager`` with the TensorFlow hand-off) runs in this process, fed by
real producer processes over shared-memory slots; the tiny step's variables depend on every byte of every
batch and on their order (momentum). The hook (``tests/slot_poison.py``) writes ``0x7F`` over the whole slot inside
``BatchRing.release``, before the slot can be leased again, so a step that still read a released slot
would train on huge values. The control run proves the hook bites: a hand-off that claims its copy
is done at once (``Staged.copied``), so the stager frees the slot before the step that reads it (the
ordering bug this guards against), ends with other variables. The same on two replicas:
tests/integration/train/test_replicas.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.feed import Consumer
from melfeed.consumer.handout import Batch
from melfeed.consumer.resume.checkpoint import latest_checkpoint
from melfeed.consumer.resume.state import RunState
from melfeed.consumer.staging import Staged
from melfeed.consumer.train.handoff import TfStageAdapter
from melfeed.consumer.train.loop import train
from melfeed.shared.config.loader import load_config
from tests import procs
from tests.slot_poison import scribble_on_release

_STEPS = 40


def _final_variables(state: Path) -> dict[str, np.ndarray]:
    found = latest_checkpoint(state)
    assert found is not None
    reader = tf.train.load_checkpoint(str(found[0] / "vars"))
    return {name: reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE") for name in ("w", "momentum", "iterations")}


def _train(config: Path, *, poison: bool) -> int:
    """One in-process run of the built-in loop; returns how many released slots were overwritten."""
    cfg = load_config(config)
    state = RunState.open(cfg, Consumer(cfg).manifest.fingerprint)
    assert state is not None
    try:
        with Consumer(cfg, start_batch=state.next_batch) as consumer:
            poisoned = scribble_on_release(consumer._ring) if poison else (lambda: 0)
            summary = train(cfg, consumer, threading.Event(), process_start_s=time.time(), state=state)
        assert summary.steps == _STEPS and not summary.interrupted
    finally:
        state.close()
    return poisoned()


def test_slots_overwritten_on_release_change_nothing_unless_released_before_the_step(
    demo_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "staging.log"
    endpoint = f"ipc://{tmp_path}/s.sock"
    configs = {
        name: procs.write_config(
            tmp_path / f"{name}.yaml",
            demo_cache,
            endpoint,
            tmp_path / name,
            _STEPS,
            producer={"count": 2},
            consumer={"feed_efficiency_steps": 0},
            buckets={"num_buckets": 1, "batch_size": 16},  # one program per run: the slots, not shapes, are the subject
        )
        for name in ("clean", "poisoned", "released_early")
    }
    producers = procs.start("producer", configs["clean"], log)  # one group serves the three consumers
    try:
        _train(configs["clean"], poison=False)
        assert _train(configs["poisoned"], poison=True) >= _STEPS
        put = TfStageAdapter.put

        def copied_at_once(self: TfStageAdapter, batch: Batch) -> Staged[dict[str, tf.Tensor]]:
            staged = put(self, batch)
            return Staged(staged.value, copied=lambda: True, host_copies=staged.host_copies)

        monkeypatch.setattr(TfStageAdapter, "put", copied_at_once)
        _train(configs["released_early"], poison=True)
    finally:
        procs.stop(producers)
    clean, poisoned, early = (_final_variables(tmp_path / name) for name in ("clean", "poisoned", "released_early"))
    assert int(clean["iterations"]) == _STEPS
    for name in clean:
        assert np.array_equal(clean[name], poisoned[name]), name
    assert not np.array_equal(clean["w"], early["w"])  # the hook bites when the order is wrong
    for name in ("clean", "poisoned"):
        rc, doc, text = procs.run_audit(tmp_path / name, tmp_path)
        assert rc == 0 and doc["applied"] == _STEPS, text
