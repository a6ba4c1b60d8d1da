"""``melfeed consumer`` and ``melfeed run`` (consumer here + producers as a child group).

``run`` starts the consumer in this process and ``melfeed producer`` as one child process
group (its own uvloop supervisor) with ``producer.exit_at_plan_end`` set: when the plan is finished the
consumer's heartbeats say ``done`` and the group exits 0 by itself; the stop ladder is the fallback
(``PRODUCERS_EXIT_S`` later, and at once when the run was interrupted). If that group exits early (e.g.
78 on a contract error) the run stops with its exit code. Exit codes (melfeed maps the errors): 0
finished or stopped by a signal, 1 unexpected failure, 65 too many quarantined rows trained (``DataError``),
75 a rank lost contact with its job (``JobLostError``), 78 configuration error.

Both read this consumer's rank and the world size first (``--tf-config FILE``, else ``TF_CONFIG``,
else rank 0 of 1; ``shared/service/tf_config.py``): the state directory, the plan and the leases are
then this rank's share (docs/design.md "Ranks"). With a world above 1 the built-in loop trains
under ``MultiWorkerMirroredStrategy``: the strategy is built (``consumer/job/cluster.py``) before the
state directory is opened, and the ranks agree there, with one collective, on the checkpoint every
rank resumes from; only then does the consumer bind and lease from that checkpoint's next batch.
A rank that loses contact with the job exits ``EXIT_JOB_LOST`` with one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from melfeed.consumer.feed import Consumer
from melfeed.consumer.job.agree import job_settings
from melfeed.consumer.job.cluster import Job, start_job
from melfeed.consumer.observe.board import Board, board_dir, check_board_dir
from melfeed.consumer.observe.telemetry import Telemetry
from melfeed.consumer.placement import apply_placement, configure_memory
from melfeed.consumer.producer_group import PRODUCERS_EXIT_S, await_plan_end, start_producers, stop_producers
from melfeed.consumer.resume.state import RunState
from melfeed.consumer.train.loop import train
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.checks import check_distinct_binds, check_endpoint, check_output_paths
from melfeed.shared.config.loader import with_overrides
from melfeed.shared.errors import ConfigError, PipelineError, StateError
from melfeed.shared.flag_checks import check_output_file
from melfeed.shared.service.children import Child
from melfeed.shared.service.cli import config_from_args, with_demo_cache
from melfeed.shared.service.lifecycle import raise_fd_limit, resolve_control_endpoint, resolve_endpoint, stop_on_signals
from melfeed.shared.service.sdnotify import Notifier
from melfeed.shared.service.tf_config import ENV_NAME as TF_CONFIG_ENV
from melfeed.shared.service.tf_config import WorkerPlace, resolve_worker_place
from melfeed.shared.wire.buckets import learns_costs
from melfeed.shared.wire.outliers import excluded

__all__ = ["main_consumer", "main_run", "run_exit_code", "worker_place"]

log = logging.getLogger(__name__)


def main_consumer(args: argparse.Namespace, started_s: float) -> int:
    cfg = config_from_args(args)
    place = worker_place(args)
    _check_paths(cfg, args, place)
    raise_fd_limit(cfg.transport.max_connections)  # headroom for the connection bound (conn_guard)
    apply_placement(cfg)  # consumer.model_gpu and the XLA cache: before TensorFlow is imported
    notifier = Notifier()
    try:
        job = start_job(cfg, place)  # world > 1: imports TensorFlow, waits for every rank (bounded)
        with stop_on_signals() as stop, _opened_state(cfg, place, job) as state:
            with notifier.extending_start_timeout():  # a search of the rows can outlast TimeoutStartSec
                cfg, configured = _with_measured(cfg, state, job)
            with (
                Consumer(
                    cfg, start_batch=state.next_batch if state else 0, rank=place.rank, world=place.world
                ) as consumer,
                _telemetry(cfg, consumer, started_s, state) as telemetry,
                _board(cfg, place, consumer) as board,
            ):
                if job is None and not configured:
                    configure_memory(cfg)  # imports TensorFlow: memory growth or the cap, before any op
                train(
                    cfg,
                    consumer,
                    stop,
                    process_start_s=started_s,
                    summary_path=args.summary_json,
                    state=state,
                    notifier=notifier,
                    telemetry=telemetry,
                    job=job,
                    board=board,
                )
    except PipelineError as err:
        notifier.notify(STATUS=f"failed: {err}")
        raise
    finally:
        notifier.close()
    return 0


def _check_paths(cfg: PipelineConfig, args: argparse.Namespace, place: WorkerPlace) -> None:
    """Before anything starts: the files the run writes and the sockets it binds have a usable directory,
    and no output file is a directory (found at the end of training, either would lose the summary); this
    rank's TensorBoard directory exists (created) and is writable."""
    c = cfg.consumer
    control = resolve_control_endpoint(cfg, os.environ, create_dir=False)
    # The config refuses two equal values; here the defaults are filled in (the runtime directory's
    # melfeed.sock, the rank's names) and may meet a value that is set.
    check_distinct_binds(
        {
            ("transport", "endpoint"): resolve_endpoint(cfg, os.environ, create_dir=False),
            ("consumer", "control_endpoint"): control,
        },
        (("consumer", "metrics_port"), c.metrics_host, c.metrics_port),
    )
    named: dict[tuple[str, ...], str | None] = {
        ("transport", "endpoint"): cfg.transport.endpoint,
        ("consumer", "control_endpoint"): c.control_endpoint,
    }
    endpoints = {key: endpoint for key, endpoint in named.items() if endpoint is not None}
    check_output_paths(
        {("consumer", "metrics_file"): c.metrics_file, ("--summary-json",): args.summary_json}, endpoints
    )
    check_output_file(c.metrics_file, "consumer.metrics_file")  # not a directory, an existing file writable
    check_output_file(args.summary_json, "--summary-json")
    if c.tensorboard_dir is not None:
        check_board_dir(board_dir(c.tensorboard_dir, place.rank, place.world))
    if c.control_endpoint is None:  # derived from transport.endpoint (only the consumer binds it)
        try:
            check_endpoint(control, ("consumer", "control_endpoint"))
        except ConfigError as err:
            raise ConfigError(
                f"the status socket derived from transport.endpoint, {control}: {err.reason}; set "
                "consumer.control_endpoint or use a shorter path",
                path=err.path,
            ) from None


def _report_outliers(cfg: PipelineConfig, consumer: Consumer, state: RunState | None) -> None:
    """STATE_DIR/outliers.tsv: every utterance the plan leaves out, with its reason (``shared/wire/outliers.py``)."""
    if state is None:
        return
    m, bs = consumer.manifest, consumer._bucket_set
    rows = [
        (m.utterances[i].id, int(m.frames[i]), int(m.token_counts[i]), reason)
        for i, reason in excluded(m.frames, m.token_counts, bs.assignment, cfg.buckets)
    ]
    path = state.write_outliers(rows)
    if rows:
        log.info(
            "%d utterance(s) left out of the plan (%d frames-per-token outliers), listed in %s",
            len(rows),
            bs.outliers,
            path,
        )


def _telemetry(cfg: PipelineConfig, consumer: Consumer, started_s: float, state: RunState | None) -> Telemetry:
    """Live figures: snapshots, the control socket for `status`, optional JSONL file and Prometheus."""
    endpoint = resolve_control_endpoint(cfg, os.environ, create_dir=True)
    _report_outliers(cfg, consumer, state)
    failures = (lambda: state.checkpoint_failures) if state is not None else None
    return Telemetry(
        cfg, consumer._telemetry_source(), started_s, control_endpoint=endpoint, checkpoint_failures=failures
    )


@contextmanager
def _board(cfg: PipelineConfig, place: WorkerPlace, consumer: Consumer) -> Iterator[Board | None]:
    """TensorBoard scalars in this rank's directory (``consumer.tensorboard_dir``), from the consumer's start
    batch on (a resumed run continues its curves); flushed and closed when the run ends, however it ends."""
    c = cfg.consumer
    if c.tensorboard_dir is None:
        yield None
        return
    with Board(
        board_dir(c.tensorboard_dir, place.rank, place.world), c.tensorboard_every_steps, consumer._desk.next_id
    ) as board:
        yield board


def worker_place(args: argparse.Namespace) -> WorkerPlace:
    """This consumer's rank and the world size: ``--tf-config FILE``, else ``TF_CONFIG``, else rank 0 of 1.

    A file given with ``--tf-config`` is also exported as ``TF_CONFIG`` (before TensorFlow loads), so
    that anything reading the environment later sees the same cluster.

    Raises:
        ConfigError: a TF_CONFIG that is not a usable cluster (one line naming its source, exit 78).
    """
    path = getattr(args, "tf_config", None)
    place = resolve_worker_place(path, os.environ)
    if path is not None:
        os.environ[TF_CONFIG_ENV] = (
            json.dumps(
                {
                    "cluster": {k: list(v) for k, v in place.cluster.items()},
                    "task": {"type": place.task_type, "index": place.task_index},
                }
            )
            if place.cluster
            else "{}"
        )
    if place.is_multi_worker:
        log.info(
            "rank %d of %d (%s, task %s:%d): this consumer leases and applies only its share of the plan",
            place.rank,
            place.world,
            place.source,
            place.task_type,
            place.task_index,
        )
    return place


@contextmanager
def _opened_state(cfg: PipelineConfig, place: WorkerPlace, job: Job | None = None) -> Iterator[RunState | None]:
    """The state directory's lock, audit log and resume cursor for the whole run. In a multi-worker job two
    collectives first (every rank calls each once, also a rank that cannot start, so the others stop with it):
    the ranks' settings must be the same, then the checkpoint every rank resumes from (``consumer/job/agree.py``)."""
    with _stopping_the_job(job.check_settings if job is not None else None):
        manifest = _manifest_for_rank(cfg, place)
    if job is not None:
        job.check_settings(job_settings(cfg, manifest.fingerprint))
    with _stopping_the_job(job.agree if job is not None else None):
        state = RunState.open(cfg, manifest.fingerprint, rank=place.rank, world=place.world)
    try:
        if job is not None:
            _agree(job, state)
        yield state
    finally:
        if state is not None:
            state.close()


def _manifest_for_rank(cfg: PipelineConfig, place: WorkerPlace) -> Manifest:
    from melfeed.shared.cache.features import load_manifest_for

    if cfg.cache_dir is None:
        raise ConfigError("is required", path=("cache_dir",))
    if place.is_multi_worker and cfg.consumer.state_dir is not None and cfg.consumer.keep_checkpoints < 2:
        raise ConfigError(
            f"must be >= 2 in a multi-worker job (rank {place.rank} of {place.world}): after a crash "
            "the ranks may be one commit apart, and the one before must still be on every rank",
            path=("consumer", "keep_checkpoints"),
            got=cfg.consumer.keep_checkpoints,
        )
    return load_manifest_for(cfg)  # the built-in loop trains cfg.model: token ids checked against its vocab_size


@contextmanager
def _stopping_the_job(collective: Callable[[None], object] | None) -> Iterator[None]:
    """A rank of a job that cannot start still joins the job's next ``collective`` with ``None`` (it refuses), so
    the other ranks stop with it (exit 78 everywhere) instead of waiting for it until they give up (75)."""
    try:
        yield
    except PipelineError:
        if collective is not None:
            with suppress(PipelineError):  # this rank's own error is the one to report
                collective(None)
        raise


def _agree(job: Job, state: RunState | None) -> None:
    """Every rank offers its committed steps; all resume from the newest step that every rank committed."""
    try:
        step = job.agree(state.committed_steps() if state is not None else [])
    except LookupError as err:
        raise StateError(state.root if state is not None else "consumer.state_dir", f"rank {job.rank}: {err}") from None
    if state is not None:
        state.resume_at(step)
    elif step is not None:
        raise ConfigError(
            f"rank {job.rank} has no state directory, but the other ranks resume from step {step}: give "
            "every rank its consumer.state_dir",
            path=("consumer", "state_dir"),
        )


def main_run(args: argparse.Namespace, started_s: float) -> int:
    place = worker_place(args)
    cfg = with_demo_cache(args, config_from_args(args))
    if cfg.cache_dir is None:
        raise ConfigError("is required (--cache-dir, --demo, or cache_dir in the config)", path=("cache_dir",))
    cache_dir = cfg.cache_dir
    _check_paths(cfg, args, place)
    _check_one_key_pair(cfg)
    raise_fd_limit(cfg.transport.max_connections)
    apply_placement(cfg)  # the producers keep producer.data_gpu (their own processes)
    job = start_job(cfg, place)  # world > 1: imports TensorFlow, waits for every rank (bounded)
    with stop_on_signals() as stop, _opened_state(cfg, place, job) as state:
        cfg, configured = _with_measured(cfg, state, job)  # auto rows, measured costs: the producers below get them
        with (
            Consumer(cfg, start_batch=state.next_batch if state else 0, rank=place.rank, world=place.world) as consumer,
            _telemetry(cfg, consumer, started_s, state) as telemetry,
            _board(cfg, place, consumer) as board,
        ):
            child_cfg = with_overrides(
                cfg,
                {
                    "transport.endpoint": consumer._endpoint,
                    "producer.exit_at_plan_end": True,
                    "cache_dir": str(Path(cache_dir).resolve()),
                },
            )
            group = start_producers(child_cfg, args.debug_delay_ms)
            if job is None and not configured:
                configure_memory(cfg)  # imports TensorFlow (while the producers start): growth or the cap
            watcher = threading.Thread(target=_watch, args=(group, stop, consumer), name="producers-watch", daemon=True)
            watcher.start()
            try:
                train(
                    cfg,
                    consumer,
                    stop,
                    process_start_s=started_s,
                    summary_path=args.summary_json,
                    state=state,
                    telemetry=telemetry,
                    job=job,
                    board=board,
                )
            finally:
                await_plan_end(group, consumer, 2 * cfg.transport.heartbeat_interval_s + PRODUCERS_EXIT_S)
                stop_producers(group)
    return run_exit_code(group.proc.returncode)


def _with_measured(cfg: PipelineConfig, state: RunState | None, job: Job | None) -> tuple[PipelineConfig, bool]:
    """``cfg`` with what the consumer measures on its step before planning: the planner's weights under
    ``buckets.cost: measured`` (consumer/train/measured_costs.py), then each bucket's rows under ``batch_size: auto``
    (consumer/train/auto_rows.py); and whether device memory was configured for them (the measurements run the
    step: after ``configure_memory``, before the consumer)."""
    b = cfg.buckets
    if not learns_costs(b) and (b.batch_size != "auto" or b.rows is not None):
        return cfg, False
    from melfeed.consumer.train.auto_rows import resolve_rows
    from melfeed.consumer.train.measured_costs import resolve_costs
    from melfeed.shared.cache.features import load_manifest_for

    if job is None:
        configure_memory(cfg)
    manifest = load_manifest_for(cfg, feeds_model=False)
    cfg = resolve_costs(cfg, manifest, state, job)
    return resolve_rows(cfg, manifest, state, job), job is None


def run_exit_code(group_code: int | None) -> int:
    """``run``'s exit code once training ended without an error: its producer group's own code (78: a contract
    error), 0 for 0 or the stop ladder's SIGTERM, and 1 (a failure, docs/reference/exit-codes.md) for a group another
    signal ended (SIGKILL: the OOM killer, or the ladder's last rung), never the negative code Popen reports."""
    if group_code is None or group_code in (0, -signal.SIGTERM):
        return 0
    return 1 if group_code < 0 else group_code


def _check_one_key_pair(cfg: PipelineConfig) -> None:
    """``run`` starts its producers from its own config: with CURVE they would present the consumer's secret key,
    which the allow-list does not hold, and wait refused for ever. One line instead."""
    if cfg.transport.curve_secret_key:
        raise ConfigError(
            "run starts its producers with this same config, so they would present the consumer's "
            "key and be refused; with CURVE, run `consumer` and `producer` with a config each (deploy/"
            'README.md "Producers on other hosts (tcp + CURVE)"), or use run\'s default ipc endpoint on one host',
            path=("transport", "curve_secret_key"),
        )


def _watch(group: Child, stop: threading.Event, consumer: Consumer) -> None:
    """Stop the run if the producer group dies on its own (e.g. exit 78 on a contract error), unless it
    exited 0 because the plan is finished."""
    code = group.proc.wait()
    if not group.stopping and not (code == 0 and consumer._desk.finished):
        log.error("producer group exited with %d; stopping", code)
        stop.set()
