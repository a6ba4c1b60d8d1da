"""Live figures of a running consumer: the metrics snapshot (docs/reference/metrics.md).

Role: turns the step loop's records, the receiver's counters, the producers' heartbeat stage
counters and the GPU samples into one snapshot (``observe/snapshot.py``: the schema ``status``, ``report``,
Prometheus and TensorBoard read), every status interval and once at the end. ``build_snapshot`` and
``ProducerRates`` are pure (times passed in) so tests check them with hand-computed values;
``Telemetry`` is the I/O shell: GPU samplers, the JSONL file, the control socket, Prometheus.
Invariants: every schema field is present in every snapshot (null when not yet known); no float is
NaN or infinite (JSON stays strict); readers get a copy under a lock, never the writer's dict.
Shutdown: ``close()`` (idempotent) stops the servers and samplers with bounded joins and closes
the file; it must run before the consumer closes, whose ZeroMQ context the control socket shares.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import fields, replace
from typing import IO, Any, TypeVar

from melfeed.consumer.flow.peers import ProducerReport
from melfeed.consumer.observe.gpu import GpuSampler
from melfeed.consumer.observe.snapshot import GpuRow, ProducerRow, Snapshot, snapshot_dict
from melfeed.consumer.transport.receiver import ReceiverStats
from melfeed.shared.errors import ConfigError
from melfeed.shared.metrics import PHASE_COMPILING, PHASES, StepRecord, StepWindow, WindowFigures
from melfeed.shared.output_files import open_output

__all__ = ["ProducerRates", "build_snapshot", "Telemetry"]

log = logging.getLogger(__name__)

_BUSY_JOIN_S = 10.0  # a snapshot is built in milliseconds; the bound only matters if one hangs


def _num(value: float | None) -> float | None:
    """A JSON-safe figure: ``None`` for unknown, NaN or infinite."""
    return None if value is None or not math.isfinite(value) else float(value)


_Row = TypeVar("_Row", ProducerRow, GpuRow)


def _finite_row(row: _Row) -> _Row:
    """``row`` with every float made JSON-safe (``_num``)."""
    changes: dict[str, Any] = {f.name: _num(v) for f in fields(row) if isinstance(v := getattr(row, f.name), float)}
    return replace(row, **changes)


class _Series:
    """(time, cumulative value) points over a sliding window; the newest older point stays as the base."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._points: deque[tuple[float, Any]] = deque()

    def add(self, t_s: float, value: Any) -> None:
        if not self._points or t_s > self._points[-1][0]:
            self._points.append((t_s, value))

    def span(self, now_s: float) -> tuple[tuple[float, Any], tuple[float, Any]] | None:
        """Oldest and newest point of the window, or ``None`` with fewer than two."""
        while len(self._points) > 2 and self._points[1][0] <= now_s - self._window_s:
            self._points.popleft()
        return (self._points[0], self._points[-1]) if len(self._points) >= 2 else None

    def reset(self) -> None:
        self._points.clear()

    def last(self) -> Any:
        return self._points[-1][1] if self._points else None


class ProducerRates:
    """Per-producer batches/s and ms per batch per stage, from cumulative heartbeat counters.

    A producer whose counter went backwards was restarted (same id, new process): its history
    starts again. Producers no longer connected are forgotten.
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._series: dict[str, _Series] = {}

    def update(self, reports: Iterable[ProducerReport], now_s: float) -> list[ProducerRow]:
        rows = []
        alive = set()
        for rep in sorted(reports, key=lambda r: r.producer_id):
            alive.add(rep.producer_id)
            series = self._series.setdefault(rep.producer_id, _Series(self._window_s))
            if rep.stage is not None:
                last = series.last()
                if last is not None and rep.stage.batches < last.batches:
                    series.reset()
                series.add(rep.stage_at_s, rep.stage)
            rows.append(self._row(rep, series.span(now_s)))
        for gone in set(self._series) - alive:
            del self._series[gone]
        return rows

    @staticmethod
    def _row(rep: ProducerReport, span: tuple[tuple[float, Any], tuple[float, Any]] | None) -> ProducerRow:
        row = ProducerRow(
            id=rep.producer_id,
            batches=rep.stage.batches if rep.stage else None,
            batches_per_s=None,
            read_ms=None,
            assemble_ms=None,
            send_ms=None,
        )
        if span is None:
            return row
        (t0, a), (t1, b) = span  # StageCounters at the window's oldest and newest heartbeat
        n = b.batches - a.batches
        row = replace(row, batches_per_s=n / (t1 - t0))
        if n > 0:
            row = replace(
                row,
                read_ms=1000.0 * (b.read_s - a.read_s) / n,
                assemble_ms=1000.0 * (b.assemble_s - a.assemble_s) / n,
                send_ms=1000.0 * (b.send_s - a.send_s) / n,
            )
        return row


def build_snapshot(
    *,
    t_unix_s: float,
    uptime_s: float,
    phase: str,
    step: int,
    steps_total: int | None,
    loss: float | None,
    window_s: float,
    figures: WindowFigures | None,
    depth_hist: list[int],
    bytes_per_s: float | None,
    rs: ReceiverStats,
    producers: Sequence[ProducerRow],
    compiles_after_ready: int,
    gpus: Sequence[GpuRow],
    jit_compile: str | None = None,
    outputs: Mapping[str, float] | None = None,
    rank: int = 0,
    world: int = 1,
    checkpoint_failures: int = 0,
    connections_cut: int = 0,
) -> dict[str, Any]:
    """One snapshot (``observe/snapshot.py``) in its JSON form; pure.

    ``outputs`` are the step's named scalars averaged over the status interval (``loss`` first);
    ``jit_compile`` is "xla" or "graph" once the step is compiled; ``rank`` of ``world``: this
    consumer's place in a multi-worker job (0 of 1 alone).
    """
    f = figures
    fed = f.feed_efficiency if f else None
    return snapshot_dict(
        Snapshot(
            t_unix_s=t_unix_s,
            uptime_s=uptime_s,
            phase=phase,
            step=step,
            steps_total=steps_total,
            loss=_num(loss),
            window_s=window_s,
            stall_pct=_num(f.stall_pct) if f else None,
            batches_per_s=_num(f.batches_per_s) if f else None,
            samples_per_s=_num(f.samples_per_s) if f else None,
            bytes_per_s=_num(bytes_per_s),
            step_p50_ms=_num(1000.0 * f.step_p50_s) if f else None,
            step_p99_ms=_num(1000.0 * f.step_p99_s) if f else None,
            step_cv=_num(f.step_cv) if f else None,
            padding_efficiency=_num(f.padding_efficiency) if f else None,
            queue_depth_mean=_num(f.queue_depth_mean) if f else None,
            queue_depth_hist=list(depth_hist),
            lease_window=rs.lease_window,
            leases_outstanding=rs.leases_outstanding,
            producers_alive=rs.producers_alive,
            producers=[_finite_row(p) for p in producers],
            rejects=dict(sorted(rs.rejects.items())),
            duplicates=rs.duplicates_dropped,
            quarantined=rs.quarantined,
            compiles_after_ready=compiles_after_ready,
            gpus=[_finite_row(g) for g in gpus],
            jit_compile=jit_compile,
            outputs={name: _num(v) for name, v in (outputs or {}).items()},
            producers_benched=list(rs.producers_benched),
            rank=rank,
            world=world,
            checkpoint_failures=checkpoint_failures,
            connections_cut=connections_cut,
            feed_efficiency=_num(fed),
            hello_repeats=rs.hello_repeats,
            # useful work = feed efficiency x padding efficiency
            # (docs/guide/watching.md, "The three figures that matter")
            useful_work=_num(fed * f.padding_efficiency) if f and fed is not None else None,
        )
    )


class Telemetry:
    """Publishes snapshots of ``consumer``; start with ``with Telemetry(...) as tel:`` (see app.py).

    Args:
        cfg: the pipeline config (``consumer.metrics_*``, ``gpu_sample_interval_s``, ``control_endpoint``).
        consumer: the started ``Consumer`` (receiver stats, ZeroMQ context).
        process_start_s: wall-clock start of the process (uptime).
        control_endpoint: where the REP socket for ``status`` binds (``None`` = no control socket).
        checkpoint_failures: how many periodic checkpoints failed so far (``RunState``), if any state.
    """

    def __init__(
        self,
        cfg: Any,
        consumer: Any,
        process_start_s: float,
        *,
        control_endpoint: str | None,
        checkpoint_failures: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._cfg, self._consumer = cfg, consumer
        self._checkpoint_failures = checkpoint_failures
        self._start_s = process_start_s
        self._clock, self._wall = clock, wall
        c = cfg.consumer
        self._window = StepWindow(window_s=c.metrics_window_s)
        self._producers = ProducerRates(c.metrics_window_s)
        self._bytes = _Series(c.metrics_window_s)
        self._control_endpoint = control_endpoint
        self._phase = PHASE_COMPILING
        self._jit_compile: str | None = None
        self._outputs: dict[str, float] = {}
        self._lock = threading.Lock()
        self._latest: dict[str, Any] | None = None
        self._latest_json = b"null"
        self._last_publish_s = -math.inf
        self._file: IO[str] | None = None
        self._samplers: list[tuple[str, Any]] = []
        self._servers: list[Any] = []
        self._closed = False

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Open the metrics file, start GPU sampling, the control socket and Prometheus; publish once.

        Raises:
            ConfigError: the metrics file cannot be appended to, an endpoint or port cannot be bound,
                or prometheus_client is missing (each names its key).
        """
        from melfeed.consumer.observe.control import ControlServer
        from melfeed.consumer.observe.prom import start_prometheus

        c = self._cfg.consumer
        try:
            if c.metrics_file is not None:
                self._file = open_metrics_file(c.metrics_file)
            self._samplers = start_samplers(self._cfg)
            self.publish(0, None, 0)  # before any reader can ask: never an empty answer
            if self._control_endpoint is not None:
                server = ControlServer(self._consumer.zmq_context(), self._control_endpoint, self.latest_json)
                server.start()
                self._servers.append(server)
            if c.metrics_port is not None:
                self._servers.append(start_prometheus(c.metrics_host, c.metrics_port, self.latest))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop servers and samplers, close the file. Idempotent; every join is bounded."""
        if self._closed:
            return
        self._closed = True
        for server in reversed(self._servers):
            server.close()
        for _, sampler in self._samplers:
            sampler.stop()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Telemetry:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the step loop's side ---------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self._phase = phase

    def set_jit_compile(self, mode: str | None) -> None:
        """How the step was compiled ("xla" or "graph"), for every later snapshot."""
        self._jit_compile = mode

    def add(self, record: StepRecord) -> None:
        """One applied batch (after warm-up), for the windowed figures."""
        self._window.add(record)

    def gpus(self) -> list[dict[str, Any]] | None:
        """Latest GPU samples with their role; ``None`` when sampling is off."""
        if self._cfg.consumer.gpu_sample_interval_s <= 0:
            return None
        return [{"role": role, **g} for role, sampler in self._samplers for g in sampler.snapshot()]

    @contextlib.contextmanager
    def live_while_busy(self, step: int = 0) -> Iterator[None]:
        """Publish every status interval from a helper thread while the step loop cannot (compiling), so that
        ``status`` shows the producers joining. The loop does not publish inside the block; the thread is
        joined (bounded) before it returns, so the snapshot keeps one writer at a time."""
        done = threading.Event()

        def run() -> None:
            while not done.wait(self._cfg.consumer.status_interval_s):
                try:
                    self.publish(step, None, 0)
                except Exception:  # a reader-side figure must never end the start-up
                    log.exception("publishing a snapshot while busy failed; the next comes after start-up")
                    return

        thread = threading.Thread(target=run, name="telemetry-busy", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(_BUSY_JOIN_S)

    def publish_if_due(self, step: int, loss: float | None, compiles_after_ready: int) -> None:
        """Publish when a status interval passed since the last snapshot (the loop is starved)."""
        if self._clock() - self._last_publish_s >= self._cfg.consumer.status_interval_s:
            self.publish(step, loss, compiles_after_ready)

    def publish(
        self,
        step: int,
        loss: float | None,
        compiles_after_ready: int,
        phase: str | None = None,
        outputs: Mapping[str, float] | None = None,
    ) -> dict[str, Any]:
        """Build a snapshot, append it to the metrics file and hand it to the readers.

        ``outputs``: the named scalars' means of the status interval that just ended; None keeps
        the previous ones (a starved loop publishes without new steps).
        """
        if phase is not None:
            self.set_phase(phase)
        if outputs is not None and outputs:
            self._outputs = dict(outputs)
        now = self._clock()
        snap = self._build(now, step, loss, compiles_after_ready)
        text = json.dumps(snap, allow_nan=False)
        with self._lock:
            self._latest, self._latest_json = snap, text.encode()
        self._last_publish_s = now
        if self._file is not None:
            self._write(text)
        return snap

    def snapshot(self, step: int, loss: float | None, compiles_after_ready: int) -> dict[str, Any]:
        """A snapshot of now, not published (``publish`` builds each one here; TensorBoard's every-N-steps writes
        take one between status lines). ``outputs``: the latest published means."""
        return self._build(self._clock(), step, loss, compiles_after_ready)

    def _build(self, now: float, step: int, loss: float | None, compiles_after_ready: int) -> dict[str, Any]:
        rs = self._consumer.receiver_stats()
        self._bytes.add(now, rs.bytes_received)
        span = self._bytes.span(now)
        bytes_per_s = (span[1][1] - span[0][1]) / (span[1][0] - span[0][0]) if span else None
        snap = build_snapshot(
            t_unix_s=self._wall(),
            uptime_s=self._wall() - self._start_s,
            phase=self._phase,
            step=step,
            steps_total=self._cfg.consumer.steps,
            loss=loss,
            window_s=self._cfg.consumer.metrics_window_s,
            figures=self._window.figures(now),
            depth_hist=self._window.depth_histogram(now),
            bytes_per_s=bytes_per_s,
            rs=rs,
            producers=self._producers.update(rs.producers, now),
            compiles_after_ready=compiles_after_ready,
            gpus=[GpuRow(**g) for g in self.gpus() or ()],
            jit_compile=self._jit_compile,
            outputs=self._outputs,
            rank=getattr(self._consumer, "rank", 0),
            world=getattr(self._consumer, "world", 1),
            checkpoint_failures=self._checkpoint_failures() if self._checkpoint_failures is not None else 0,
            connections_cut=getattr(self._consumer, "connections_cut", 0),
        )
        return snap

    def _write(self, text: str) -> None:
        assert self._file is not None
        try:
            self._file.write(text + "\n")  # line-buffered: one write(2) per snapshot
        except OSError as err:  # disk full mid-run: keep training, stop writing
            log.warning(
                "metrics file %s: %s; no more snapshots are written", self._cfg.consumer.metrics_file, err.strerror
            )
            self._file.close()
            self._file = None

    # --- readers (any thread) ---------------------------------------------------------------------
    def latest(self) -> dict[str, Any] | None:
        """A copy of the newest snapshot."""
        with self._lock:
            return copy.deepcopy(self._latest)

    def latest_json(self) -> bytes:
        """The newest snapshot as JSON bytes (immutable, so no copy is needed)."""
        with self._lock:
            return self._latest_json


def open_metrics_file(path: str) -> IO[str]:
    """Open the JSONL file for line-buffered appending; ``ConfigError`` naming the key if it cannot be.

    A new file is 0640 whatever the umask (``melfeed.shared.output_files``); an existing one keeps its mode. A
    symbolic link in its place, or another user's file in /tmp, is refused (``open_output``).
    """
    try:
        return os.fdopen(
            open_output(path, append=True, what="consumer.metrics_file"), "a", buffering=1, encoding="utf-8"
        )
    except OSError as err:
        raise ConfigError(f"cannot append to {path}: {err.strerror}", path=("consumer", "metrics_file")) from err


def start_samplers(cfg: Any) -> list[tuple[str, GpuSampler]]:
    """One NVML sampler per role: the model GPU(s) (``consumer.model_gpu``, else this process's
    CUDA_VISIBLE_DEVICES) and the data GPU(s) (``producer.data_gpu``; none when empty).

    NVML sees every physical GPU whatever CUDA_VISIBLE_DEVICES says, so the consumer samples both roles.
    """
    interval_s = cfg.consumer.gpu_sample_interval_s
    if interval_s <= 0:
        return []
    samplers = [("model", GpuSampler(interval_s, visible=cfg.consumer.model_gpu))]
    if cfg.producer.data_gpu:
        samplers.append(("data", GpuSampler(interval_s, visible=cfg.producer.data_gpu)))
    for _, sampler in samplers:
        sampler.start()
    return samplers
