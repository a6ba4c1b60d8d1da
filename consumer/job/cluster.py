"""This consumer as one worker of ``tf.distribute.MultiWorkerMirroredStrategy``: start, agree, lose a peer.

Role: the TensorFlow side of a multi-worker job (docs/design.md, "Ranks"). ``start_job`` builds
the strategy from the ``TF_CONFIG`` the consumer already resolved (``shared/service/tf_config.py``;
``--tf-config FILE`` is exported as ``TF_CONFIG`` first), before any other TensorFlow op initialises
the runtime; ``Job.agree`` is the collective that picks the checkpoint every rank resumes from
(``consumer/job/agree.py`` is the rule); ``Job.guard`` turns a collective that failed because a peer is
gone into one ``JobLostError`` line. No cluster manager or side channel of melfeed's own: the ranks
meet only in TensorFlow's collectives and its coordination service.

Bounds, TensorFlow's own mechanisms, set from the config:
    * ``consumer.peer_timeout_s``: the coordination service's heartbeat timeout. A rank that died or
      froze (SIGKILL, SIGSTOP, host down) stops heartbeating; after this long every other rank's
      pending and next collective fails ("tasks are unhealthy"). A rank whose process is gone with
      its sockets (the chief, which hosts the service, or a refused connection) is noticed sooner.
    * ``consumer.collective_timeout_s``: ``CommunicationOptions(timeout_seconds=...)`` on every
      collective, and how long the ranks wait for each other to join at start (the service's
      registration timeout, backed by ``faulthandler``'s watchdog, which ends a process still waiting:
      exit 1). A live rank that stops stepping (stopped alone, starved of data, a long checkpoint
      write) holds the others at their next collective for at most this long.
Invariants:
    * ``start_job`` returns ``None`` for a world of 1: nothing here runs, today's single consumer.
    * Every rank calls ``agree`` exactly once, before its consumer binds (same collective order on
      every rank), and gets the same answer.
    * A lost peer is never a traceback and never a hang: one line naming this rank and what TensorFlow
      said, exit ``EXIT_JOB_LOST`` (non-zero, not 78: systemd's ``Restart=on-failure`` restarts it).
Shutdown: nothing to release; TensorFlow tears the collective runtime down with the process. While ``start_job``
waits for the other ranks, SIGINT and SIGTERM end the process at once (their default action: nothing is open
yet), since the join holds the GIL and no Python handler could run before it returns.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from melfeed.consumer.job.agree import (
    REFUSED,
    common_rows,
    common_step,
    offer_row,
    refused_ranks,
    settings_mismatch,
    settings_row,
)
from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import ConfigError, JobLostError, StepError
from melfeed.shared.service.tf_config import WorkerPlace

__all__ = ["Job", "collective_implementation", "ended_by_signals", "lost_contact_error", "server_error", "start_job"]

log = logging.getLogger(__name__)

_MAX_WHY_CHARS = 300
_JOIN_GRACE_S = 10.0  # past consumer.collective_timeout_s: TensorFlow's own join timeout goes first
_NO_SERVER = "Could not start gRPC server"  # TensorFlow's UnknownError when its port cannot be bound
_FUNCTION_NODE = re.compile(r"\{\{function_node [^}]*\}\}\s*")  # an eager op's name before its reason
_MILLI = 1000  # the planner's weights travel as integer thousandths (shared/wire/grid.py ShapeCost)


class Job:
    """The strategy of a multi-worker job and this worker's place in it."""

    def __init__(self, place: WorkerPlace, strategy: Any, cfg: PipelineConfig) -> None:
        self.place = place
        self.strategy = strategy
        self.peer_timeout_s = cfg.consumer.peer_timeout_s
        self.collective_timeout_s = cfg.consumer.collective_timeout_s
        self._waiting_for: int | None = None  # the batch this rank's loop is starved of (check_waiting)
        self._waiting_since_s = 0.0

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def world(self) -> int:
        return self.place.world

    def check_settings(self, settings: Mapping[str, object] | None) -> None:
        """Stop every rank unless every rank offers the same ``settings`` (``consumer/job/agree.py``).

        A collective (every rank calls it once, before ``agree``); ``None``: this rank cannot start (it raises
        its own error after this call) and the others stop with it.

        Raises:
            ConfigError: some rank's settings differ, or some rank cannot start (the same line on every rank).
            JobLostError: a peer is gone.
        """
        rows = self._gather_rows(settings_row(settings), "comparing the ranks' settings")
        self._refuse_with(refused_ranks(rows), "its cache or config")
        problem = settings_mismatch(rows, settings) if settings is not None else None
        if problem is not None:
            raise ConfigError(problem)

    def agree(self, committed: Sequence[int] | None) -> int | None:
        """The step every rank resumes from: the newest that all committed (None: none has any).

        A collective (``strategy.gather`` of each rank's ``offer_row``): every rank must call it. ``committed``
        ``None``: this rank cannot use its state directory (it raises its own error after this call).

        Raises:
            LookupError: some rank has checkpoints but no step is on every rank (the caller words it).
            ConfigError: some rank cannot use its state directory (the same line on every rank).
            JobLostError: a peer is gone.
        """
        rows = self._gather_rows(offer_row(committed), "agreeing on the checkpoint to resume from")
        self._refuse_with(refused_ranks(rows), "its state directory")
        step = common_step(rows)
        log.info(
            "rank %d of %d: the job resumes from %s (offers newest first: %s)",
            self.rank,
            self.world,
            f"step {step}" if step is not None else "the start",
            [[s for s in r if s >= 0] for r in rows],
        )
        return step

    def agree_rows(self, rows: Sequence[int] | None, n_buckets: int) -> list[int]:
        """Each bucket's rows for the whole job (``buckets.batch_size: auto``): the smallest any rank offers, so it
        fits and runs on every rank. A collective; ``None``: this rank cannot start (it raises its own error after).

        Raises:
            ConfigError: some rank cannot start (the same line on every rank). JobLostError: a peer is gone.
        """
        offer = list(rows) if rows is not None else [REFUSED] * n_buckets
        gathered = self._gather_rows(offer, "agreeing on the rows per bucket")
        self._refuse_with(refused_ranks(gathered), "its rows per bucket")
        agreed = common_rows(gathered, n_buckets)
        log.info("rank %d of %d: rows by bucket %s for the job (offers: %s)", self.rank, self.world, agreed, gathered)
        return agreed

    def agree_costs(self, costs: tuple[float, float] | None) -> tuple[float, float]:
        """The planner's weights for the whole job (``buckets.cost: measured``): rank 0's, so every rank builds
        the same plan. A collective; ``None``: this rank cannot start (it raises its own error after).

        Raises:
            ConfigError: some rank cannot start (the same line on every rank). JobLostError: a peer is gone.
        """
        offer = [round(c * _MILLI) for c in costs] if costs is not None else [REFUSED, REFUSED]
        gathered = self._gather_rows(offer, "agreeing on the planner's measured weights")
        self._refuse_with(refused_ranks(gathered), "its measured weights")
        token, attention = (v / _MILLI for v in gathered[0])
        log.info(
            "rank %d of %d: token_cost %g attention_cost %g for the job (rank 0's; offers in thousandths: %s)",
            self.rank,
            self.world,
            token,
            attention,
            gathered,
        )
        return token, attention

    def _refuse_with(self, refused: list[int], what: str) -> None:
        others = [rank for rank in refused if rank != self.rank]
        if others:
            who = f"rank {others[0]}" if len(others) == 1 else f"ranks {', '.join(map(str, others))}"
            raise ConfigError(
                f"{who} of the job refused to start ({what}; the log of {who} says why): "
                f"rank {self.rank} stops too; fix {who}, then start every rank again"
            )

    def _gather_rows(self, row: list[int], doing: str) -> list[list[int]]:
        """Every rank's ``row`` (index = rank), gathered over the job: one collective."""
        import tensorflow as tf

        strategy = self.strategy

        # a tf.function: eagerly, the strategy warns that its collectives are slow there (TensorFlow is untyped)
        @tf.function  # type: ignore[untyped-decorator]
        def gather(offer: tf.Tensor) -> tf.Tensor:
            return strategy.gather(strategy.run(lambda: tf.identity(offer)), axis=0)

        with self.guard(doing):
            gathered = gather(tf.constant([row], tf.int64)).numpy().reshape(-1, len(row))
        local = len(self.strategy.extended.worker_devices)  # each local replica offered the same row
        return [list(map(int, r)) for r in gathered[::local]]

    def check_waiting(self, batch_id: int, producers_alive: int, now_s: float | None = None) -> None:
        """Called by the loop after every bounded wait in which batch ``batch_id`` did not come.

        The other ranks cannot step without this one: once this rank has waited for one batch longer than
        ``consumer.collective_timeout_s``, they have given up waiting for it in their collective. Waiting on
        would hold a process of a job that is gone, and the restarted ranks could not form a new job.

        Raises:
            JobLostError: this rank has waited for ``batch_id`` longer than ``consumer.collective_timeout_s``.
        """
        now_s = time.monotonic() if now_s is None else now_s
        if batch_id != self._waiting_for:
            self._waiting_for, self._waiting_since_s = batch_id, now_s
        elif now_s - self._waiting_since_s > self.collective_timeout_s:
            raise JobLostError(
                self.rank,
                f"training: no batch {batch_id} from this rank's producers (alive: "
                f"{producers_alive}) for {now_s - self._waiting_since_s:.0f} s "
                "(consumer.collective_timeout_s), so the other ranks, which cannot step "
                "without this one, have given up",
            )

    @contextmanager
    def guard(self, doing: str) -> Iterator[None]:
        """Inside: a collective failing because a peer is gone raises ``JobLostError`` (one line)."""
        try:
            yield
        except Exception as err:
            # a failed step is a StepError around TensorFlow's error (consumer/train/handoff.py), a factory whose
            # variables could not be broadcast a ConfigError naming model.step (consumer/train/step.py): judge that one
            wrapped = isinstance(err, (StepError, ConfigError))
            cause = err.__cause__ if wrapped and err.__cause__ is not None else err
            lost = lost_contact_error(cause, self.rank, doing)
            if lost is None:
                raise
            raise lost from err


def lost_contact_error(err: BaseException, rank: int, doing: str) -> JobLostError | None:
    """The one-line error for a collective that failed because the job lost a peer; None for other errors."""
    import tensorflow as tf

    lost_types = (
        tf.errors.UnavailableError,
        tf.errors.DeadlineExceededError,
        tf.errors.AbortedError,
        tf.errors.CancelledError,
    )
    if not isinstance(err, lost_types):
        return None
    text = _FUNCTION_NODE.sub("", getattr(err, "message", str(err)))
    # TensorFlow's text: "Graph execution error:", "Detected at node ...", the Python frames that defined the
    # op (indented), the reason (not indented, a few lines), then "\t [[{{node ...}}]]"; an eager op's reason
    # starts with "{{function_node NAME}}".
    reason = [
        line
        for line in text.splitlines()
        if line.strip() and line == line.lstrip() and not line.startswith(("Graph execution error", "Detected at"))
    ]
    why = " ".join(reason[:2]) or type(err).__name__
    if len(why) > _MAX_WHY_CHARS:
        why = why[: _MAX_WHY_CHARS - 3] + "..."
    return JobLostError(rank, f"{doing}: {why}")


def server_error(err: BaseException, place: WorkerPlace) -> ConfigError | None:
    """One line for TensorFlow's "Could not start gRPC server": nothing can listen on this rank's own address
    (a port in use: the same task started twice on one host, a process left from an earlier run, another
    program); None for other errors."""
    if _NO_SERVER not in getattr(err, "message", str(err)):
        return None
    address = place.cluster[place.task_type][place.task_index]
    port = int(address.rpartition(":")[2])
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds its port
        probe.bind(("", port))
        why = f"TensorFlow could not start its server on port {port} (free now: was it taken for a moment?)"
    except OSError as bind_err:
        why = (
            f"port {port}: {bind_err.strerror} (is this task started twice on this host, a process of an earlier "
            "run still alive, or another program on that port?)"
        )
    finally:
        probe.close()
    return ConfigError(
        f"cluster.{place.task_type}[{place.task_index}] {address} is this rank's address, where its "
        f"TensorFlow server listens, but {why}",
        path=(place.source,),
    )


def collective_implementation(gpus: Sequence[object]) -> str:
    """The ``CommunicationImplementation`` member for a worker whose TensorFlow sees ``gpus``: NCCL on GPUs, RING
    on the CPU. The strategy's default, AUTO, reaches the collective runtime as the hint "auto", which it
    resolves to RING on GPUs too (docs/design.md "GPU placement"); NCCL has no CPU kernels."""
    return "NCCL" if gpus else "RING"


def start_job(cfg: PipelineConfig, place: WorkerPlace) -> Job | None:
    """The strategy of ``place``'s job (None for a world of 1), created before any other TensorFlow op.

    Imports TensorFlow, applies ``configure_memory`` (GPU memory growth or cap), configures the
    coordination service (heartbeat and join bounds) and builds ``MultiWorkerMirroredStrategy`` with the
    collective timeout; this waits until every rank has joined, at most ``consumer.collective_timeout_s``.

    Raises:
        ConfigError: ``consumer.replicas`` asks for more than one CPU replica per worker, or this rank's
            TF_CONFIG address cannot be listened on (its port in use).
        JobLostError: the ranks did not all join in time.
    """
    if not place.is_multi_worker:
        return None
    import tensorflow as tf
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    from melfeed.consumer.placement import configure_memory

    configure_memory(cfg, tf)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    c = cfg.consumer
    # What the strategy would configure itself (its default heartbeat is 10 s, its join wait an hour),
    # with melfeed's bounds: set before the strategy initialises the runtime, which then keeps it.
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        heartbeat_timeout_in_ms=int(c.peer_timeout_s * 1000),
        cluster_register_timeout_in_ms=int(c.collective_timeout_s * 1000),
        shutdown_barrier_timeout_in_ms=int(c.peer_timeout_s * 1000),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
            for job in ("chief", "worker")
            if job in spec.jobs
        ],
    )
    implementation = collective_implementation(tf.config.list_physical_devices("GPU"))
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=getattr(tf.distribute.experimental.CommunicationImplementation, implementation),
        timeout_seconds=c.collective_timeout_s,
    )
    log.info(
        "rank %d of %d: joining the job (MultiWorkerMirroredStrategy, %s collectives, %s); waiting at most "
        "%.0f s for every rank (consumer.collective_timeout_s), then this process ends with exit 1; Ctrl-C or "
        "SIGTERM ends it at once",
        place.rank,
        place.world,
        implementation,
        ", ".join(f"{k} {len(v)}" for k, v in place.cluster.items()),
        c.collective_timeout_s + _JOIN_GRACE_S,
    )
    # The join's bound: TensorFlow's registration timeout logs its error but leaves the constructor blocked
    # (seen here: a rank started alone waited for good), holding the GIL, so neither a Python thread nor a
    # signal handler can run. faulthandler's watchdog is a C thread: it ends the process (exit 1) if the
    # join outlasts the bound. Nothing is open yet (no state directory, socket or producers).
    faulthandler.dump_traceback_later(c.collective_timeout_s + _JOIN_GRACE_S, exit=True, file=_devnull())
    try:
        with ended_by_signals():
            strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver, communication_options=options
            )
    except Exception as err:  # the coordination service reports a join timeout in several types
        lost = lost_contact_error(err, place.rank, "joining the job") or server_error(err, place)
        if lost is None:
            raise
        raise lost from err
    finally:
        faulthandler.cancel_dump_traceback_later()
    log.info(
        "rank %d of %d: the job is up: %d replicas in sync, local devices %s; a lost peer ends this rank "
        "after at most %.0f s without heartbeats (consumer.peer_timeout_s), a stalled collective after "
        "%.0f s (consumer.collective_timeout_s)",
        place.rank,
        place.world,
        strategy.num_replicas_in_sync,
        list(strategy.extended.worker_devices),
        c.peer_timeout_s,
        c.collective_timeout_s,
    )
    return Job(place, strategy, cfg)


@contextmanager
def ended_by_signals() -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM take their default action (the process ends at once: 130, 143 in a
    shell); the previous handlers come back after it.

    For a wait in C that holds the GIL (the strategy's join): a Python handler, Ctrl-C's KeyboardInterrupt
    included, runs only when the wait returns, up to ``consumer.collective_timeout_s`` later. Only for a
    stretch where nothing is open that an orderly stop would have to close. Off the main thread (where
    handlers cannot be set) it changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python


def _devnull() -> Any:
    """Where the join watchdog's traceback goes: nowhere (the log says what happened before it)."""
    global _DEVNULL
    if _DEVNULL is None:
        _DEVNULL = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (kept open for the watchdog)
    return _DEVNULL


_DEVNULL: Any = None
