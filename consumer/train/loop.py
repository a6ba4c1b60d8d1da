"""The built-in training loop: compiled step over the consumer's batches, status line, summary.

Order at start: bind and start receiving (producers fill the ring meanwhile), compile every bucket
shape (``CompiledStep.warm_up``), then train. Each step hands the slot to TensorFlow with DLPack
(no copy), runs the compiled step, reads the loss (the step has finished reading the slot) and
releases the slot. On a GPU, eager dispatch is asynchronous and the DLPack tensor is copied to the
device by the call itself; the next batch is already in the ring, so the hand-off overlaps.
Stall % = time the loop waited for its next batch / wall time, after ``warmup_steps``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from consumer.feed import Consumer
from consumer.resume.state import RunState
from shared.config import PipelineConfig
from shared.metrics import PHASE_DONE, PHASE_TRAINING, PHASE_WAITING, StepRecord, StepWindow
from consumer.observe.gpu import format_gpus
from shared.service.sdnotify import Notifier

if TYPE_CHECKING:
    from consumer.observe.telemetry import Telemetry

__all__ = ["TrainSummary", "train"]

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    steps: int = 0
    samples: int = 0
    batches_applied: int = 0
    batches_per_s: float = 0.0
    samples_per_s: float = 0.0
    stall_pct: float = 0.0
    padding_efficiency: float = 0.0
    duplicates_dropped: int = 0
    quarantined_samples: int = 0        # bad cache rows left empty (names in the producers' logs)
    step_p50_ms: float | None = None    # compiled step time after warm-up (nearest-rank percentiles)
    step_p99_ms: float | None = None
    step_cv: float | None = None        # std / mean of the step time: jitter (recompiles, contention)
    rejects: dict[str, int] = field(default_factory=dict)
    compiles_after_ready: int = 0
    producers_seen: int = 0
    final_loss: float | None = None
    first_loss: float | None = None
    compile_s: float = 0.0
    time_to_first_step_s: float | None = None
    in_flight_bound_bytes: int = 0
    payload_copies_per_batch: float = 0.0
    interrupted: bool = False
    next_batch: int | None = None       # resume position of the final checkpoint (with a state_dir)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")


class _Meter:
    """Counters since warm-up plus a window for the periodic status line."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.wait0 = 0.0
        self.batches = self.samples = self.real_frames = self.padded_frames = 0
        self.win_t = self.win_wait = 0.0
        self.win_batches = self.win_samples = 0
        self.wait_seen = 0.0
        # Every post-warm-up step (the newest 100k on longer runs): step time percentiles and CV.
        self.steps = StepWindow(window_s=math.inf, max_records=100_000)


def train(cfg: PipelineConfig, consumer: Consumer, stop: threading.Event, *, process_start_s: float,
          summary_path: str | None = None, state: RunState | None = None,
          notifier: Notifier | None = None, telemetry: Telemetry | None = None,
          on_step: Callable[[int], None] | None = None) -> TrainSummary:
    """Run the compiled step over ``consumer`` until the plan ends or ``stop`` is set.

    With ``state`` (built for ``consumer``'s start batch), the variables are restored from its
    checkpoint after warm-up, every applied batch is appended to the audit log, and a checkpoint
    is committed every ``consumer.checkpoint_every_steps`` and when the loop ends for any reason
    but a crash (plan finished, SIGTERM).
    With ``notifier`` (systemd): EXTEND_TIMEOUT_USEC while compiling, READY=1 after, STATUS= with the
    live figures of every status line, WATCHDOG=1 after every step and every bounded wait of the
    loop (never from another thread: a wedged loop must starve the watchdog), STOPPING=1 at the end.
    With ``telemetry``: a snapshot with every status line, during starved waits, and at the end.
    ``on_step(steps_done)`` runs after each step's loss was read, while its slot is still held and
    inside the timed step (``bench`` models device time there with a sleep).
    """
    notifier = notifier if notifier is not None else Notifier({})
    from consumer.train.model import StepSpec
    from consumer.train.step import CompiledStep, load_step_factory, to_tensors

    factory = load_step_factory(cfg.model.step)
    m = cfg.model
    step_fn = factory(StepSpec(cfg.n_mels, m.vocab_size, m.learning_rate, m.mixed_precision, m.seed))
    compiled = CompiledStep(step_fn, [b.shapes() for b in consumer.bucket_set.buckets])
    consumer.start()
    out = TrainSummary(padding_efficiency=0.0,
                       in_flight_bound_bytes=consumer.in_flight_bound_bytes(cfg.producer.count))
    with _extending_start_timeout(notifier):
        out.compile_s = compiled.warm_up()
        items = _checkpoint_items(step_fn)
        if state is not None:
            state.restore_into(items)
    log.info("READY: compiled %d bucket shapes in %.1f s", len(consumer.bucket_set.buckets), out.compile_s)
    if telemetry is not None:
        telemetry.set_phase(PHASE_TRAINING)
    notifier.ready(f"compiled {len(consumer.bucket_set.buckets)} shapes in {out.compile_s:.1f} s; "
                   f"starting at batch {consumer.next_apply}")

    def on_wait(producers_alive: int) -> None:
        notifier.watchdog()
        notifier.status(f"step {out.steps}: waiting for batch {consumer.next_apply}; "
                        f"producers alive {producers_alive}")
        if telemetry is not None:
            telemetry.set_phase(PHASE_WAITING)
            telemetry.publish_if_due(out.steps, loss_v, compiled.compiles_after_ready)

    meter = _Meter()
    next_status_s = time.monotonic() + cfg.consumer.status_interval_s
    loss_v = math.nan
    copies = 0
    payload_copies = 0                  # page cache -> ring slot, summed over applied batches
    for batch in consumer.batches(stop, on_wait):
        step_t0 = time.perf_counter()
        tensors, n_copies = to_tensors(batch.arrays)
        loss_v = float(compiled.run(batch.bucket, tensors))   # sync: the step finished reading the slot
        if on_step is not None:
            on_step(out.steps + 1)
        step_t1 = time.perf_counter()
        copies += n_copies
        payload_copies += batch.copies
        out.steps += 1
        if state is not None:
            state.record(batch.batch_id, batch.sample_ids, consumer.epoch)
            if state.due():
                state.checkpoint(items, consumer.epoch)
        if out.time_to_first_step_s is None:
            out.time_to_first_step_s = time.time() - process_start_s
            out.first_loss = loss_v
        if out.steps == cfg.consumer.warmup_steps + 1:
            meter.t0 = meter.win_t = time.perf_counter()
            meter.wait0 = meter.win_wait = consumer.wait_s_total
        if out.steps > cfg.consumer.warmup_steps:
            rows = batch.rows
            meter.batches += 1
            meter.samples += rows
            meter.win_batches += 1
            meter.win_samples += rows
            meter.real_frames += batch.real_frames
            meter.padded_frames += batch.padded_frames
            record = StepRecord(step_t1, consumer.wait_s_total - meter.wait_seen, step_t1 - step_t0, rows,
                                batch.real_frames, batch.padded_frames, consumer.queue_depth())
            meter.steps.add(record)
            if telemetry is not None:
                telemetry.add(record)
        meter.wait_seen = consumer.wait_s_total
        out.samples += batch.rows
        notifier.watchdog()
        if time.monotonic() >= next_status_s:
            gpus = format_gpus(telemetry.gpus()) if telemetry is not None else ""
            notifier.status(_status_line(out.steps, loss_v, meter, consumer, cfg, gpus))
            if telemetry is not None:
                telemetry.set_phase(PHASE_TRAINING)
                telemetry.publish(out.steps, loss_v, compiled.compiles_after_ready)
            next_status_s = time.monotonic() + cfg.consumer.status_interval_s
    out.interrupted = stop.is_set() and not consumer.finished
    notifier.stopping(f"stopping at batch {consumer.next_apply}: checkpoint and exit")
    if state is not None:
        state.checkpoint(items, consumer.epoch)
        out.next_batch = state.next_batch
    _finish(out, meter, consumer, compiled.compiles_after_ready, loss_v, copies + payload_copies)
    if telemetry is not None:
        telemetry.publish(out.steps, loss_v, compiled.compiles_after_ready, phase=PHASE_DONE)
    if summary_path:
        out.write(summary_path)
    return out


def _checkpoint_items(step_fn: Any) -> dict[str, object]:
    """Named trackables when the step offers them (restorable by Keras users), else its variables."""
    items = getattr(step_fn, "checkpoint_items", None)
    return dict(items()) if callable(items) else {"variables": list(step_fn.variables())}


@contextmanager
def _extending_start_timeout(notifier: Notifier, every_s: float = 10.0) -> Iterator[None]:
    """Compiling can outlast TimeoutStartSec: ask systemd for more time until READY."""
    done = threading.Event()

    def extend() -> None:
        while not done.is_set():
            notifier.extend_timeout(every_s * 3)
            done.wait(every_s)

    thread = threading.Thread(target=extend, name="sd-extend", daemon=True) if notifier.enabled else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread is not None:
            thread.join(every_s)


def _status_line(step: int, loss: float, meter: _Meter, consumer: Consumer, cfg: PipelineConfig,
                 gpus: str = "") -> str:
    now = time.perf_counter()
    span = max(1e-9, now - meter.win_t) if meter.win_t else 0.0
    rate = meter.win_batches / span if span else 0.0
    srate = meter.win_samples / span if span else 0.0
    stall = 100.0 * (consumer.wait_s_total - meter.win_wait) / span if span else 0.0
    rs = consumer.receiver_stats()
    total = f"/{cfg.consumer.steps}" if cfg.consumer.steps else ""
    text = (f"step {step}{total} loss {loss:.4f} | {rate:.1f} batches/s {srate:.0f} samples/s | "
            f"stall {stall:.1f}% | queue {consumer.queue_depth()} | producers {rs.producers_alive} | "
            f"rejects {sum(rs.rejects.values())}" + (f" | quarantined {rs.quarantined}" if rs.quarantined else "")
            + (f" | {gpus}" if gpus else ""))
    log.info("%s", text)
    if meter.win_t:
        meter.win_t, meter.win_wait = now, consumer.wait_s_total
        meter.win_batches = meter.win_samples = 0
    return text


def _finish(out: TrainSummary, meter: _Meter, consumer: Consumer, compiles: int, loss: float,
            copies: int) -> None:
    wall = time.perf_counter() - meter.t0 if meter.t0 else 0.0
    rs = consumer.receiver_stats()
    out.batches_applied = consumer.applied
    if wall > 0:
        out.batches_per_s = meter.batches / wall
        out.samples_per_s = meter.samples / wall
        out.stall_pct = 100.0 * (consumer.wait_s_total - meter.wait0) / wall
    out.padding_efficiency = meter.real_frames / meter.padded_frames if meter.padded_frames else 0.0
    out.duplicates_dropped = rs.duplicates_dropped
    out.quarantined_samples = rs.quarantined
    figures = meter.steps.figures(time.perf_counter())
    if figures is not None:
        out.step_p50_ms, out.step_p99_ms = 1000 * figures.step_p50_s, 1000 * figures.step_p99_s
        out.step_cv = figures.step_cv
    out.rejects = rs.rejects
    out.compiles_after_ready = compiles
    out.producers_seen = rs.producers_seen
    out.final_loss = None if math.isnan(loss) else loss
    # Mean over applied batches of the copies into the slot (shared memory: page cache -> slot = 1; payload:
    # page cache -> producer buffer -> kernel socket -> libzmq -> slot = 4) plus to_tensors' (DLPack: none).
    out.payload_copies_per_batch = copies / out.steps if out.steps else 0.0
    summary: dict[str, Any] = {k: v for k, v in asdict(out).items() if k != "rejects"}
    log.info("summary %s rejects=%s", json.dumps(summary), out.rejects)
