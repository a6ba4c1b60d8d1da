"""No host read of a device tensor per step: the built-in loop reads the accumulated outputs once per interval.

The loop runs in this process over real producers; every host read of an eager tensor (``.numpy()``,
``float()``, ``int()``, ``bool()``) is counted, and so are the reads of the accumulated outputs. Status
lines are switched off (a huge ``status_interval_s``), so the reads are the checkpoints' (every M steps)
and the end's: N steps -> N/M + 1 reads. A loop that still read a loss per step would count >= N. TensorBoard
every M steps adds none: its writes take the checkpoints' reads and read no device tensor.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tensorflow.python.framework import ops

from melfeed.consumer.feed import Consumer
from melfeed.consumer.observe.board import Board
from melfeed.consumer.observe.telemetry import Telemetry
from melfeed.consumer.resume.state import RunState
from melfeed.consumer.train.device.accumulators import Accumulators
from melfeed.consumer.train.loop import train
from melfeed.shared.config.loader import load_config
from tests import procs
from tests.board_events import read_scalars

_STEPS, _EVERY = 60, 20


def test_the_loop_reads_device_tensors_once_per_interval_never_per_step(
    demo_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = procs.write_config(
        tmp_path / "run.yaml",
        demo_cache,
        f"ipc://{tmp_path}/s.sock",
        tmp_path / "state",
        _STEPS,
        producer={"count": 2},
        buckets={"num_buckets": 4},  # as the loss check expects
        consumer={"checkpoint_every_steps": _EVERY, "status_interval_s": 86400.0},
    )
    cfg = load_config(config)
    reads: list[int] = []
    host_reads = {"n": 0, "training": False}
    read, reset = Accumulators.read, Accumulators.reset

    def counted_read(self: Accumulators) -> Any:
        reads.append(1)
        return read(self)

    def training_starts(self: Accumulators) -> None:  # the last reset: after warm-up and the resident limit
        reads.clear()
        host_reads.update(n=0, training=True)
        reset(self)

    def counting(name: str) -> None:
        original = getattr(ops._EagerTensorBase, name)

        def wrapper(self: Any, *args: Any) -> Any:
            host_reads["n"] += host_reads["training"]
            return original(self, *args)

        monkeypatch.setattr(ops._EagerTensorBase, name, wrapper)

    for name in ("numpy", "__float__", "__int__", "__bool__", "__index__"):
        counting(name)
    monkeypatch.setattr(Accumulators, "read", counted_read)
    monkeypatch.setattr(Accumulators, "reset", training_starts)
    producers = procs.start("producer", config, tmp_path / "p.log")
    state = RunState.open(cfg, Consumer(cfg).manifest.fingerprint)
    assert state is not None
    try:
        with (
            Consumer(cfg, start_batch=state.next_batch) as consumer,
            Telemetry(cfg, consumer._telemetry_source(), time.time(), control_endpoint=None) as telemetry,
            Board(tmp_path / "tb", _EVERY, consumer._desk.next_id) as board,
        ):
            summary = train(
                cfg,
                consumer,
                threading.Event(),
                process_start_s=time.time(),
                state=state,
                telemetry=telemetry,
                board=board,
            )
    finally:
        state.close()
        procs.stop(producers)
    assert summary.steps == _STEPS and summary.first_loss is not None and summary.final_loss is not None
    assert summary.final_loss < summary.first_loss and summary.final_outputs["loss"] == summary.final_loss
    assert len(reads) == _STEPS // _EVERY + 1  # one per checkpoint, one at the end
    # the reads themselves plus the checkpoints' variable reads: a handful per interval, never one per step
    assert host_reads["n"] <= 10 * len(reads) < _STEPS, host_reads
    assert [step for step, _ in read_scalars(tmp_path / "tb")["train/loss"]] == [20, 40, 60]
