"""The built-in training loop: compiled step over the consumer's batches, status line, summary.

Order at start: bind and start receiving (producers fill the ring meanwhile), read each bucket's warm-up batch
(a real one of the plan, read from the cache: consumer/train/warm_batches.py), compile every bucket shape on it
(``CompiledStep.warm_up``: XLA or graph mode, ``model.jit_compile``; then the one-region programs, ``PackedSteps.
warm_up``), time the resident limit on it, then train through a ``Stager`` (consumer/staging.py), TF hand-off
(consumer/train/handoff.py): each batch's slot region is one uint8 tensor (DLPack, no copy; on a GPU one copy),
cut into arrays inside the program; up to ``consumer.stage_depth`` batches are in flight. The named outputs
accumulate on the device and are read only at each status interval, before each checkpoint and at the end (one
device drain each): the status line's means, the NaN/inf warning (one line per read in which the loss turned
non-finite), telemetry's loss and the summary's first/final outputs come from those reads.
Per step the loop writes the audit record and, when due, a checkpoint; the stager lets the steps in flight
complete before a step is dispatched past a checkpoint. Step time = the period between consecutive
dispatches less the wait for the batch (no per-step host read).
Stall % = time the loop waited for its next batch / wall time, after ``warmup_steps``. Feed efficiency = fed steps/s /
steps/s of the same step on the resident warm-up batches (``consumer.feed_efficiency_steps``, efficiency.py).
A factory that raises or returns no step, a step that cannot be compiled (``StepError``), breaks the output contract
or runs out of memory on a bucket (``ConfigError``, consumer/train/preflight.py) ends the run before READY; a step that
fails while training (``StepError``: the op and the user's line) ends it without a final checkpoint (a restart resumes
from the newest); the summary is written. Too many quarantined rows trained (``producer.max_quarantined_fraction``,
consumer/train/quarantine.py) stop the run as SIGTERM does (final checkpoint, summary with ``error``), then DataError.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import closing, nullcontext
from typing import TYPE_CHECKING, Any

from melfeed.consumer.feed import Consumer
from melfeed.consumer.observe.gpu import format_gpus
from melfeed.consumer.resume.state import RunState
from melfeed.consumer.staging import Stager
from melfeed.consumer.train.jit import remember_mode
from melfeed.consumer.train.meter import LoopMeter, format_status_line
from melfeed.consumer.train.preflight import out_of_memory_is_config
from melfeed.consumer.train.quarantine import ceiling_for
from melfeed.consumer.train.summary import TrainSummary, finish, summary_on_failure
from melfeed.consumer.train.warm_batches import WarmBatch, warm_batches
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import DataError
from melfeed.shared.metrics import PHASE_DONE, PHASE_TRAINING, PHASE_WAITING, StepRecord
from melfeed.shared.service.sdnotify import Notifier

if TYPE_CHECKING:
    from melfeed.consumer.job.cluster import Job
    from melfeed.consumer.observe.board import Board
    from melfeed.consumer.observe.telemetry import Telemetry
    from melfeed.consumer.train.device.packed import PackedSteps
    from melfeed.consumer.train.efficiency import ResidentLimit

__all__ = ["TrainSummary", "train"]

log = logging.getLogger(__name__)


def train(
    cfg: PipelineConfig,
    consumer: Consumer,
    stop: threading.Event,
    *,
    process_start_s: float,
    summary_path: str | None = None,
    state: RunState | None = None,
    notifier: Notifier | None = None,
    telemetry: Telemetry | None = None,
    on_step: Callable[[int], None] | None = None,
    job: Job | None = None,
    board: Board | None = None,
) -> TrainSummary:
    """Run the compiled step over ``consumer`` until the plan ends or ``stop`` is set.

    With ``state`` (built for ``consumer``'s start batch), the variables are restored from its
    checkpoint after warm-up, every applied batch is appended to the audit log, and a checkpoint
    is committed every ``consumer.checkpoint_every_steps`` and when the loop ends for any reason
    but a crash (plan finished, SIGTERM).
    With ``notifier`` (systemd): EXTEND_TIMEOUT_USEC while compiling, READY=1 after, STATUS= with the
    live figures of every status line, WATCHDOG=1 after every step and every bounded wait of the
    loop (never from another thread: a wedged loop must starve the watchdog), STOPPING=1 at the end.
    With ``telemetry``: a snapshot with every status line, during starved waits, and at the end. With ``board``
    (and ``telemetry``; consumer/observe/board.py): TensorBoard scalars at each status line or every
    ``consumer.tensorboard_every_steps`` steps (one more read of the accumulated outputs there), and at the end.
    ``on_step(steps_done)`` runs right after each step was dispatched (on the CPU: completed), while
    its slot is still held and inside the timed step (``bench`` models device time there with a sleep).
    With ``job`` (a multi-worker job, consumer/job/cluster.py) the step runs under its
    ``MultiWorkerMirroredStrategy`` on this rank's batches; the named scalars are the job's (all-reduced),
    checkpoints fall at the same steps on every rank (``state.due`` counts steps), and a peer lost
    during a collective raises ``JobLostError`` (no final checkpoint: the job resumes from a common one).
    Raises ``DataError`` after the final checkpoint and summary when ``producer.max_quarantined_fraction`` stopped it.
    """
    args = (cfg, consumer, stop, process_start_s, summary_path, state, notifier, telemetry, on_step)
    if job is None:
        return _train(*args, None, board if telemetry is not None else None)
    with job.guard("training"):
        return _train(*args, job, board if telemetry is not None else None)


def _train(
    cfg: PipelineConfig,
    consumer: Consumer,
    stop: threading.Event,
    process_start_s: float,
    summary_path: str | None,
    state: RunState | None,
    notifier: Notifier | None,
    telemetry: Telemetry | None,
    on_step: Callable[[int], None] | None,
    job: Job | None,
    board: Board | None,
) -> TrainSummary:
    from melfeed.consumer.placement import active_xla_cache_dir, step_devices, xla_cache_warm
    from melfeed.consumer.train.device.packed import PackedSteps
    from melfeed.consumer.train.factory import build_compiled_step
    from melfeed.consumer.train.handoff import TfStageAdapter, model_device

    notifier = notifier if notifier is not None else Notifier({})
    cache_dir = active_xla_cache_dir()
    out = TrainSummary(
        padding_efficiency=0.0,
        replicas=cfg.consumer.replica_count,
        rank=job.rank if job is not None else 0,
        world=job.world if job is not None else 1,
        partial=cfg.buckets.partial,
        samples_dropped_per_epoch=consumer.plan.samples_dropped_per_epoch,
        in_flight_bound_bytes=consumer._in_flight_bound_bytes(cfg.producer.count),
        xla_cache_dir=str(cache_dir) if cache_dir else None,
        xla_cache_warm=xla_cache_warm(cache_dir),
    )
    with summary_on_failure(out, summary_path):
        step_fn, compiled = build_compiled_step(cfg, consumer, state, job)
    log.info("step devices: %s", ", ".join(compiled.devices or [model_device() or "/device:CPU:0"]))  # replicas' or one
    consumer.start()
    busy = telemetry.live_while_busy(consumer._desk.next_id) if telemetry is not None else nullcontext()
    with (
        summary_on_failure(out, summary_path, consumer),
        notifier.extending_start_timeout(),
        busy,
        out_of_memory_is_config(consumer._bucket_set),
    ):  # status stays live; a bucket that does not fit: one line
        warm = warm_batches(consumer.plan, consumer._bucket_set, consumer.manifest, consumer._desk.next_id)
        packed = PackedSteps.for_buckets(compiled, consumer._bucket_set.buckets, model_device())
        try:  # settles the mode on the programs the loop runs, compiling each once
            out.compile_s = packed.warm_up(step_fn.variables(), warm)
        finally:  # XLA's failure stays the reason when graph mode fails too
            out.jit_reason = compiled.choice.reason if compiled.choice else None
        out.jit_compile = compiled.mode
        if state is not None and cfg.model.jit_compile == "auto" and compiled.choice is not None:
            remember_mode(state.root, compiled.choice)
        limit = _resident_limit(cfg, packed, step_fn, consumer, out, warm)
        items = _checkpoint_items(step_fn)
        if state is not None:
            state.restore_into(items)
    n_buckets = len(consumer._bucket_set.buckets)
    log.info("READY: compiled %d bucket shapes in %.1f s jit_compile=%s", n_buckets, out.compile_s, out.jit_compile)
    if telemetry is not None:
        telemetry.set_phase(PHASE_TRAINING)
        telemetry.set_jit_compile(out.jit_compile)
    notifier.ready(
        f"compiled {n_buckets} shapes ({out.jit_compile}) in {out.compile_s:.1f} s; "
        f"starting at batch {consumer._desk.next_id}"
    )

    def on_wait(producers_alive: int) -> None:
        if job is not None:
            job.check_waiting(consumer._desk.next_id, producers_alive)  # starved past the others' bound: 75
        notifier.watchdog()
        notifier.status(
            f"step {out.steps}: waiting for batch {consumer._desk.next_id}; producers alive {producers_alive}"
        )
        if telemetry is not None:
            telemetry.set_phase(PHASE_WAITING)
            telemetry.publish_if_due(out.steps, meter.last_loss, compiled.compiles_after_ready)

    def read_outputs() -> None:  # the host read of the interval (one device drain), never per step
        read = handoff.read()
        if board is not None:
            board.add_read(read)
        if meter.add_read(read):  # one line per read in which the loss turned NaN/inf
            log.warning(
                "loss turned NaN/inf at step %s (%d of %d steps since the last read): the model of %s may "
                "have diverged; training goes on",
                read.first_turn_step,
                read.nonfinite_steps,
                read.steps,
                cfg.model.step,
            )

    meter = LoopMeter(cfg.consumer.metrics_window_s)
    next_status_s = time.monotonic() + cfg.consumer.status_interval_s
    copies = 0
    payload_copies = 0  # page cache -> ring slot, summed over applied batches
    last_dispatch_s = 0.0
    handoff = TfStageAdapter(packed, model_device(), on_step, slot_buffer=consumer._ring.memory.buffer)
    stager = Stager(consumer, handoff, cfg.consumer.stage_depth)
    drain = state.due if state is not None else None  # a checkpoint sees exactly the applied batches
    ceiling = ceiling_for(cfg.producer.max_quarantined_fraction, consumer.plan)  # consumer/train/quarantine.py
    with (
        summary_on_failure(out, summary_path, consumer),
        closing(handoff),
        closing(stager.run(stop, on_wait, drain)) as completed,
    ):
        for done in completed:  # a failing body: in-flight steps settle in closing()
            step_t1 = time.perf_counter()
            batch = done.batch
            copies += done.host_copies
            payload_copies += batch.copies
            out.steps += 1
            log.debug("applied batch %d", batch.batch_id)
            if state is not None:
                state.record(batch.batch_id, batch.sample_ids, consumer._run_id)
                if state.due():
                    read_outputs()  # the checkpoint drains the device anyway
                    state.checkpoint(items, consumer._run_id, final=False)  # a failure: WARNING, retried
            if board is not None and telemetry is not None and board.is_due(out.steps):  # every N steps
                if board.needs_read(out.steps):
                    read_outputs()
                board.write(telemetry.snapshot(out.steps, meter.last_loss, compiled.compiles_after_ready))
            if ceiling.add(
                batch.sample_ids, batch.quarantined, utterance_ids=batch.utterance_ids, note=batch.quarantine_note
            ):  # the orderly stop: steps in flight complete, checkpoint
                log.error("%s; stopping after batch %d", ceiling.message(), batch.batch_id)
                stop.set()
            if out.time_to_first_step_s is None:
                out.time_to_first_step_s = time.time() - process_start_s
                out.devices = compiled.devices or step_devices(done.result.raw)
            if out.steps == cfg.consumer.warmup_steps + 1:
                meter.t0 = time.perf_counter()
                meter.wait0 = consumer._wait_s_total
            wait_s = consumer._wait_s_total - meter.wait_seen
            # the period since the previous dispatch, less the wait for this batch (no host read per step)
            period_s = max(0.0, done.dispatched_s - last_dispatch_s - wait_s) if last_dispatch_s else done.step_s
            last_dispatch_s = done.dispatched_s
            if out.steps > cfg.consumer.warmup_steps:
                record = StepRecord(
                    step_t1,
                    wait_s,
                    period_s,
                    done.rows,
                    done.real_frames,
                    done.padded_frames,
                    consumer._receiver.queue_depth(),
                    limit.step_s[batch.bucket] if limit is not None else None,
                )
                meter.add(record)
                if telemetry is not None:
                    telemetry.add(record)
            meter.wait_seen = consumer._wait_s_total
            out.samples += done.rows
            notifier.watchdog()
            if time.monotonic() >= next_status_s:
                read_outputs()
                gpus = format_gpus(telemetry.gpus()) if telemetry is not None else ""
                means = meter.outputs.take()
                notifier.status(_status_line(out.steps, means, meter, consumer, cfg, gpus))
                if telemetry is not None:
                    telemetry.set_phase(PHASE_TRAINING)
                    snap = telemetry.publish(out.steps, meter.last_loss, compiled.compiles_after_ready, outputs=means)
                    if board is not None and board.every_steps is None:
                        board.write(snap)
                next_status_s = time.monotonic() + cfg.consumer.status_interval_s
        read_outputs()  # the end: the last interval's outputs (drains the device)
    if consumer._desk.finished and ceiling.judge_at_end():  # a plan shorter than the judging window, every row bad
        log.error("%s", ceiling.message())
    out.interrupted = stop.is_set() and not consumer._desk.finished and not ceiling.tripped
    notifier.stopping(f"stopping at batch {consumer._desk.next_id}: checkpoint and exit")
    if state is not None:
        state.checkpoint(items, consumer._run_id, final=True)
        out.next_batch = state.next_batch
        out.checkpoint_failures = state.checkpoint_failures
    out.quarantined_samples = ceiling.quarantined
    if ceiling.tripped:
        out.error = ceiling.message(state.next_batch if state is not None else None, resumable=state is not None)
    out.first_loss = meter.first_loss
    finish(out, meter, consumer, compiled.compiles_after_ready, meter.last_outputs, copies + payload_copies)
    if telemetry is not None:
        final = telemetry.publish(
            out.steps, meter.last_loss, compiled.compiles_after_ready, phase=PHASE_DONE, outputs=meter.outputs.take()
        )
        if board is not None:
            board.write(final)
    if summary_path:
        out.write(summary_path)
    if ceiling.tripped and out.error is not None:  # after the checkpoint and the summary: exit 65, one line
        raise DataError(out.error)
    return out


def _resident_limit(
    cfg: PipelineConfig, packed: PackedSteps, step_fn: Any, consumer: Consumer, out: TrainSummary, warm: list[WarmBatch]
) -> ResidentLimit | None:
    """The resident-batch limit of the programs the loop runs on the warm-up batches (``consumer.feed_efficiency_
    steps`` per bucket; None when 0)."""
    from melfeed.consumer.train.efficiency import measure_resident_limit

    if cfg.consumer.feed_efficiency_steps == 0:
        return None
    limit = measure_resident_limit(
        packed,
        step_fn.variables(),
        [b.shapes() for b in consumer._bucket_set.buckets],
        cfg.consumer.feed_efficiency_steps,
        cfg.model.vocab_size,
        batches=warm,
    )
    out.resident_step_ms = [1000.0 * s for s in limit.step_s]
    out.feed_efficiency_measure_s = limit.measure_s
    return limit


def _checkpoint_items(step_fn: Any) -> dict[str, object]:
    """Named trackables when the step offers them (restorable by Keras users), else its variables."""
    items = getattr(step_fn, "checkpoint_items", None)
    return dict(items()) if callable(items) else {"variables": list(step_fn.variables())}


def _status_line(
    step: int, means: dict[str, float], meter: LoopMeter, consumer: Consumer, cfg: PipelineConfig, gpus: str = ""
) -> str:
    rs = consumer._receiver.stats()
    text = format_status_line(
        step=step,
        steps_total=cfg.consumer.steps,
        outputs=means,
        figures=meter.live.figures(time.perf_counter()),
        queue_depth=consumer._receiver.queue_depth(),
        producers_alive=rs.producers_alive,
        rejects=sum(rs.rejects.values()),
        quarantined=rs.quarantined,
        gpus=gpus,
    )
    log.info("%s", text)
    return text
