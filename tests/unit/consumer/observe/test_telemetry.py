"""Snapshots from synthetic step records, receiver stats and heartbeat counters, against hand-computed values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from melfeed.consumer.flow.peers import ProducerReport
from melfeed.consumer.observe.prom import SnapshotCollector
from melfeed.consumer.observe.snapshot import GpuRow, ProducerRow, field_names, schema_fields
from melfeed.consumer.observe.status import format_status, snapshot_problem
from melfeed.consumer.observe.telemetry import ProducerRates, Telemetry, build_snapshot
from melfeed.consumer.transport.receiver import ReceiverStats
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError
from melfeed.shared.metrics import FEED_EFFICIENCY_MIN_STEPS, StepRecord, StepWindow
from melfeed.shared.wire.protocol import StageCounters


def _stats(
    producers: tuple[ProducerReport, ...] = (), rejects: dict[str, int] | None = None, bytes_received: int = 0
) -> ReceiverStats:
    return ReceiverStats(
        batches_received=10,
        bytes_received=bytes_received,
        duplicates_dropped=1,
        stale_dropped=0,
        leases_outstanding=3,
        leases_reissued=0,
        producers_alive=len(producers),
        producers_seen=2,
        rejects=rejects or {},
        quarantined=2,
        lease_window=2,
        producers=producers,
        hello_repeats=4,
    )


def test_snapshot_has_every_schema_key_and_hand_computed_figures() -> None:
    w = StepWindow(window_s=100.0)
    # (end, wait, step, depth): starts at 0; waits 1 s of 8; steps [1, 1, 2, 2] s; depths 1, 1, 2, 2.
    for end, wait, step in ((2.0, 1.0, 1.0), (3.0, 0.0, 1.0), (5.0, 0.0, 2.0), (8.0, 0.0, 2.0)):
        w.add(StepRecord(end, wait, step, 4, 30, 40, int(step)))
    gpus = [
        GpuRow(
            role="model", index=0, uuid="GPU-0", util_pct=97.0, mem_used_mib=1000.0, mem_total_mib=81559.0, power_w=None
        )
    ]
    producers = [
        ProducerRow(id="producer-1", batches=60, batches_per_s=5.0, read_ms=1.5, assemble_ms=None, send_ms=float("nan"))
    ]
    snap = build_snapshot(
        t_unix_s=1000.5,
        uptime_s=12.0,
        phase="training",
        step=120,
        steps_total=300,
        loss=float("nan"),
        window_s=100.0,
        figures=w.figures(8.0),
        depth_hist=w.depth_histogram(8.0),
        bytes_per_s=9e7,
        rs=_stats(rejects={"SHAPE": 1, "CRC": 2}),
        producers=producers,
        compiles_after_ready=0,
        gpus=gpus,
    )
    assert tuple(snap) == field_names()
    assert snap["loss"] is None  # NaN never reaches JSON
    assert snap["stall_pct"] == pytest.approx(12.5)  # 1 s of 8
    assert snap["batches_per_s"] == pytest.approx(0.5) and snap["samples_per_s"] == pytest.approx(2.0)
    assert (snap["step_p50_ms"], snap["step_p99_ms"]) == (1000.0, 2000.0)
    assert snap["step_cv"] == pytest.approx(1 / 3) and snap["padding_efficiency"] == pytest.approx(0.75)
    assert snap["queue_depth_mean"] == pytest.approx(1.5) and snap["queue_depth_hist"] == [0, 2, 2]
    assert (snap["lease_window"], snap["leases_outstanding"], snap["duplicates"], snap["quarantined"]) == (2, 3, 1, 2)
    assert snap["rejects"] == {"CRC": 2, "SHAPE": 1}
    assert snap["producers"][0]["send_ms"] is None and snap["gpus"] == [dataclasses.asdict(g) for g in gpus]
    assert snapshot_problem(snap) is None  # `status` shows what the consumer sends
    json.dumps(snap, allow_nan=False)


def test_snapshot_before_any_step_is_all_nulls_where_unknown() -> None:
    snap = build_snapshot(
        t_unix_s=1.0,
        uptime_s=0.1,
        phase="compiling",
        step=0,
        steps_total=None,
        loss=None,
        window_s=30.0,
        figures=None,
        depth_hist=[],
        bytes_per_s=None,
        rs=_stats(),
        producers=[],
        compiles_after_ready=0,
        gpus=[],
    )
    assert tuple(snap) == field_names()
    windowed = [f.name for f in schema_fields() if f.nullable and f.base is float and f.name != "loss"]
    assert len(windowed) > 10 and all(snap[k] is None for k in windowed)  # every figure of the window
    assert snapshot_problem(snap) is None


def _report(pid: str, at_s: float, batches: int, read_s: float, asm_s: float, send_s: float) -> ProducerReport:
    return ProducerReport(pid, batches, StageCounters(batches, read_s, asm_s, send_s), at_s)


def test_producer_rates_are_deltas_of_cumulative_counters_over_the_window() -> None:
    rates = ProducerRates(window_s=30.0)
    first = rates.update([_report("producer-1", 10.0, 100, 1.0, 0.2, 0.5)], now_s=10.0)
    assert first == [
        ProducerRow(id="producer-1", batches=100, batches_per_s=None, read_ms=None, assemble_ms=None, send_ms=None)
    ]
    # 50 more batches in 10 s costing 0.1 s read, 0.05 s assemble, 0.2 s send: 2, 1 and 4 ms per batch.
    [row] = rates.update([_report("producer-1", 20.0, 150, 1.1, 0.25, 0.7)], now_s=20.0)
    assert row.batches == 150 and row.batches_per_s == pytest.approx(5.0)
    assert (row.read_ms, row.assemble_ms, row.send_ms) == pytest.approx((2.0, 1.0, 4.0))
    # At t=65 the window (30 s) opens at 35; the base is the newest point before it (t=20), the one at
    # t=10 is dropped: 130 batches in 45 s, 0.26 s of reads = 2 ms per batch.
    rates.update([_report("producer-1", 50.0, 250, 1.3, 0.3, 0.9)], now_s=50.0)
    [row] = rates.update([_report("producer-1", 65.0, 280, 1.36, 0.33, 1.02)], now_s=65.0)
    assert row.batches_per_s == pytest.approx(130 / 45) and row.read_ms == pytest.approx(2.0)


def test_a_restarted_producer_starts_over_and_a_gone_one_is_forgotten() -> None:
    rates = ProducerRates(window_s=30.0)
    rates.update([_report("producer-1", 1.0, 500, 5.0, 1.0, 1.0), _report("producer-2", 1.0, 9, 0.1, 0.1, 0.1)], 1.0)
    [row] = rates.update([_report("producer-1", 2.0, 3, 0.01, 0.0, 0.0)], now_s=2.0)  # counter went back
    assert row.batches == 3 and row.batches_per_s is None
    [row] = rates.update([_report("producer-1", 3.0, 13, 0.03, 0.0, 0.0)], now_s=3.0)
    assert row.batches_per_s == pytest.approx(10.0) and row.read_ms == pytest.approx(2.0)
    [row] = rates.update([ProducerReport("producer-2", 4, None, 0.0)], now_s=4.0)  # rejoined, no stats yet
    assert row == ProducerRow(
        id="producer-2", batches=None, batches_per_s=None, read_ms=None, assemble_ms=None, send_ms=None
    )


class _FakeConsumer:
    """Only what Telemetry reads: receiver stats (bytes grow 1 MB per call) and no ZeroMQ context."""

    def __init__(self) -> None:
        self.calls = 0

    def receiver_stats(self) -> ReceiverStats:
        self.calls += 1
        return _stats(
            (_report("producer-1", float(self.calls), 10 * self.calls, 0.01 * self.calls, 0.0, 0.0),),
            bytes_received=1_000_000 * self.calls,
        )


def _cfg(tmp_path: Path, **consumer: Any) -> Any:
    return config_from_mapping({"cache_dir": str(tmp_path), "consumer": {"gpu_sample_interval_s": 0, **consumer}})


def test_metrics_file_gets_one_line_per_publish_with_every_key(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    clock = iter(float(t) for t in range(100))
    tel = Telemetry(
        _cfg(tmp_path, metrics_file=str(path)),
        _FakeConsumer(),
        0.0,
        control_endpoint=None,
        clock=lambda: next(clock),
        wall=lambda: 50.0,
    )
    with tel:
        tel.set_phase("training")
        tel.add(StepRecord(1.5, 0.0, 0.5, 4, 30, 40, 2))
        tel.publish(1, 0.5, 0)
        latest = tel.latest()
        tel.publish(1, 0.5, 0, phase="done")
    tel.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["phase"] for x in lines] == ["compiling", "training", "done"]
    assert all(tuple(x) == field_names() for x in lines)
    assert lines[0]["bytes_per_s"] is None and lines[1]["bytes_per_s"] == pytest.approx(1e6)  # 1 MB per 1 s
    assert latest == lines[1] and latest is not tel.latest()
    assert json.loads(tel.latest_json()) == lines[2]


def test_unwritable_metrics_file_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "missing-dir" / "m.jsonl"
    tel = Telemetry(_cfg(tmp_path, metrics_file=str(bad)), _FakeConsumer(), 0.0, control_endpoint=None)
    with pytest.raises(ConfigError) as info:
        tel.start()
    assert str(info.value).startswith(f"consumer.metrics_file: cannot append to {bad}: No such file")
    tel.close()


def test_gpu_samples_carry_their_role_with_nvml_replaced_at_the_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pynvml

    for name, fn in {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h}",
        "nvmlDeviceGetName": lambda h: "NVIDIA H100",
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=90 + h),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=2**30, total=2**33),
        "nvmlDeviceGetPowerUsage": lambda h: 300_000,
    }.items():
        monkeypatch.setattr(pynvml, name, fn)
    cfg = config_from_mapping(
        {
            "cache_dir": str(tmp_path),
            "consumer": {"model_gpu": "0", "gpu_sample_interval_s": 60},
            "producer": {"data_gpu": "1"},
        }
    )
    with Telemetry(cfg, _FakeConsumer(), 0.0, control_endpoint=None) as tel:
        snap = tel.publish(0, None, 0)
    assert snap["gpus"] == [
        {
            "role": "model",
            "index": 0,
            "uuid": "GPU-0",
            "util_pct": 90.0,
            "mem_used_mib": 1024.0,
            "mem_total_mib": 8192.0,
            "power_w": 300.0,
        },
        {
            "role": "data",
            "index": 1,
            "uuid": "GPU-1",
            "util_pct": 91.0,
            "mem_used_mib": 1024.0,
            "mem_total_mib": 8192.0,
            "power_w": 300.0,
        },
    ]


def test_status_table_and_prometheus_families_from_one_snapshot(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    clock = iter(float(t) for t in range(100))
    with Telemetry(_cfg(tmp_path), _FakeConsumer(), 0.0, control_endpoint=None, clock=lambda: next(clock)) as tel:
        tel.add(StepRecord(1.0, 0.25, 0.75, 4, 30, 40, 2))  # waited 0.25 s of the 1 s it covers
        snap = tel.publish(7, 0.5, 0)
    table = format_status(snap, "ipc:///x.control.sock")
    assert "step 7/300" in table and "stall 25.0%" in table
    assert any(line.split()[:4] == ["producer-1", "20", "10.0", "1.00"] for line in table.splitlines())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    assert samples[("melfeed_batches_applied_total", ())] == 7
    assert samples[("melfeed_stall_ratio", ())] == pytest.approx(0.25)
    assert samples[
        ("melfeed_producer_stage_seconds", (("producer", "producer-1"), ("stage", "read")))
    ] == pytest.approx(0.001)
    assert samples[("melfeed_phase", (("phase", "compiling"),))] == 1.0


def test_prometheus_without_the_package_or_with_a_taken_port_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import sys

    from melfeed.consumer.observe.prom import start_prometheus

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            start_prometheus("127.0.0.1", port, lambda: None)
        assert str(info.value).startswith(f"consumer.metrics_port: cannot listen on 127.0.0.1:{port}")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    with pytest.raises(ConfigError) as info:
        start_prometheus("127.0.0.1", port, lambda: None)
    assert "consumer.metrics_port: needs prometheus_client" in str(info.value)


def test_named_step_outputs_and_jit_mode_reach_snapshot_status_and_prometheus(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    clock = iter(float(t) for t in range(100))
    with Telemetry(_cfg(tmp_path), _FakeConsumer(), 0.0, control_endpoint=None, clock=lambda: next(clock)) as tel:
        latest = tel.latest()
        assert latest is not None and latest["outputs"] == {} and latest["jit_compile"] is None
        tel.set_jit_compile("graph")
        means = {"loss": 0.75, "mel_l1": 0.5, "stop_bce": float("nan")}
        first = tel.publish(3, 0.7, 0, outputs=means)
        starved = tel.publish(3, 0.7, 0)  # a starved loop publishes no new means: the same ones
    assert first["outputs"] == {"loss": 0.75, "mel_l1": 0.5, "stop_bce": None} and first["jit_compile"] == "graph"
    assert starved["outputs"] == first["outputs"]
    assert snapshot_problem(first) is None
    json.dumps(first, allow_nan=False)
    table = format_status(first, "ipc:///x.control.sock")
    assert (
        "step outputs (mean over the status interval): loss 0.7500, mel_l1 0.5000, stop_bce -; "
        "compiled with graph" in table
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: first))
    families = {fam.name: fam for fam in text_string_to_metric_families(generate_latest(registry).decode())}
    named = {s.labels["name"]: s.value for s in families["melfeed_step_output"].samples}
    assert named == {"loss": 0.75, "mel_l1": 0.5}  # one family, a `name` label; null left out


def test_peer_chosen_ids_are_escaped_in_the_status_table_and_prometheus_labels() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from tests.fakes import metrics_snapshot, producer_row

    evil = "evil\nINFO forged\x1b[2J"
    snap = metrics_snapshot(1.0, producers=[producer_row(evil)], producers_benched=[evil])
    table = format_status(snap, "ipc:///x.control.sock")
    assert "\x1b" not in table and not any(line.startswith("INFO forged") for line in table.splitlines())
    assert "evil\\nINFO forged\\x1b[2J" in table
    assert "benched (let leases expire in a row; no leases for now): evil\\nINFO forged" in table
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    exposition = generate_latest(registry).decode()
    assert "\x1b" not in exposition and 'producer="evil\\\\nINFO forged\\\\x1b[2J"' in exposition


def test_a_rank_of_a_job_shows_in_status_and_labels_every_prometheus_sample() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tests.fakes import metrics_snapshot

    def samples(snap: dict[str, Any]) -> list[Any]:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(lambda: snap))
        return [s for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples]

    alone = build_snapshot(
        t_unix_s=1.0,
        uptime_s=0.1,
        phase="compiling",
        step=0,
        steps_total=None,
        loss=None,
        window_s=30.0,
        figures=None,
        depth_hist=[],
        bytes_per_s=None,
        rs=_stats(),
        producers=[],
        compiles_after_ready=0,
        gpus=[],
    )
    assert (alone["rank"], alone["world"]) == (0, 1)
    assert {s.name: s.value for s in samples(alone)}["melfeed_hello_repeats_total"] == 4  # a counter
    assert "rank" not in format_status(alone, "ipc:///x") and all("rank" not in s.labels for s in samples(alone))
    job = metrics_snapshot(1.0, rank=1, world=2)
    assert format_status(job, "ipc:///x").startswith("consumer ipc:///x, rank 1 of 2: training, step 120/300")
    labelled = samples(job)
    assert labelled and all(s.labels.get("rank") == "1" for s in labelled)
    assert {s.name: s.value for s in labelled}["melfeed_world_size"] == 2
    assert ("melfeed_producer_batches_total", {"producer": "producer-1", "rank": "1"}) in [
        (s.name, s.labels) for s in labelled
    ]


def test_snapshots_count_failed_checkpoints_and_cut_connections(tmp_path: Path) -> None:
    from melfeed.consumer.observe.status import format_status

    consumer = _FakeConsumer()
    consumer.connections_cut = 7  # type: ignore[attr-defined]
    failures = [0]
    tel = Telemetry(_cfg(tmp_path), consumer, 0.0, control_endpoint=None, checkpoint_failures=lambda: failures[0])
    with tel:
        failures[0] = 2
        snap = tel.publish(1, 0.5, 0)
    assert (snap["checkpoint_failures"], snap["connections_cut"], snap["hello_repeats"]) == (2, 7, 4)
    assert "checkpoint failures 2, connections cut 7, repeated HELLOs 4" in format_status(snap, "ipc:///x")


def test_feed_efficiency_reaches_snapshot_status_and_prometheus(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    clock = iter(float(t) for t in range(100))
    with Telemetry(_cfg(tmp_path), _FakeConsumer(), 0.0, control_endpoint=None, clock=lambda: next(clock)) as tel:
        before = tel.latest()
        # The figure is reported from FEED_EFFICIENCY_MIN_STEPS steps on: that many steps covering 0..1 s (0.25 s
        # waiting), their buckets taking 0.6 s together on resident batches: 0.6 / 1.0.
        for _ in range(FEED_EFFICIENCY_MIN_STEPS):
            tel.add(StepRecord(1.0, 0.25, 0.75, 4, 30, 40, 2, resident_s=0.6 / FEED_EFFICIENCY_MIN_STEPS))
        snap = tel.publish(7, 0.5, 0)
    assert before is not None and before["feed_efficiency"] is None  # unknown before any step
    assert snap["feed_efficiency"] == pytest.approx(0.6)
    assert "feed efficiency 0.600 (fed / resident-batch steps/s)" in format_status(snap, "ipc:///x.control.sock")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    samples = {
        s.name: s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    assert samples["melfeed_feed_efficiency_ratio"] == pytest.approx(0.6)


class _JoiningConsumer:
    """Receiver stats of a consumer whose producers join while its step compiles."""

    def __init__(self) -> None:
        self.producers: tuple[ProducerReport, ...] = ()

    def receiver_stats(self) -> ReceiverStats:
        return _stats(self.producers)


def test_snapshots_stay_live_while_the_step_compiles_and_stop_when_the_loop_takes_over(tmp_path: Path) -> None:
    import threading
    import time

    consumer = _JoiningConsumer()
    with Telemetry(_cfg(tmp_path, status_interval_s=0.05), consumer, 0.0, control_endpoint=None) as tel:
        assert tel.latest()["producers_alive"] == 0  # type: ignore[index]
        with tel.live_while_busy(step=40):  # resumed at batch 40, compiling
            consumer.producers = (
                _report("producer-1", 1.0, 0, 0.0, 0.0, 0.0),
                _report("producer-2", 1.0, 0, 0.0, 0.0, 0.0),
            )
            deadline = time.monotonic() + 30.0
            while (snap := tel.latest()) is not None and snap["producers_alive"] != 2:
                assert time.monotonic() < deadline, "no snapshot published while busy"
                time.sleep(0.01)
            assert snap is not None and (snap["phase"], snap["step"]) == ("compiling", 40)
        assert not [t for t in threading.enumerate() if t.name == "telemetry-busy"]  # joined on exit
        consumer.producers = ()
        time.sleep(0.2)  # four intervals: nobody publishes now
        assert tel.latest()["producers_alive"] == 2  # type: ignore[index]
