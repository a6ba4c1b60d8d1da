"""The text ``melfeed doctor`` prints: one block per stage, the checks, the verdict.

Role: formatting only (pure: a report dict, the ``Verdict`` and the ``Check`` lines in, a string
out). The report dict is the one ``--json`` writes, so the text and the file always agree. Every key
the probes write is required: a stage without one is a ``PipelineError`` naming the stage and key.
Shutdown: nothing to release.
"""

from __future__ import annotations

from typing import Any

from melfeed.consumer.doctor.env import Check
from melfeed.consumer.doctor.verdict import HEADROOM, Verdict, weighted_ms
from melfeed.shared.errors import PipelineError
from melfeed.shared.wire.bucket_mix import format_grid
from melfeed.shared.wire.layout import PAYLOAD_COPIES

__all__ = ["render"]


def _shape(wire: list[int]) -> str:
    _, rows, frames, tokens, _ = wire
    return f"[{rows} x {frames} frames, {tokens} tokens]"


def _probed(stage: dict[str, Any], name: str, key: str) -> Any:
    """``stage[key]``, which the stage's probe always writes; without it the probe and this doctor differ."""
    if key not in stage:
        raise PipelineError(
            f"the {name} probe's result has no {key!r} (the probe always writes it: a bug in melfeed doctor)"
        )
    return stage[key]


def _stage_lines(r: dict[str, Any], v: Verdict) -> list[str]:
    s = r["stages"]
    one, many = s["build_1"][0], s["build_n"]
    n = r["producers"]
    t1, tn = s["transport_1"], s["transport_n"]
    dev = s["device"]
    mix = tuple(r["mix"])
    h2d = weighted_ms(tuple(b["h2d_ms_p50"] for b in dev["buckets"]), mix)
    step = weighted_ms(tuple(b["step_ms_p50"] for b in dev["buckets"]), mix)
    lines = [
        "stage 1  cache read + batch assembly (melfeed.producer.probe, real BatchAssembler; reads "
        f"{_reader_words(_probed(one, 'build_1', 'reader'), _probed(one, 'build_1', 'pack_read'))})",
        f"         1 process: {one['build_ms_p50']:.2f} ms/batch p50 (read {one['read_ms_p50']:.2f} ms, "
        f"p99 {one['build_ms_p99']:.2f} ms, CPU {one['cpu_ms_per_batch']:.2f} ms) "
        f"= {one['batches_per_s']:.1f} batches/s",
        f"         {n} processes at once: {sum(p['batches_per_s'] for p in many):.1f} batches/s "
        f"({', '.join(format(p['batches_per_s'], '.1f') for p in many)})"
        if n > 1
        else "         (1 producer: not repeated)",
        "stage 2  transport producer -> consumer (real Consumer ring on a private ipc socket, batches released "
        f"at once, no step; data path: {_path_words(_probed(t1, 'transport_1', 'path'))})",
        f"         1 producer: {t1['batches_per_s']:.1f} batches/s delivered"
        + (f"; {n} producers: {tn['batches_per_s']:.1f}" if n > 1 else ""),
        f"         transport cost per batch ~ {v.transport_ms:.2f} ms = 1000 / {t1['batches_per_s']:.1f} delivered "
        f"- {one['build_ms_p50']:.2f} build, floored at 0 (one producer builds and sends in series; "
        "0 = hidden behind the build, ZeroMQ's I/O thread sends while the next batch is built)",
        f"stage 3  host -> device hand-off (to_tensors + tf.identity on {dev['device']})",
    ]
    for b, wire in zip(dev["buckets"], r["buckets"]):
        lines.append(f"         bucket {b['index']} {_shape(wire)}: {b['h2d_ms_p50']:.2f} ms")
    lines.append(f"         weighted by the bucket mix: {h2d:.2f} ms = {v.h2d_per_s:.1f} batches/s")
    ran_on = ", ".join(_probed(dev, "device", "step_devices"))
    lines.append(
        f"stage 4  compiled step (CompiledStep, {dev['compile_s']:.1f} s to compile every bucket; ran on {ran_on})"
    )
    for b, wire, w in zip(dev["buckets"], r["buckets"], mix):
        lines.append(
            f"         bucket {b['index']} {_shape(wire)}: {b['step_ms_p50']:.2f} ms p50, "
            f"{b['step_ms_p99']:.2f} ms p99 ({b['runs']} runs), {100 * w:.0f} % of batches"
        )
    lines.append(f"         weighted: {step:.2f} ms per step = demand {v.demand_per_s:.1f} batches/s")
    return lines


def render(r: dict[str, Any], v: Verdict, checks: list[Check]) -> str:
    """The full report as printed on stdout."""
    lines = [
        f"melfeed doctor: {r['cache_dir']} ({r['utterances']} utterances, {len(r['buckets'])} buckets), "
        f"{r['producers']} producer(s), {r['cores']} cores"
    ]
    lines += _stage_lines(r, v)
    lines.append(
        f"padding  frames {r['config_facts']['padding']:.3f}, tokens {r['config_facts']['token_padding']:.3f}"
        f" over the epoch; {r['outliers']} outlier(s) left out (buckets.*_frames_per_token); the grid:"
    )
    lines += ["  " + line for line in format_grid(r["grid"])]
    f = r["config_facts"]
    lines.append(
        f"memory   in-flight bound (ring slots + producers x lease window {f['lease_window']}) x largest batch "
        f"{f['largest_batch_bytes'] / 1e6:.1f} MB: now ({f['ring_slots']} + {f['producer_count']} x "
        f"{f['lease_window']}) = {r['memory_bound_now_bytes'] / 1e6:.0f} MB; with the changes below "
        f"{v.memory_bound_bytes / 1e6:.0f} MB"
    )
    lines.append("environment")
    lines += [f"  {c.line()}" for c in checks]
    verb = ">=" if v.supply_per_s >= HEADROOM * v.demand_per_s else "<"
    lines.append(
        f"verdict: supply {v.supply_per_s:.1f} batches/s {verb} {HEADROOM:g} x demand "
        f"{v.demand_per_s:.1f} = {HEADROOM * v.demand_per_s:.1f}; bound by {v.bound}"
    )
    lines.append(
        f"producers: {v.producers_needed} needed for {HEADROOM:g} x demand at {v.per_producer_per_s:.1f} "
        f"batches/s each (min of one probe's build rate and the 1-producer delivered rate); "
        f"{r['cores']} cores"
    )
    lines += [f"change:  {c.line()}" for c in v.changes] or ["change:  none"]
    lines += [f"note:    {n}" for n in v.notes]
    lines.append(f"exit {v.exit_code}" + (" (the data side is the bottleneck)" if v.exit_code else ""))
    return "\n".join(lines)


def _path_words(path: str) -> str:
    """How the probe's batches travelled: ``shm`` or ``zmq`` (``consumer/doctor/probe.py``)."""
    return {"shm": "shared-memory slots, 1 copy", "zmq": f"ZeroMQ payload frames, {PAYLOAD_COPIES} copies"}[path]


def _reader_words(reader: str, pack_read: str | None) -> str:
    """What stage 1 read: the packed cache (its path, and ``pack_read``: mapped or preadv) or, for ``files``,
    the .npy files (``producer/probe.py``)."""
    if reader == "files":
        return "the .npy files; `melfeed pack --cache-dir CACHE_DIR` makes a faster packed copy"
    return f"the packed cache {reader}, {pack_read}"
