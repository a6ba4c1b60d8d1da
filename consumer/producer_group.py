"""The producer group a consumer's process starts: ``melfeed producer`` as one child process group.

Role: ``start_producers`` / ``stop_producers`` are the one way a consumer's process starts and stops its
producers (``melfeed run``, the benches, ``Consumer(cfg, producers=N)``): a fresh interpreter per group
(``shared/service/children.py``: spawn, the config handed over in a 0600 file, the stop ladder), which dies
with this process. ``OwnedProducers`` is the group a ``Consumer`` owns: started once the consumer has bound
its endpoint (so the producers find it), with the consumer's effective config (its resolved endpoint, the
cache as an absolute path, ``producer.count`` = N, ``producer.exit_at_plan_end``).
Invariants: a group that exits while the plan is unfinished is a failure: ``OwnedProducers.error`` names its
exit code, and the consumer's ring is closed so that a wait for a batch ends at once (``Consumer.next_batch``
raises it); an exit the ladder asked for, or exit 0 after the plan finished, is not.
Shutdown: ``OwnedProducers.stop`` is idempotent: after a finished plan the group exits 0 by itself (a
bounded wait), otherwise (or when it does not) the stop ladder (SIGTERM, bounded wait, SIGKILL) reaps it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_to_mapping, with_overrides
from melfeed.shared.errors import ConfigError, PipelineError
from melfeed.shared.service.children import Child, child_env, entry_argv, spawn, write_private_config
from melfeed.shared.service.lifecycle import PARENT_PID_ENV
from melfeed.shared.service.stop_ladder import GROUP_LADDER

if TYPE_CHECKING:
    from melfeed.consumer.feed import Consumer

__all__ = ["OwnedProducers", "PRODUCERS_EXIT_S", "await_plan_end", "exit_text", "start_producers", "stop_producers"]

log = logging.getLogger(__name__)

PRODUCERS_EXIT_S = 10.0  # > a producer's BYE and exit + its supervisor's 0.1 s poll, on a loaded 2-core machine


def start_producers(cfg: PipelineConfig, debug_delay_ms: float = 0.0) -> Child:
    """``melfeed producer`` with ``cfg`` (written to the runtime dir) as one child process group."""
    path = write_private_config(config_to_mapping(cfg), f"run-{os.getpid()}.yaml")
    extra = ["--debug-delay-ms", str(debug_delay_ms)] if debug_delay_ms else []
    try:
        # the group stops itself if this process dies (no orphaned producers)
        proc = spawn(
            entry_argv("producer", "--config", str(path), *extra), env=child_env({PARENT_PID_ENV: str(os.getpid())})
        )
    except OSError:
        path.unlink(missing_ok=True)
        raise
    group = Child(proc, "producer group", GROUP_LADDER, config_path=path)
    log.info("started %d producers (group pid=%d)", cfg.producer.count, group.proc.pid)
    return group


def stop_producers(group: Child) -> None:
    """The stop ladder (SIGTERM, bounded wait, SIGKILL); reaps the group and removes its config. Idempotent."""
    group.stop()


def await_plan_end(group: Child, consumer: Consumer, wait_s: float) -> None:
    """A finished plan: the producers heard ``done`` and exit 0 by themselves; bounded, then the ladder."""
    if not consumer._desk.finished:
        return
    try:
        code = group.proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        log.warning("producer group still running %.0f s after the plan ended; stopping it", wait_s)
        return
    log.info("producer group exited %d on its own after the plan ended", code)


def exit_text(code: int) -> str:
    """``exited with 78``, or ``was killed by SIGKILL`` for the negative code Popen reports for a signal."""
    if code >= 0:
        return f"exited with {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class OwnedProducers:
    """The producer group of ``Consumer(cfg, producers=N)`` (module docstring).

    Raises:
        TypeError, ValueError: ``count`` is not an integer >= 1.
        ConfigError: ``transport.curve_secret_key`` is set (the producers would present the consumer's key).
    """

    def __init__(self, count: object, cfg: PipelineConfig) -> None:
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"Consumer(producers=...): a number of producers or None, got {count!r}")
        if count < 1:
            raise ValueError(f"Consumer(producers=...): at least 1 producer (None: you start them), got {count}")
        with_overrides(cfg, {"producer.count": count})  # ConfigError past producer.count's bound
        if cfg.transport.curve_secret_key:
            raise ConfigError(
                "Consumer(producers=N) starts its producers with this same config, so they would "
                "present the consumer's key and be refused; start them yourself, each with its own "
                'key pair (deploy/README.md "Producers on other hosts (tcp + CURVE)")',
                path=("transport", "curve_secret_key"),
            )
        self.count = count
        self.group: Child | None = None
        self.error: PipelineError | None = None

    def start(self, consumer: Consumer, on_failure: Callable[[], None]) -> None:
        """Start the group for ``consumer`` (bound already); ``on_failure`` runs if it dies before the plan ends."""
        cfg = consumer._cfg
        cache_dir = str(Path(cfg.cache_dir).resolve()) if cfg.cache_dir is not None else None
        self.group = start_producers(
            with_overrides(
                cfg,
                {
                    "transport.endpoint": consumer._endpoint,
                    "producer.exit_at_plan_end": True,
                    "cache_dir": cache_dir,
                    "producer.count": self.count,
                },
            )
        )
        threading.Thread(
            target=self._watch, args=(self.group, consumer, on_failure), name="producers-watch", daemon=True
        ).start()

    def _watch(self, group: Child, consumer: Consumer, on_failure: Callable[[], None]) -> None:
        code = group.proc.wait()
        if group.stopping or (code == 0 and consumer._desk.finished):
            return
        self.error = PipelineError(
            f"the producer group (pid {group.proc.pid}, Consumer(producers={self.count})) "
            f"{exit_text(code)} before the plan ended; its log lines above say why"
        )
        log.error("%s", self.error)
        on_failure()

    def stop(self, consumer: Consumer) -> None:
        """Wait for the group's own exit after a finished plan (bounded), then the ladder. Idempotent."""
        if self.group is None:
            return
        if not self.group.stopping:
            await_plan_end(self.group, consumer, 2 * consumer._cfg.transport.heartbeat_interval_s + PRODUCERS_EXIT_S)
        stop_producers(self.group)
