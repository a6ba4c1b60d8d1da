"""Prometheus endpoint: the latest snapshot as metrics, rendered by prometheus_client.

Role: ``--metrics-port N`` (``consumer.metrics_port``) starts the server on ``consumer.metrics_host``
(127.0.0.1 by default) with a registry of its own (the process-global one is left untouched) and
one custom collector that reads the latest snapshot at scrape time; nothing is computed twice.
Names follow Prometheus conventions: ``melfeed_`` prefix, base units (seconds, bytes, ratios 0..1),
counters end in ``_total``, labels for producer, reject code, GPU role and index (consumer/README.md
lists every name); a consumer that is one rank of a multi-worker job (world > 1) adds ``rank`` to every
sample, so the ranks' scrapes never collide in one Prometheus. A figure that is not known yet (null in the snapshot) is left out of the scrape.
prometheus_client is optional (extra ``metrics``) and imported only here, only when a port is given.
It renders the exposition; ``http_metrics.MetricsHttpServer`` serves it (one thread, at most
``_MAX_HTTP_CONNECTIONS`` connections, ``_REQUEST_TIMEOUT_S`` per request: docs/ARCHITECTURE.md "Trust").
Shutdown: ``close()`` stops the server and joins its thread (bounded); idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from melfeed.consumer.observe.http_metrics import MetricsHttpServer
from melfeed.shared.errors import ConfigError
from melfeed.shared.printable import escape_line
from melfeed.shared.metrics import PHASES

__all__ = ["start_prometheus", "SnapshotCollector", "PrometheusServer"]

log = logging.getLogger(__name__)

_MAX_HTTP_CONNECTIONS = 16   # a scraper or two, and curl; more only while the oldest are dropped
_REQUEST_TIMEOUT_S = 5.0      # a scraper on the same host sends its request in milliseconds

# (snapshot key, metric name, help, scale) for the plain gauges; scale converts to base units.
_GAUGES = (
    ("uptime_s", "melfeed_uptime_seconds", "Seconds since the consumer process started", 1.0),
    ("steps_total", "melfeed_steps_target", "Plan position the run stops at (absent: until stopped)", 1.0),
    ("loss", "melfeed_loss", "Loss of the newest step", 1.0),
    ("window_s", "melfeed_window_seconds", "Length of the sliding window of the windowed figures", 1.0),
    ("stall_pct", "melfeed_stall_ratio", "Time the step loop waited for batches / wall time (window)", 0.01),
    ("batches_per_s", "melfeed_batches_per_second", "Batches applied per second (window)", 1.0),
    ("samples_per_s", "melfeed_samples_per_second", "Real samples applied per second (window)", 1.0),
    ("bytes_per_s", "melfeed_received_bytes_per_second", "Payload bytes received per second (window)", 1.0),
    ("step_cv", "melfeed_step_time_cv_ratio", "Coefficient of variation of the step time (window)", 1.0),
    ("padding_efficiency", "melfeed_padding_efficiency_ratio", "Real frames / padded frames (window)", 1.0),
    ("feed_efficiency", "melfeed_feed_efficiency_ratio",
     "Fed steps/s / steps/s of the same step on resident batches of the same buckets (since warm-up)", 1.0),
    ("useful_work", "melfeed_useful_work_ratio", "Feed efficiency x padding efficiency (window)", 1.0),
    ("queue_depth_mean", "melfeed_queue_depth_mean", "Mean ready batches + leases when a batch was taken", 1.0),
    ("lease_window", "melfeed_lease_window", "Leases one producer may hold", 1.0),
    ("leases_outstanding", "melfeed_leases_outstanding", "Leases granted and not yet delivered", 1.0),
    ("producers_alive", "melfeed_producers_alive", "Producers connected now", 1.0),
)
_COUNTERS = (
    ("step", "melfeed_batches_applied", "Batches applied to the model by this consumer process"),
    ("duplicates", "melfeed_duplicates", "Duplicate batches dropped"),
    ("quarantined", "melfeed_quarantined_samples", "Bad cache rows left empty by producers"),
    ("compiles_after_ready", "melfeed_compiles_after_ready", "Step compiles after READY"),
    ("checkpoint_failures", "melfeed_checkpoint_failures", "Periodic checkpoints that could not be written"),
    ("connections_cut", "melfeed_connections_cut", "Connections cut at transport.max_connections"),
    ("hello_repeats", "melfeed_hello_repeats", "HELLOs repeating a producer's join, answered again (leases kept)"),
)


class SnapshotCollector:
    """A prometheus_client collector over ``get_snapshot()`` (called once per scrape)."""

    def __init__(self, get_snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self._get = get_snapshot

    def collect(self) -> Iterator[Any]:
        """Every family of the snapshot; in a multi-worker job each sample also carries ``rank``."""
        snap = self._get()
        if snap is None:
            return
        world = snap.get("world") or 1
        if world == 1:
            yield from self._families(snap)
            return
        rank = str(snap.get("rank"))
        for family in self._families(snap):
            family.samples = [s._replace(labels={**s.labels, "rank": rank}) for s in family.samples]
            yield family

    def _families(self, snap: dict[str, Any]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        yield GaugeMetricFamily("melfeed_world_size", "Ranks in the job (1: a single consumer)",
                                value=snap.get("world") or 1)
        for key, name, doc, scale in _GAUGES:
            if snap.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=snap[key] * scale)
        for key, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=snap.get(key, 0))
        phase = GaugeMetricFamily("melfeed_phase", "1 for the consumer's current phase", labels=["phase"])
        for p in PHASES:
            phase.add_metric([p], 1.0 if snap["phase"] == p else 0.0)
        yield phase
        step = GaugeMetricFamily("melfeed_step_seconds", "Step time percentiles (window)", labels=["quantile"])
        for q, key in (("0.5", "step_p50_ms"), ("0.99", "step_p99_ms")):
            if snap[key] is not None:
                step.add_metric([q], snap[key] / 1000.0)
        yield step
        hist = GaugeMetricFamily("melfeed_queue_depth_batches", "Batches taken at each queue depth (window)",
                                 labels=["depth"])
        for depth, count in enumerate(snap["queue_depth_hist"]):
            hist.add_metric([str(depth)], count)
        yield hist
        rejects = CounterMetricFamily("melfeed_rejects", "Rejected messages by reject code", labels=["code"])
        for code, count in snap["rejects"].items():
            rejects.add_metric([code], count)
        yield rejects
        named = GaugeMetricFamily("melfeed_step_output", "The step's named scalars, mean over the status "
                                  "interval (loss, and e.g. mel_l1, stop_bce)", labels=["name"])
        for name, value in (snap.get("outputs") or {}).items():
            if value is not None:
                named.add_metric([name], value)
        yield named
        yield from _producer_families(snap["producers"])
        yield from _gpu_families(snap["gpus"])


def _producer_families(producers: list[dict[str, Any]]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    built = CounterMetricFamily("melfeed_producer_batches", "Batches built by the producer process",
                                labels=["producer"])
    rate = GaugeMetricFamily("melfeed_producer_batches_per_second", "Batches built per second (window)",
                             labels=["producer"])
    stage = GaugeMetricFamily("melfeed_producer_stage_seconds", "Seconds per batch in a build stage (window)",
                              labels=["producer", "stage"])
    for p in producers:
        label = escape_line(str(p["id"]), 64)      # peer-chosen: one printable line in the exposition
        if p["batches"] is not None:
            built.add_metric([label], p["batches"])
        if p["batches_per_s"] is not None:
            rate.add_metric([label], p["batches_per_s"])
        for name in ("read", "assemble", "send"):
            if p[f"{name}_ms"] is not None:
                stage.add_metric([label, name], p[f"{name}_ms"] / 1000.0)
    yield from (built, rate, stage)


def _gpu_families(gpus: list[dict[str, Any]]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily
    labels = ["role", "index"]
    util = GaugeMetricFamily("melfeed_gpu_utilization_ratio", "GPU busy fraction (NVML)", labels=labels)
    used = GaugeMetricFamily("melfeed_gpu_memory_used_bytes", "GPU memory used (NVML)", labels=labels)
    total = GaugeMetricFamily("melfeed_gpu_memory_total_bytes", "GPU memory size (NVML)", labels=labels)
    power = GaugeMetricFamily("melfeed_gpu_power_watts", "GPU board power (NVML)", labels=labels)
    for g in gpus:
        key = [g["role"], str(g["index"])]
        util.add_metric(key, g["util_pct"] / 100.0)
        used.add_metric(key, g["mem_used_mib"] * 2**20)
        total.add_metric(key, g["mem_total_mib"] * 2**20)
        if g.get("power_w") is not None:
            power.add_metric(key, g["power_w"])
    yield from (util, used, total, power)


class PrometheusServer:
    """A started prometheus_client HTTP server; ``close()`` stops it."""

    def __init__(self, server: MetricsHttpServer) -> None:
        self._server = server

    @property
    def port(self) -> int:
        return self._server.port

    def close(self) -> None:
        self._server.close()          # idempotent


def start_prometheus(host: str, port: int, get_snapshot: Callable[[], dict[str, Any] | None]) -> PrometheusServer:
    """Serve ``http://host:port/metrics`` from a private registry.

    Raises:
        ConfigError: prometheus_client is not installed, or the address cannot be bound (names the key).
    """
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    except ImportError as err:
        raise ConfigError("needs prometheus_client (pip install 'melfeed[metrics]')",
                          path=("consumer", "metrics_port"), got=port) from err
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_snapshot))
    server = MetricsHttpServer(host, port, lambda: (generate_latest(registry), CONTENT_TYPE_LATEST),
                               max_connections=_MAX_HTTP_CONNECTIONS, request_timeout_s=_REQUEST_TIMEOUT_S)
    try:
        server.start()
    except OSError as err:
        server.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror}", path=("consumer", "metrics_port"),
                          got=port) from err
    log.info("prometheus metrics at http://%s:%d/metrics", host, port)
    return PrometheusServer(server)
