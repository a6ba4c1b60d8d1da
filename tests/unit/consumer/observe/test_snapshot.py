"""The snapshot schema is defined once: Telemetry builds it; status, Prometheus and TensorBoard read it as declared."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from melfeed.consumer.observe.board import board_scalars
from melfeed.consumer.observe.prom import SnapshotCollector, snapshot_families
from melfeed.consumer.observe.snapshot import (
    ProducerRow,
    Prom,
    Snapshot,
    field_names,
    metric_rows,
    schema_fields,
    snapshot_problem,
    spec,
)
from melfeed.consumer.observe.status import format_status
from melfeed.consumer.observe.telemetry import Telemetry
from melfeed.shared.metrics import StepRecord
from tests.fakes import gpu_row, metrics_snapshot, producer_row
from tests.unit.consumer.observe.test_telemetry import _cfg, _FakeConsumer

_REPO = Path(__file__).resolve().parents[4]
_LISTING_MIN_KEYS = 6  # a literal naming this many snapshot keys spells the schema out again (bench records share 5)


def _scrape(snap: dict[str, Any], schema: type = Snapshot) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap, schema))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }


def _full_snapshot() -> dict[str, Any]:
    """Every figure known, every list and object with entries: each exported field has samples."""
    return metrics_snapshot(
        1.0,
        rejects={"SHAPE": 2},
        outputs={"loss": 0.5, "mel_l1": 0.25},
        producers=[producer_row("producer-1"), producer_row("producer-2", batches_per_s=2.0)],
        gpus=[gpu_row("model", 0), gpu_row("data", 1, power_w=None)],
    )


def test_a_snapshot_built_by_telemetry_is_valid_in_wire_order_and_its_json_is_the_published_bytes(
    tmp_path: Path,
) -> None:
    clock = iter(float(t) for t in range(100))
    with Telemetry(_cfg(tmp_path), _FakeConsumer(), 0.0, control_endpoint=None, clock=lambda: next(clock)) as tel:
        tel.add(StepRecord(1.0, 0.25, 0.75, 4, 30, 40, 2))
        snap = tel.publish(7, 0.5, 0)
        published = tel.latest_json()
    assert tuple(snap) == field_names() and snapshot_problem(snap) is None
    assert published == json.dumps(snap, allow_nan=False).encode()
    assert tuple(snap["producers"][0]) == field_names(ProducerRow)
    fake = metrics_snapshot(1.0)  # the tests' fake is built through the same schema
    assert tuple(fake) == field_names() and snapshot_problem(fake) is None


def test_a_fake_snapshot_refuses_a_field_the_schema_lacks() -> None:
    with pytest.raises(TypeError, match="not snapshot fields: stall_percent"):
        metrics_snapshot(1.0, stall_percent=3.0)


def _expected_samples(snap: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What each field's ``Prom`` says the scrape holds, worked out from the schema alone."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def add(prom: Prom, labels: dict[str, str], value: Any) -> None:
        if value is None:
            return
        name = prom.name + ("_total" if prom.kind == "counter" else "")
        out[(name, tuple(sorted((labels | dict(prom.labels)).items())))] = value * prom.scale

    for f in schema_fields():
        if f.row is not None:
            for row in snap[f.name]:
                labels = {r.spec.label: str(row[r.name]) for r in schema_fields(f.row) if r.spec.label}
                for r in schema_fields(f.row):
                    if r.spec.prom is not None:
                        add(r.spec.prom, labels, row[r.name])
        elif (prom := f.spec.prom) is not None and prom.one_hot:
            for choice in prom.one_hot:
                add(prom, {prom.key_label or "": choice}, 1.0 if snap[f.name] == choice else 0.0)
        elif prom is not None and prom.key_label is not None:
            entries = snap[f.name].items() if isinstance(snap[f.name], dict) else enumerate(snap[f.name])
            for key, value in entries:
                add(prom, {prom.key_label: str(key)}, value)
        elif prom is not None:
            add(prom, {}, snap[f.name])
    return out


def test_every_field_is_exported_to_prometheus_as_its_schema_says() -> None:
    snap = _full_snapshot()
    scraped = _scrape(snap)
    expected = _expected_samples(snap)
    assert scraped == pytest.approx(expected)
    assert ("melfeed_stall_ratio", ()) in scraped  # spot checks of the schema's word
    assert ("melfeed_producer_stage_seconds", (("producer", "producer-2"), ("stage", "send"))) in scraped
    exported = {f.spec.prom.name for f in schema_fields() if f.spec.prom is not None}
    exported |= {r.spec.prom.name for f in schema_fields() if f.row for r in schema_fields(f.row) if r.spec.prom}
    assert {family.name for family in snapshot_families(snap)} == exported  # and nothing else


def test_an_unknown_figure_is_left_out_of_the_scrape_and_of_tensorboard() -> None:
    snap = metrics_snapshot(1.0, stall_pct=None, gpus=[gpu_row(power_w=None)])
    assert ("melfeed_stall_ratio", ()) not in _scrape(snap)
    assert not [k for k in _scrape(snap) if k[0] == "melfeed_gpu_power_watts"]
    assert "feed/stall_pct" not in board_scalars(snap, {})


def test_every_field_with_a_tensorboard_tag_is_written_under_it() -> None:
    snap = _full_snapshot()
    expected = {f.spec.board: float(snap[f.name]) for f in schema_fields() if f.spec.board}
    for f in schema_fields():
        for row in snap[f.name] if f.row else ():
            expected |= {
                r.spec.board.format(**row): float(row[r.name])
                for r in schema_fields(f.row)
                if r.spec.board and row[r.name] is not None
            }
    assert board_scalars(snap, {"loss": 0.5}) == {"train/loss": 0.5, **expected}
    assert {"feed/stall_pct", "gpu/data-1/util_pct", "producer/producer-2/batches_per_s"} <= set(expected)


@dataclass(frozen=True, slots=True)
class _Wider(Snapshot):
    """The schema with one field more: the one edit adding a figure takes."""

    gpu_temp_c: float | None = spec(
        "C", "hottest GPU's temperature", prom=Prom("melfeed_gpu_temperature_celsius"), board="gpu/temp_c"
    )


def test_a_field_added_to_the_schema_is_validated_exported_and_listed_with_no_other_edit() -> None:
    snap = metrics_snapshot(1.0)
    assert snapshot_problem(snap, _Wider) == "gpu_temp_c: missing"
    assert (
        snapshot_problem(snap | {"gpu_temp_c": "hot"}, _Wider) == "gpu_temp_c: must be a number or null, got a string"
    )
    wide = snap | {"gpu_temp_c": 61.0}
    assert snapshot_problem(wide, _Wider) is None
    assert _scrape(wide, _Wider)[("melfeed_gpu_temperature_celsius", ())] == 61.0
    assert board_scalars(wide, {}, _Wider)["gpu/temp_c"] == 61.0
    assert metric_rows(_Wider)[-1] == ("gpu_temp_c", "number or null", "C", "hottest GPU's temperature")
    assert "melfeed_gpu_temperature_celsius" not in {name for name, _ in _scrape(wide)}  # the schema decides
    assert format_status(wide, "ipc:///x").startswith("consumer ipc:///x: training")


def test_metric_rows_list_every_field_and_row_field_with_type_unit_and_meaning() -> None:
    rows = metric_rows()
    names = [name for name, _, _, _ in rows]
    assert [n for n in names if "[]" not in n] == list(field_names())
    assert {"producers[].read_ms", "gpus[].util_pct"} <= set(names)
    assert all(meaning and kind for _, kind, _, meaning in rows)
    by_name = {name: (kind, unit) for name, kind, unit, _ in rows}
    assert by_name["stall_pct"] == ("number or null", "%") and by_name["queue_depth_hist"][0] == "array of integers"
    assert by_name["producers"][0] == "array of objects" and by_name["outputs"][0] == "object of numbers or null"


def _listings(path: Path, keys: set[str]) -> list[str]:
    """``path:line`` of each tuple, list, set or dict literal naming ``_LISTING_MIN_KEYS`` or more of ``keys``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items: list[ast.expr | None] = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = list(node.keys)
        else:
            continue
        named = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)} & keys
        if len(named) >= _LISTING_MIN_KEYS:
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_module_but_the_schema_spells_out_the_snapshots_keys(tmp_path: Path) -> None:
    keys = set(field_names())
    schema = _REPO / "consumer" / "observe" / "snapshot.py"
    found = [
        hit
        for folder in ("consumer", "tests")
        for path in sorted((_REPO / folder).rglob("*.py"))
        if path != schema
        for hit in _listings(path, keys)
    ]
    assert found == []
    spelled = tmp_path / "spelled.py"  # the check finds a listing where there is one
    spelled.write_text(f"KEYS = {field_names()[:_LISTING_MIN_KEYS]!r}\n")
    assert _listings(spelled, keys) == [f"{spelled}:1"]
