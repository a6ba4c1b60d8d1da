"""``run_pipeline.py consumer`` and ``run_pipeline.py run`` (consumer here + producers as a child group).

``run`` starts the consumer in this process and ``run_pipeline.py producer`` as one child process
group (its own uvloop supervisor). If that group exits early (e.g. 78 on a contract error) the run
stops with its exit code. Exit codes: 0 finished or stopped by a signal, 78 configuration error,
1 unexpected failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from consumer.feed import Consumer
from consumer.resume.state import RunState
from consumer.observe.telemetry import Telemetry
from consumer.train.loop import train
from shared.service.cli import config_from_args
from shared.config import PipelineConfig, resolve_runtime_dir
from shared.config_loader import config_to_mapping, with_overrides
from shared.errors import ConfigError, PipelineError
from shared.service.lifecycle import prepare_runtime_dir, resolve_control_endpoint, stop_on_signals
from shared.service.sdnotify import Notifier

__all__ = ["main_consumer", "main_run", "start_producers", "stop_producers"]

log = logging.getLogger(__name__)

_PRODUCERS_STOP_S = 20.0   # > the launcher's own SIGTERM ladder (10 s) + BYE


def main_consumer(args: argparse.Namespace, started_s: float) -> int:
    cfg = config_from_args(args)
    notifier = Notifier()
    try:
        with stop_on_signals() as stop, _opened_state(cfg) as state, \
                Consumer(cfg, start_batch=state.next_batch if state else 0) as consumer, \
                _telemetry(cfg, consumer, started_s) as telemetry:
            train(cfg, consumer, stop, process_start_s=started_s, summary_path=args.summary_json, state=state,
                  notifier=notifier, telemetry=telemetry)
    except PipelineError as err:
        notifier.notify(STATUS=f"failed: {err}")
        raise
    finally:
        notifier.close()
    return 0


def _telemetry(cfg: PipelineConfig, consumer: Consumer, started_s: float) -> Telemetry:
    """Live figures: snapshots, the control socket for `status`, optional JSONL file and Prometheus."""
    endpoint = resolve_control_endpoint(cfg, os.environ, create_dir=True)
    return Telemetry(cfg, consumer, started_s, control_endpoint=endpoint)


@contextmanager
def _opened_state(cfg: PipelineConfig) -> Iterator[RunState | None]:
    """The state directory's lock, audit log and resume cursor for the whole run."""
    from shared.cache.features import load_manifest_for
    if cfg.cache_dir is None:
        raise ConfigError("is required", path=("cache_dir",))
    state = RunState.open(cfg, load_manifest_for(cfg).fingerprint)
    try:
        yield state
    finally:
        if state is not None:
            state.close()


def main_run(args: argparse.Namespace, started_s: float, entry: str) -> int:
    cfg = config_from_args(args)
    if args.demo:
        from shared.cache.demo_data import default_demo_dir, write_demo_cache
        cache = Path(cfg.cache_dir) if args.cache_dir else default_demo_dir(args.demo_utterances)
        log.info("demo data in %s", cache)
        write_demo_cache(cache, n_utterances=args.demo_utterances)
        cfg = with_overrides(cfg, {"cache_dir": str(cache)})
    if cfg.cache_dir is None:
        raise ConfigError("is required (--cache-dir, --demo, or cache_dir in the config)", path=("cache_dir",))
    with stop_on_signals() as stop, _opened_state(cfg) as state, \
            Consumer(cfg, start_batch=state.next_batch if state else 0) as consumer, \
            _telemetry(cfg, consumer, started_s) as telemetry:
        child_cfg = with_overrides(cfg, {"transport.endpoint": consumer.endpoint,
                                         "cache_dir": str(Path(cfg.cache_dir).resolve())})
        group = start_producers(child_cfg, entry, args.debug_delay_ms)
        watcher = threading.Thread(target=_watch, args=(group, stop), name="producers-watch", daemon=True)
        watcher.start()
        try:
            train(cfg, consumer, stop, process_start_s=started_s, summary_path=args.summary_json, state=state,
                  telemetry=telemetry)
        finally:
            stop_producers(group)
    code = group.proc.returncode or 0
    return code if code not in (-signal.SIGTERM, 0) else 0


class _Group:
    def __init__(self, proc: subprocess.Popen[bytes], config_path: Path) -> None:
        self.proc = proc
        self.config_path = config_path
        self.stopping = False


def start_producers(cfg: PipelineConfig, entry: str, debug_delay_ms: float) -> _Group:
    """``run_pipeline.py producer`` with ``cfg`` (written to the runtime dir) as one child process group."""
    path = prepare_runtime_dir(resolve_runtime_dir(os.environ)) / f"run-{os.getpid()}.yaml"
    path.write_text(yaml.safe_dump(config_to_mapping(cfg), sort_keys=False), encoding="utf-8")
    cmd = [sys.executable, entry, "producer", "--config", str(path)]
    if debug_delay_ms:
        cmd += ["--debug-delay-ms", str(debug_delay_ms)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    log.info("started %d producers (group pid=%d)", cfg.producer.count, proc.pid)
    return _Group(proc, path)


def _watch(group: _Group, stop: threading.Event) -> None:
    """Stop the run if the producer group dies on its own (e.g. exit 78 on a contract error)."""
    code = group.proc.wait()
    if not group.stopping:
        log.error("producer group exited with %d; stopping", code)
        stop.set()


def stop_producers(group: _Group) -> None:
    """SIGTERM the group, wait (bounded), kill if ignored; reaps it and removes its config. Idempotent."""
    group.stopping = True
    if group.proc.poll() is None:
        group.proc.send_signal(signal.SIGTERM)
        try:
            group.proc.wait(_PRODUCERS_STOP_S)
        except subprocess.TimeoutExpired:
            log.warning("producer group ignored SIGTERM for %.0f s; killing", _PRODUCERS_STOP_S)
            group.proc.kill()
            group.proc.wait(_PRODUCERS_STOP_S)
    group.config_path.unlink(missing_ok=True)
