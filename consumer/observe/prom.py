"""Prometheus endpoint: the latest snapshot as metrics, rendered by prometheus_client.

Role: ``--metrics-port N`` (``consumer.metrics_port``) starts the server on ``consumer.metrics_host``
(127.0.0.1 by default) with a registry of its own (the process-global one is left untouched) and
one custom collector that reads the latest snapshot at scrape time; nothing is computed twice.
Every metric's name, type, scale and labels come from the snapshot's schema (observe/snapshot.py ``Prom``):
``melfeed_`` prefix, base units (seconds, bytes, ratios 0..1), counters end in ``_total``, labels for
producer, reject code, GPU role and index; a consumer that is one rank of a multi-worker job (world > 1)
adds ``rank`` to every sample, so the ranks' scrapes never collide in one Prometheus. A figure that is not
known yet (null in the snapshot) is left out of the scrape.
prometheus_client is optional (extra ``metrics``) and imported only here, only when a port is given.
It renders the exposition; ``http_metrics.MetricsHttpServer`` serves it (one thread, at most
``_MAX_HTTP_CONNECTIONS`` connections, ``_REQUEST_TIMEOUT_S`` per request: docs/security.md "Hostile peers").
Shutdown: ``close()`` stops the server and joins its thread (bounded); idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from melfeed.consumer.observe.http_metrics import MetricsHttpServer
from melfeed.consumer.observe.snapshot import FieldSpec, Prom, Snapshot, schema_fields
from melfeed.shared.errors import ConfigError
from melfeed.shared.printable import escape_line

__all__ = ["start_prometheus", "snapshot_families", "PromFamily", "SnapshotCollector", "PrometheusServer"]

log = logging.getLogger(__name__)

_MAX_HTTP_CONNECTIONS = 16  # a scraper or two, and curl; more only while the oldest are dropped
_REQUEST_TIMEOUT_S = 5.0  # a scraper on the same host sends its request in milliseconds


@dataclass(slots=True)
class PromFamily:
    """One metric family as the schema declares it; samples are (label values, value)."""

    name: str
    kind: str  # "gauge" or "counter"
    help: str
    label_names: tuple[str, ...]
    is_labelled: bool  # a family without labels is left out while its figure is unknown
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def add(self, labels: Mapping[str, str], value: float) -> None:
        self.samples.append((tuple(labels[name] for name in self.label_names), value))


def _declare(families: dict[str, PromFamily], spec: FieldSpec, row_labels: tuple[str, ...] = ()) -> PromFamily | None:
    """The family ``spec`` exports to (created at its first field), or ``None`` when it exports nothing."""
    prom = spec.prom
    if prom is None:
        return None
    if prom.name not in families:
        names = row_labels + tuple(k for k, _ in prom.labels) + ((prom.key_label,) if prom.key_label else ())
        help_text = prom.help or spec.meaning[0].upper() + spec.meaning[1:]
        families[prom.name] = PromFamily(prom.name, prom.kind, help_text, names, bool(names))
    return families[prom.name]


def _label(value: Any) -> str:
    return escape_line(str(value), 64)  # peer-chosen text: one printable line in the exposition


def _add_field(family: PromFamily, prom: Prom, value: Any, labels: dict[str, str]) -> None:
    """The samples of one field's value (exported as ``prom`` says): a scalar, a one-hot text, or one per list or
    object entry."""
    labels = labels | dict(prom.labels)
    if prom.one_hot:
        for choice in prom.one_hot:
            family.add(labels | {family.label_names[-1]: choice}, 1.0 if value == choice else 0.0)
        return
    entries = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict) else None
    if entries is None:
        if value is not None:
            family.add(labels, value * prom.scale)
        return
    for key, entry in entries:
        if entry is not None:
            family.add(labels | {family.label_names[-1]: _label(key)}, entry * prom.scale)


def snapshot_families(snap: Mapping[str, Any], schema: type = Snapshot) -> list[PromFamily]:
    """Every family ``schema`` names, filled from ``snap`` (pure; a null figure gives no sample)."""
    families: dict[str, PromFamily] = {}
    for f in schema_fields(schema):
        if f.row is None:
            family = _declare(families, f.spec)
            if family is not None and f.spec.prom is not None:
                _add_field(family, f.spec.prom, snap[f.name], {})
            continue
        row_fields = schema_fields(f.row)
        label_names = tuple(r.spec.label for r in row_fields if r.spec.label is not None)
        declared = [(r, _declare(families, r.spec, label_names)) for r in row_fields]
        for row in snap[f.name]:
            labels = {r.spec.label: _label(row[r.name]) for r in row_fields if r.spec.label is not None}
            for r, family in declared:
                if family is not None and r.spec.prom is not None:
                    _add_field(family, r.spec.prom, row[r.name], labels)
    return [family for family in families.values() if family.samples or family.is_labelled]


class SnapshotCollector:
    """A prometheus_client collector over ``get_snapshot()`` (called once per scrape), exporting what ``schema``'s
    fields name."""

    def __init__(self, get_snapshot: Callable[[], dict[str, Any] | None], schema: type = Snapshot) -> None:
        self._get = get_snapshot
        self._schema = schema

    def collect(self) -> Iterator[Any]:
        """Every family of the snapshot; in a multi-worker job each sample also carries ``rank``."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self._get()
        if snap is None:
            return
        rank = (("rank",), (str(snap["rank"]),)) if snap["world"] > 1 else ((), ())
        for family in snapshot_families(snap, self._schema):
            kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            built = kind(family.name, family.help, labels=family.label_names + rank[0])
            for values, value in family.samples:
                built.add_metric(values + rank[1], value)
            yield built


class PrometheusServer:
    """A started prometheus_client HTTP server; ``close()`` stops it."""

    def __init__(self, server: MetricsHttpServer) -> None:
        self._server = server

    @property
    def port(self) -> int:
        return self._server.port

    def close(self) -> None:
        self._server.close()  # idempotent


def start_prometheus(host: str, port: int, get_snapshot: Callable[[], dict[str, Any] | None]) -> PrometheusServer:
    """Serve ``http://host:port/metrics`` from a private registry.

    Raises:
        ConfigError: prometheus_client is not installed, or the address cannot be bound (names the key).
    """
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    except ImportError as err:
        raise ConfigError(
            "needs prometheus_client (pip install 'melfeed[metrics]')", path=("consumer", "metrics_port"), got=port
        ) from err
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_snapshot))
    server = MetricsHttpServer(
        host,
        port,
        lambda: (generate_latest(registry), CONTENT_TYPE_LATEST),
        max_connections=_MAX_HTTP_CONNECTIONS,
        request_timeout_s=_REQUEST_TIMEOUT_S,
    )
    try:
        server.start()
    except OSError as err:
        server.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {err.strerror}", path=("consumer", "metrics_port"), got=port
        ) from err
    log.info("prometheus metrics at http://%s:%d/metrics", host, port)
    return PrometheusServer(server)
