"""The ``bench`` report: raw trials -> medians, ratios, goals (a JSON-able dict) -> the text tables.

Role: pure functions over the trial dicts that ``consumer/bench/command.py`` collected (no I/O, no clock),
so the numbers printed and the numbers written with ``--json`` are the same ones.
Invariants: the baseline is the tuned tf.data variant with the highest median max rate; every
ratio in the report is a median of a system divided by the baseline's median for the same step cost.
Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from melfeed.consumer.bench import stats as bs
from melfeed.consumer.bench.efficiency import render_efficiency

__all__ = ["DEVICE_MODEL", "COPIES_COUNTED", "UNAVAILABLE", "F16_NOTE", "build_report", "render"]

DEVICE_MODEL = (
    "device time is modelled by a sleep after the compiled zero-cost step, sized so one step takes "
    "step_ms (a GPU step costs the host no CPU; real compute on this 2-core machine would steal the "
    "producers' core)"
)
COPIES_COUNTED = (
    "melfeed: the consumer summary's payload_copies_per_batch (page cache to the step); tf.data: "
    "counted from the ops: read_file, decode_raw, padded_batch = 3 (naive: np.load, numpy->tensor, "
    "padded_batch = 3; service: the tuned 3 + serialise, gRPC send, receive, deserialise = 7); "
    "prefetch and DLPack pass references"
)
UNAVAILABLE = "not available in this build (TransportConfig has no 'mode')"
F16_NOTE = (
    "note: -f16 rows: transport.mel_dtype float16 (half the mel bytes; float32 cache files are cast by the "
    "producer, float16 ones read as they are); GB/s counts the bytes moved, so compare batches/s; no goal "
    "judges them"
)
_TRANSPORT_METRICS = (
    "gb_per_s",
    "memcpy_gb_per_s",
    "trainer_cpu_ms_per_batch",
    "total_cpu_ms_per_batch",
    "batches_per_s",
)
_BUILD_METRICS = ("cpu_ms_per_batch", "build_ms_p50", "read_ms_p50", "batches_per_s")


def build_report(
    trials: Sequence[Mapping[str, Any]],
    probes: Sequence[Mapping[str, Any]],
    systems: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
    builds: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Everything ``render`` prints and ``--json`` writes (``builds``: doctor's stage 1, one per round)."""
    meds = bs.medians_by_system(trials)
    baseline = bs.best_system(meds, [x["system"] for x in systems if x["kind"] == "tfdata"])
    melfeed = {x["system"]: x["transport"] for x in systems if x["kind"] == "melfeed" and x["available"]}
    transport_meds = bs.medians_by_system(probes, _TRANSPORT_METRICS)
    build = bs.build_goal([b for b in builds if b["system"] == "producer-build"])  # the -f16 probe: no goal
    goals = (
        bs.evaluate_goals(meds, melfeed, baseline)
        + bs.transport_goals(transport_meds)
        + ([build] if build is not None else [])
    )
    return {
        "settings": dict(settings),
        "device_model": DEVICE_MODEL,
        "copies_counted": COPIES_COUNTED,
        "baseline": baseline,
        "medians": meds,
        "ratios": bs.ratios(meds, baseline),
        "transport_medians": transport_meds,
        "build_medians": _build_medians(builds, "producer-build"),
        "build_medians_f16": _build_medians(builds, "producer-build-f16"),
        "build_medians_npy": _build_medians(builds, "producer-build-npy"),
        "build_medians_preadv": _build_medians(builds, "producer-build-preadv"),
        "goals": [g.as_dict() | {"line": g.line()} for g in goals],
        "unavailable": {x["system"]: UNAVAILABLE for x in systems if not x["available"]},
        "failed": [
            f"{t['system']} round {t['round']} step {t['step_ms']} ms: {t.get('error')}"
            for t in list(trials) + list(probes) + list(builds)
            if not t.get("ok")
        ],
        "trials": list(trials),
        "transport_trials": list(probes),
        "build_trials": list(builds),
    }


def _build_medians(builds: Sequence[Mapping[str, Any]], system: str) -> dict[str, Any]:
    """Medians of one build probe's rounds ({} when it did not run)."""
    mine = [b for b in builds if b["system"] == system and b.get("ok")]
    return {k: bs.median(b.get(k) for b in mine) for k in _BUILD_METRICS} if mine else {}


def _main_table(report: Mapping[str, Any]) -> str:
    meds, rat = report["medians"], report["ratios"]
    rows = []
    for system, by_step in meds.items():
        top = by_step.get(0, {})
        rows.append(
            [
                system,
                top.get("batches_per_s"),
                rat.get(system, {}).get(0, {}).get("batches_per_s"),
                top.get("trainer_cpu_ms_per_batch"),
                top.get("total_cpu_ms_per_batch"),
                top.get("trainer_rss_mb"),
                top.get("total_rss_mb"),
                top.get("payload_copies"),
                int(top.get("trials") or 0),
            ]
        )
    rows += [
        [system, "n/a", None, None, None, None, None, None, 0]
        for system in report["unavailable"]
        if not system.startswith("transport-")
    ]
    return bs.format_table(
        [
            "system",
            "max b/s",
            "x base",
            "trainer CPU ms/b",
            "total CPU ms/b",
            "trainer RSS MB",
            "total RSS MB",
            "copies",
            "n",
        ],
        rows,
    )


def _stall_table(report: Mapping[str, Any]) -> str:
    steps = report["settings"]["step_ms"]
    rows = [
        [system]
        + [
            v
            for step in steps
            for v in (by_step.get(step, {}).get("stall_pct"), by_step.get(step, {}).get("batches_per_s"))
        ]
        for system, by_step in report["medians"].items()
    ]
    header = ["system"] + [h for step in steps for h in (f"stall% @{step}ms", f"b/s @{step}ms")]
    return bs.format_table(header, rows)


def _transport_table(report: Mapping[str, Any]) -> str:
    rows = []
    for system, by_step in report["transport_medians"].items():
        figs = by_step.get(0, {})
        gbps, memcpy = figs.get("gb_per_s"), figs.get("memcpy_gb_per_s")
        rows.append(
            [
                system,
                gbps,
                memcpy,
                None if not gbps or not memcpy else gbps / memcpy,
                figs.get("batches_per_s"),
                figs.get("trainer_cpu_ms_per_batch"),
                figs.get("total_cpu_ms_per_batch"),
            ]
        )
    rows += [
        [system, "n/a", None, None, None, None, None]
        for system in report["unavailable"]
        if system.startswith("transport-")
    ]
    return bs.format_table(
        ["path", "GB/s", "memcpy GB/s", "x memcpy", "batches/s", "consumer CPU ms/b", "total CPU ms/b"], rows
    )


def render(report: Mapping[str, Any]) -> str:
    """The text printed on stdout: settings, method notes, the three tables, goals, failures."""
    s = report["settings"]
    parts = [
        f"bench: {s['rounds']} round(s), medians; {s['batches']} measured batches per trial after "
        f"{s['warmup']} warm-up; step costs {s['step_ms']} ms",
        f"note: {report['device_model']}",
        f"note: copies: {report['copies_counted']}",
        f"best tuned tf.data (the baseline): {report['baseline'] or 'none finished'}",
        "",
        "max rate (zero-cost step), CPU per batch, peak RSS, copies:",
        _main_table(report),
    ]
    parts += [f"{system}: {reason}" for system, reason in report["unavailable"].items()]
    parts += ["", "with a calibrated step cost:", _stall_table(report)]
    if report["transport_medians"] or any(x.startswith("transport-") for x in report["unavailable"]):
        parts += ["", "transport (real producers -> Consumer library, released at once):", _transport_table(report)]
    if report.get("build_medians") or report.get("build_medians_f16"):
        rows = [
            [label] + [report[key].get(k) for k in _BUILD_METRICS]
            for label, key in (
                ("float32 wire", "build_medians"),
                ("float16 wire (-f16)", "build_medians_f16"),
                ("float32, pack read with preadv (-preadv)", "build_medians_preadv"),
                ("float32, .npy files (-npy)", "build_medians_npy"),
            )
            if report.get(key)
        ]
        parts += [
            "",
            "producer build (doctor stage 1: python -m melfeed.producer.probe --warm, one producer alone, medians):",
            bs.format_table(["mel format", "CPU ms/batch", "build ms p50", "read ms p50", "batches/s"], rows),
        ]
    if any(x.endswith("-f16") for x in report["transport_medians"]) or report.get("build_medians_f16"):
        parts += [F16_NOTE]
    if "feed_efficiency" in report:
        parts += [
            "",
            f"feed efficiency ({s['efficiency_batches']} measured batches per trial; the configured model, "
            "reference by default: fed steps/s / steps/s on resident batches of the same buckets):",
            render_efficiency(report["feed_efficiency"]),
        ]
    parts += ["", "goals (medians of this run):"] + [g["line"] for g in report["goals"]]
    if report["failed"]:
        parts += ["", "failed trials:"] + list(report["failed"])
    return "\n".join(parts)
