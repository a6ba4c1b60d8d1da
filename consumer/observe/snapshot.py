"""The metrics snapshot's schema: every field once, with its type, unit, meaning and exports.

Role: ``Snapshot`` (and its rows ``ProducerRow``, ``GpuRow``) is the record the consumer's Telemetry builds every
status interval (docs/reference/metrics.md is generated from it). Each field's metadata (``FieldSpec``) says its
unit, a one-line meaning, its Prometheus metric (``Prom``, or none) and its TensorBoard tag (or none); the readers
derive what they need from it: ``melfeed status`` validates with ``snapshot_problem``, the Prometheus collector
(observe/prom.py) and TensorBoard (observe/board.py) export what the specs name, ``melfeed report``
(observe/report_data.py) reads the numeric fields, and ``metric_rows`` lists them for the reference docs.
Adding a field is one edit here (plus where its value comes from, in ``build_snapshot``).
Invariants: the JSON form (``snapshot_dict``) has every field, in declaration order (the wire order of
``melfeed status --json``, the control socket and the metrics file); a row's fields with a ``label`` name the
entity in Prometheus labels and TensorBoard tags; a value of ``None`` is "not known yet" and is exported nowhere.
Shutdown: nothing to shut down (pure declarations and functions).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from melfeed.shared.metrics import PHASES
from melfeed.shared.printable import escape_line

__all__ = [
    "Prom",
    "FieldSpec",
    "spec",
    "SchemaField",
    "ProducerRow",
    "GpuRow",
    "Snapshot",
    "schema_fields",
    "field_names",
    "number_fields",
    "record_problem",
    "snapshot_dict",
    "snapshot_problem",
    "metric_rows",
]


@dataclass(frozen=True, slots=True)
class Prom:
    """How a field is exported to Prometheus (names follow its conventions: base units, ``melfeed_`` prefix)."""

    name: str  # the family; prometheus_client adds ``_total`` to a counter's samples
    kind: Literal["gauge", "counter"] = "gauge"
    scale: float = 1.0  # to base units: ms -> s is 0.001, % -> ratio 0.01
    labels: tuple[tuple[str, str], ...] = ()  # fixed labels of this field's sample (``quantile``, ``stage``)
    key_label: str | None = None  # a list or object field: one sample per entry, its index or key here
    one_hot: tuple[str, ...] = ()  # a text field: one sample per value, 1.0 for the current one
    help: str | None = None  # the family's help when fields share it; else the field's meaning


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """What a field is: unit (empty for text and counts of things named by the field), meaning, exports."""

    unit: str
    meaning: str
    prom: Prom | None = None
    board: str | None = None  # TensorBoard tag; in a row, ``{field}`` is replaced by that field's value
    label: str | None = None  # a row's field naming its entity: the Prometheus label it becomes


def spec(
    unit: str, meaning: str, *, prom: Prom | None = None, board: str | None = None, label: str | None = None
) -> Any:
    """A dataclass field carrying its ``FieldSpec`` (typed ``Any`` as ``dataclasses.field`` is)."""
    return field(metadata={"spec": FieldSpec(unit, meaning, prom, board, label)})


_STAGE_HELP = "Seconds per batch in a build stage (window)"


@dataclass(frozen=True, slots=True)
class ProducerRow:
    """One connected producer, from its heartbeat's cumulative stage counters (means over the window)."""

    id: str = spec("", "the producer's id (its HELLO)", label="producer")
    batches: int | None = spec(
        "batches",
        "batches built by the producer process, from its heartbeat",
        prom=Prom("melfeed_producer_batches", "counter"),
    )
    batches_per_s: float | None = spec(
        "1/s",
        "batches built per second (window)",
        prom=Prom("melfeed_producer_batches_per_second"),
        board="producer/{id}/batches_per_s",
    )
    read_ms: float | None = spec(
        "ms",
        "reading a batch's rows from the cache, per batch (window)",
        prom=Prom("melfeed_producer_stage_seconds", scale=0.001, labels=(("stage", "read"),), help=_STAGE_HELP),
    )
    assemble_ms: float | None = spec(
        "ms",
        "padding and packing a batch, per batch (window)",
        prom=Prom("melfeed_producer_stage_seconds", scale=0.001, labels=(("stage", "assemble"),), help=_STAGE_HELP),
    )
    send_ms: float | None = spec(
        "ms",
        "sending a batch, per batch (window)",
        prom=Prom("melfeed_producer_stage_seconds", scale=0.001, labels=(("stage", "send"),), help=_STAGE_HELP),
    )


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One sampled GPU (NVML, observe/gpu.py) and the role it plays."""

    role: str = spec("", "model (runs the step) or data (the producers')", label="role")
    index: int = spec("", "NVML index (PCI bus order)", label="index")
    uuid: str = spec("", "NVML UUID: the same GPU under any numbering")
    util_pct: float = spec(
        "%",
        "GPU busy fraction (NVML)",
        prom=Prom("melfeed_gpu_utilization_ratio", scale=0.01),
        board="gpu/{role}-{index}/util_pct",
    )
    mem_used_mib: float = spec(
        "MiB",
        "GPU memory used (NVML)",
        prom=Prom("melfeed_gpu_memory_used_bytes", scale=2.0**20),
        board="gpu/{role}-{index}/mem_mib",
    )
    mem_total_mib: float = spec(
        "MiB", "GPU memory size (NVML)", prom=Prom("melfeed_gpu_memory_total_bytes", scale=2.0**20)
    )
    power_w: float | None = spec(
        "W", "GPU board power (NVML; null where not supported)", prom=Prom("melfeed_gpu_power_watts")
    )


_STEP_HELP = "Step time percentiles (window)"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The consumer's figures at one moment; *window*: over the last ``consumer.metrics_window_s`` after warm-up."""

    t_unix_s: float = spec("s", "wall clock of the snapshot")
    uptime_s: float = spec(
        "s",
        "since the consumer process started",
        prom=Prom("melfeed_uptime_seconds", help="Seconds since the consumer process started"),
    )
    phase: str = spec(
        "",
        "compiling, training, waiting or done",
        prom=Prom("melfeed_phase", key_label="phase", one_hot=PHASES, help="1 for the consumer's current phase"),
    )
    step: int = spec(
        "batches",
        "batches applied to the model by this consumer process",
        prom=Prom("melfeed_batches_applied", "counter"),
    )
    steps_total: int | None = spec(
        "batches",
        "plan position the run stops at (consumer.steps; null: until stopped)",
        prom=Prom("melfeed_steps_target"),
    )
    loss: float | None = spec("", "loss of the newest completed step", prom=Prom("melfeed_loss"))
    window_s: float = spec(
        "s", "length of the sliding window of the windowed figures", prom=Prom("melfeed_window_seconds")
    )
    stall_pct: float | None = spec(
        "%",
        "time the step loop waited for batches / wall time (window)",
        prom=Prom("melfeed_stall_ratio", scale=0.01),
        board="feed/stall_pct",
    )
    batches_per_s: float | None = spec(
        "1/s",
        "batches applied per second (window)",
        prom=Prom("melfeed_batches_per_second"),
        board="feed/batches_per_s",
    )
    samples_per_s: float | None = spec(
        "1/s",
        "real samples applied per second (window)",
        prom=Prom("melfeed_samples_per_second"),
        board="feed/samples_per_s",
    )
    bytes_per_s: float | None = spec(
        "bytes/s", "payload bytes received per second (window)", prom=Prom("melfeed_received_bytes_per_second")
    )
    step_p50_ms: float | None = spec(
        "ms",
        "step time, median (window)",
        prom=Prom("melfeed_step_seconds", scale=0.001, labels=(("quantile", "0.5"),), help=_STEP_HELP),
    )
    step_p99_ms: float | None = spec(
        "ms",
        "step time, 99th percentile (window)",
        prom=Prom("melfeed_step_seconds", scale=0.001, labels=(("quantile", "0.99"),), help=_STEP_HELP),
    )
    step_cv: float | None = spec(
        "ratio", "coefficient of variation of the step time (window)", prom=Prom("melfeed_step_time_cv_ratio")
    )
    padding_efficiency: float | None = spec(
        "ratio",
        "real frames / padded frames (window)",
        prom=Prom("melfeed_padding_efficiency_ratio"),
        board="feed/padding_efficiency",
    )
    queue_depth_mean: float | None = spec(
        "batches",
        "mean ready batches + leases when a batch was taken (window)",
        prom=Prom("melfeed_queue_depth_mean"),
        board="feed/queue_depth",
    )
    queue_depth_hist: list[int] = spec(
        "batches",
        "batches taken at each queue depth (index = depth; window)",
        prom=Prom("melfeed_queue_depth_batches", key_label="depth"),
    )
    lease_window: int = spec("leases", "leases one producer may hold", prom=Prom("melfeed_lease_window"))
    leases_outstanding: int = spec(
        "leases", "leases granted and not yet delivered", prom=Prom("melfeed_leases_outstanding")
    )
    producers_alive: int = spec("producers", "producers connected now", prom=Prom("melfeed_producers_alive"))
    producers: list[ProducerRow] = spec("", "one row per connected producer")
    rejects: dict[str, int] = spec(
        "messages",
        "rejected messages by reject code, so far",
        prom=Prom("melfeed_rejects", "counter", key_label="code"),
    )
    duplicates: int = spec("batches", "duplicate batches dropped", prom=Prom("melfeed_duplicates", "counter"))
    quarantined: int = spec(
        "rows",
        "rows received that a producer left empty (bad cache file), so far",
        prom=Prom("melfeed_quarantined_samples", "counter"),
    )
    compiles_after_ready: int = spec(
        "compiles", "step compiles after READY", prom=Prom("melfeed_compiles_after_ready", "counter")
    )
    gpus: list[GpuRow] = spec("", "one row per sampled GPU; empty without NVML, GPUs or sampling")
    jit_compile: str | None = spec("", "how the step was compiled: xla or graph (null until compiled)")
    outputs: dict[str, float | None] = spec(
        "",
        "the step's named scalars (loss, e.g. mel_l1), mean over the status interval (null: not finite)",
        prom=Prom("melfeed_step_output", key_label="name"),
    )
    producers_benched: list[str] = spec("", "producers held without leases (let leases expire in a row)")
    rank: int = spec("", "this consumer's rank in a multi-worker job (a label on every sample when world > 1)")
    world: int = spec("ranks", "ranks in the job (1: a single consumer)", prom=Prom("melfeed_world_size"))
    checkpoint_failures: int = spec(
        "checkpoints",
        "periodic checkpoints that could not be written (each retried)",
        prom=Prom("melfeed_checkpoint_failures", "counter"),
    )
    connections_cut: int = spec(
        "connections", "connections cut at transport.max_connections", prom=Prom("melfeed_connections_cut", "counter")
    )
    feed_efficiency: float | None = spec(
        "ratio",
        "fed steps/s / steps/s of the same step on resident batches of the same buckets (since warm-up)",
        prom=Prom("melfeed_feed_efficiency_ratio"),
        board="feed/feed_efficiency",
    )
    hello_repeats: int = spec(
        "messages",
        "HELLOs repeating a producer's join, answered again (leases kept)",
        prom=Prom("melfeed_hello_repeats", "counter"),
    )
    useful_work: float | None = spec(
        "ratio",
        "feed efficiency x padding efficiency (window)",
        prom=Prom("melfeed_useful_work_ratio"),
        board="feed/useful_work",
    )


@dataclass(frozen=True, slots=True)
class SchemaField:
    """One field of a schema record, its annotation resolved."""

    name: str
    hint: Any  # the resolved annotation: int, float | None, list[GpuRow] ...
    spec: FieldSpec
    nullable: bool  # ``None`` is allowed
    base: Any  # the annotation without ``None``
    row: type | None  # the row record of a ``list[Row]`` field


@functools.cache
def schema_fields(record: type = Snapshot) -> tuple[SchemaField, ...]:
    """The fields of ``record`` (a schema dataclass), in declaration (wire) order."""
    hints = typing.get_type_hints(record)
    out = []
    for f in dataclasses.fields(record):
        hint = hints[f.name]
        nullable, base = _split_none(hint)
        args = typing.get_args(base)
        is_rows = typing.get_origin(base) is list and isinstance(args[0], type) and dataclasses.is_dataclass(args[0])
        row = args[0] if is_rows else None
        out.append(SchemaField(f.name, hint, f.metadata["spec"], nullable, base, row))
    return tuple(out)


def _split_none(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return True, rest[0]
    return False, hint


def field_names(record: type = Snapshot) -> tuple[str, ...]:
    """The keys of ``record``'s JSON form, in wire order."""
    return tuple(f.name for f in schema_fields(record))


def number_fields(record: type = Snapshot) -> tuple[str, ...]:
    """The numeric scalar fields (integers and numbers, nullable or not)."""
    return tuple(f.name for f in schema_fields(record) if f.base in (int, float))


def snapshot_dict(snap: Snapshot) -> dict[str, Any]:
    """The JSON form: an object per record, keys in declaration order (``dataclasses.asdict``, a deep copy)."""
    return dataclasses.asdict(snap)


# --- validation: a JSON object read back (status, from anyone who answers) ---------------------------------
_JSON_TYPES = (
    (type(None), "null"),
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)


def _json_type(value: Any) -> str:
    return next(name for kind, name in _JSON_TYPES if isinstance(value, kind))


def _wanted(base: Any) -> str:
    origin = typing.get_origin(base) or base
    if dataclasses.is_dataclass(origin):
        return "an object"
    return {int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}[origin]


def _is_a(value: Any, base: Any) -> bool:
    if isinstance(value, bool):
        return False
    origin = typing.get_origin(base) or base
    if origin is float:
        return isinstance(value, (int, float))
    return isinstance(value, dict if dataclasses.is_dataclass(origin) else origin)


def _value_problem(value: Any, hint: Any, where: str) -> str | None:
    nullable, base = _split_none(hint)
    if value is None and nullable:
        return None
    if not _is_a(value, base):
        return f"{where}: must be {_wanted(base)}{' or null' if nullable else ''}, got {_json_type(value)}"
    if dataclasses.is_dataclass(base):
        return record_problem(value, typing.cast(type, base), where + ".")
    args = typing.get_args(base)
    entries = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict) else ()
    for key, entry in entries:  # an object's keys are the peer's text: escaped
        problem = _value_problem(entry, args[-1], f"{where}[{escape_line(str(key), 32)}]")
        if problem is not None:
            return problem
    return None


def record_problem(obj: Mapping[str, Any], record: type, prefix: str = "") -> str | None:
    """The first field of ``record`` that ``obj`` lacks or holds with the wrong JSON type (``KEY: REASON``)."""
    for f in schema_fields(record):
        if f.name not in obj:
            return f"{prefix}{f.name}: missing"
        problem = _value_problem(obj[f.name], f.hint, prefix + f.name)
        if problem is not None:
            return problem
    return None


def snapshot_problem(snap: Mapping[str, Any], schema: type = Snapshot) -> str | None:
    """Why ``snap`` is not a snapshot of ``schema`` (``KEY: REASON``, peer text escaped), or ``None``.

    Every field is required; keys the schema does not name are ignored.
    """
    return record_problem(snap, schema)


# --- the reference -----------------------------------------------------------------------------------------
_NOUNS = {int: "integer", float: "number", str: "string"}


def _type_text(f: SchemaField) -> str:
    """The JSON type of a field in words: "number or null", "array of integers", "object of numbers or null"."""
    origin = typing.get_origin(f.base)
    if f.row is not None:
        text = "array of objects"
    elif origin in (list, dict):
        nullable, element = _split_none(typing.get_args(f.base)[-1])
        text = f"{'array' if origin is list else 'object'} of {_NOUNS[element]}s{' or null' if nullable else ''}"
    else:
        text = _NOUNS[f.base]
    return f"{text} or null" if f.nullable else text


def metric_rows(schema: type = Snapshot) -> list[tuple[str, str, str, str]]:
    """(name, type, unit, meaning) of every field, rows' fields as ``producers[].read_ms``: the reference table.

    ``type`` is the JSON type ("number or null", "array of objects" ...); ``unit`` is empty for text and for
    figures without one.
    """
    rows = []
    for f in schema_fields(schema):
        rows.append((f.name, _type_text(f), f.spec.unit, f.spec.meaning))
        if f.row is not None:
            rows += [(f"{f.name}[].{name}", kind, unit, meaning) for name, kind, unit, meaning in metric_rows(f.row)]
    return rows
