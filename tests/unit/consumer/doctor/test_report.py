"""The doctor's printed report from a hand-made report dict: every stage, the verdict, the changes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from melfeed.consumer.doctor.env import Check
from melfeed.consumer.doctor.report import render
from melfeed.consumer.doctor.verdict import ConfigFacts, Measurements, decide
from melfeed.shared.errors import PipelineError

_BUILD = {
    "batches": 30,
    "elapsed_s": 1.0,
    "batches_per_s": 30.0,
    "build_ms_p50": 30.0,
    "build_ms_p99": 40.0,
    "read_ms_p50": 20.0,
    "cpu_ms_per_batch": 25.0,
    "reader": "files",
    "pack_read": None,
}
_DEVICE = {
    "device": "/CPU:0",
    "step_devices": ["/job:localhost/replica:0/task:0/device:GPU:0"],
    "compile_s": 2.0,
    "compiles_after_ready": 0,
    "buckets": [{"index": 0, "h2d_ms_p50": 1.0, "step_ms_p50": 10.0, "step_ms_p99": 12.0, "runs": 9}],
}
_FACTS = ConfigFacts(
    cores=2, producer_count=2, ring_slots=3, lease_window=2, largest_batch_bytes=9_000_000, padding=0.8, num_buckets=1
)


def _report(n: int) -> dict[str, object]:
    return {
        "cache_dir": "/c",
        "utterances": 10,
        "producers": n,
        "cores": 2,
        "buckets": [[0, 32, 456, 126, 80]],
        "mix": [1.0],
        "padding": [0.8],
        "memory_bound_now_bytes": 63_000_000,
        "outliers": 2,
        "grid": [
            {
                "bucket": 0,
                "frames": 456,
                "tokens": 126,
                "rows": 32,
                "batches": 1,
                "utterances": 10,
                "frames_share": 1.0,
                "padding_efficiency": 0.8,
            }
        ],
        "config_facts": dataclasses.asdict(_FACTS),
        "stages": {
            "build_1": [_BUILD],
            "build_n": [_BUILD] * n,
            "device": _DEVICE,
            "transport_1": {"batches_per_s": 25.0, "path": "shm"},
            "transport_n": {"batches_per_s": 55.0},
        },
    }


def _measurements(n: int) -> Measurements:
    return Measurements(
        producers=n,
        build_ms_p50=30.0,
        read_ms_p50=20.0,
        build_rate_1=30.0,
        build_rate_n=30.0 * n,
        delivered_1=25.0,
        delivered_n=55.0 if n > 1 else 25.0,
        h2d_ms=(1.0,),
        step_ms=(10.0,),
        mix=(1.0,),
    )


def test_report_shows_every_stage_the_derivation_and_the_verdict() -> None:
    v = decide(_measurements(2), _FACTS)
    text = render(_report(2), v, [Check("warn", "socket directory", "/x has mode 0755")])
    assert "2 processes at once: 60.0 batches/s (30.0, 30.0)" in text
    # 1000 / 25 delivered = 40 ms per batch, 30 ms of it building -> 10 ms transport
    assert "transport cost per batch ~ 10.00 ms = 1000 / 25.0 delivered - 30.00 build" in text
    assert "tf.identity on /CPU:0" in text and "demand 100.0 batches/s" in text
    assert "bound by producers (cache read / assembly)" in text and text.endswith("(the data side is the bottleneck)")
    assert "  warn socket directory: /x has mode 0755" in text
    assert "every bucket; ran on /job:localhost/replica:0/task:0/device:GPU:0)" in text  # where the step ran
    assert "note:    the step needs 5 producers at 25.0 batches/s each, but this machine has 2 cores" in text


def test_one_producer_is_not_reported_twice() -> None:
    v = decide(_measurements(1), dataclasses.replace(_FACTS, producer_count=1))
    text = render(_report(1), v, [])
    assert "processes at once" not in text and "(1 producer: not repeated)" in text
    assert "data path: shared-memory slots, 1 copy" in text
    assert "change:  producer.count: 1 -> 2" in text


@pytest.mark.parametrize(
    ("stage", "key"),
    [("device", "step_devices"), ("transport_1", "path"), ("build_1", "reader"), ("build_1", "pack_read")],
)
def test_a_probe_result_without_a_key_the_probe_writes_is_one_line_naming_the_stage_and_key(
    stage: str, key: str
) -> None:
    report = _report(1)
    stages: dict[str, Any] = dict(report["stages"])  # type: ignore[call-overload]
    if stage == "build_1":  # one result per producer process
        stages[stage] = [{k: v for k, v in stages[stage][0].items() if k != key}]
    else:
        stages[stage] = {k: v for k, v in stages[stage].items() if k != key}
    report["stages"] = stages
    with pytest.raises(PipelineError) as info:
        render(report, decide(_measurements(1), dataclasses.replace(_FACTS, producer_count=1)), [])
    assert str(info.value) == (
        f"the {stage} probe's result has no {key!r} (the probe always writes it: a bug in melfeed doctor)"
    )


def test_stage_one_says_what_the_producer_read() -> None:
    facts = dataclasses.replace(_FACTS, producer_count=1)
    for reader, read, words in (
        ("/c/melfeed-float32.pack", "mapped", "reads the packed cache /c/melfeed-float32.pack, mapped)"),
        ("/c/melfeed-float32.pack", "preadv", "reads the packed cache /c/melfeed-float32.pack, preadv)"),
        ("files", None, "reads the .npy files; `melfeed pack --cache-dir CACHE_DIR` makes a faster packed copy)"),
    ):
        report = _report(1)
        build = {**_BUILD, "reader": reader, "pack_read": read}
        report["stages"] = {**report["stages"], "build_1": [build]}  # type: ignore[dict-item]
        assert words in render(report, decide(_measurements(1), facts), [])
