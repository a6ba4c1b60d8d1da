"""The loop's fed path with two replicas, on their own devices (``fed_path``, run by tests/replica_check.py).

The CPU must be split into 3 logical devices before TensorFlow initialises its devices (tests/replica_check.py
does it), and the replicas run on /CPU:1 and /CPU:2, so the host's /CPU:0 (where a reduce without a
destination lands) is neither replica's device. Builds the reference step under ``Replicas`` twice with
the same seed; one is fed through the hand-off (``TfStageAdapter.put`` -> ``PackedSteps.stage``: each replica's
rows of each array from the slot, on its device), the other through ``CompiledStep.run`` on the full
batch (split inside the program); a third is fed through the hand-off copying ahead (its pieces placed on
the copy thread, consumer/train/copy_thread.py). Records where each staged piece lies, whether it aliases the slot,
where the program sums the outputs, and the variables of each after the same batches.
Returns the figures; tests/integration/train/test_replicas.py asserts on them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_ROWS, _FRAMES, _TOKENS, _MELS = 8, 48, 16, 80
_BATCHES = 3
_DEVICES = ["/job:localhost/replica:0/task:0/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:2"]


def _fill(views: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    views["mel"][...] = rng.standard_normal(views["mel"].shape)
    views["mel_len"][...] = rng.integers(4, _FRAMES, _ROWS)
    views["mel_len"][:2] = [_FRAMES, 0]
    views["tokens"][...] = rng.integers(1, 256, views["tokens"].shape)
    views["tok_len"][...] = rng.integers(2, _TOKENS, _ROWS)


def fed_path() -> dict[str, Any]:
    """The figures of the fed path against the full-batch path (logical /CPU:1 and /CPU:2 must exist)."""
    import tensorflow as tf

    from melfeed.consumer.flow.plan import PlannedBatch
    from melfeed.consumer.handout import Batch
    from melfeed.consumer.train.device.packed import PackedSteps
    from melfeed.consumer.train.handoff import TfStageAdapter, to_tensors
    from melfeed.consumer.train.model import StepSpec, build_reference_step
    from melfeed.consumer.train.replicas import Replicas, replica_scope
    from melfeed.consumer.train.step import CompiledStep
    from melfeed.shared.config.loader import config_from_mapping
    from melfeed.shared.wire.buckets import Bucket
    from melfeed.shared.wire.layout import aligned_buffer, batch_layout, layout_nbytes, layout_views

    cfg = config_from_mapping(
        {
            "consumer": {"replicas": 2},
            "buckets": {"batch_size": _ROWS},
            "model": {"learning_rate": 0.01, "jit_compile": False},
        }
    )
    bucket = Bucket(0, _ROWS, _FRAMES, _TOKENS, _MELS)
    shapes = [bucket.shapes()]
    replicas = Replicas(_DEVICES)

    def build() -> tuple[Any, CompiledStep]:
        tf.keras.utils.set_random_seed(3)
        with replica_scope(replicas):
            step = build_reference_step(StepSpec.from_config(cfg, shapes, None))
        compiled = CompiledStep(step, shapes, jit_compile=False, replicas=replicas)
        compiled.warm_up()
        return step, compiled

    slot = aligned_buffer(layout_nbytes(bucket) + 4096)
    views = layout_views(slot, 0, batch_layout(bucket))
    rng = np.random.default_rng(11)
    batches = []
    for _ in range(_BATCHES):
        _fill(views, rng)
        batches.append({k: v.copy() for k, v in views.items()})

    fed_step, fed = build()
    packed = PackedSteps.for_buckets(fed, [bucket], None)
    packed.warm_up(fed_step.variables())
    handoff = TfStageAdapter(packed, None, slot_buffer=lambda _: slot)
    result: dict[str, Any] = {"piece_devices": [], "aliases_slot": [], "host_copies": 0}
    for batch_id, arrays in enumerate(batches):
        for name, view in views.items():
            view[...] = arrays[name]
        batch = Batch(PlannedBatch(batch_id, 0, 0, tuple(range(_ROWS))), views, slot=0)
        staged = handoff.put(batch)
        result["host_copies"] += staged.host_copies
        if batch_id == 0:
            result["piece_devices"] = [
                [p.device for p in replicas.strategy.experimental_local_results(v)] for v in staged.value
            ]  # one PerReplica per array
            result["aliases_slot"] = _aliases(staged.value, packed, replicas, slot)
        handoff.step(batch, staged.value)
    read = handoff.read()
    result["transfers"] = handoff.transfers
    result["accumulator_device"] = packed.accumulators.variables[0].device
    graph = packed.program(0).graph
    result["reduce_devices"] = sorted({op.device for op in graph.get_operations() if op.type in ("AddN", "Add")})
    result["explicit_devices"] = sorted({op.device for op in graph.get_operations() if op.device})
    result["fed_losses_sum"] = read.sums["loss"]
    fed_vars = [v.numpy() for v in fed_step.variables()]

    ahead_step, ahead = build()  # the copy thread places the pieces; the program and the arithmetic are the same
    ahead_packed = PackedSteps.for_buckets(ahead, [bucket], None)
    ahead_packed.warm_up(ahead_step.variables())
    ahead_handoff = TfStageAdapter(ahead_packed, None, slot_buffer=lambda _: slot, copy_ahead=True)
    try:
        for batch_id, arrays in enumerate(batches):
            for name, view in views.items():
                view[...] = arrays[name]
            batch = Batch(PlannedBatch(batch_id, 0, 0, tuple(range(_ROWS))), views, slot=0)
            ahead_handoff.step(batch, ahead_handoff.put(batch).value)
    finally:
        ahead_handoff.close()
    ahead_vars = [v.numpy() for v in ahead_step.variables()]

    ref_step, ref = build()
    ref_losses = [float(ref.run(0, to_tensors(a)[0])["loss"]) for a in batches]
    ref_vars = [v.numpy() for v in ref_step.variables()]
    result["ref_losses_sum"] = sum(ref_losses)
    result["variables"] = len(ref_vars)
    result["bit_identical"] = all(np.array_equal(a, b) for a, b in zip(fed_vars, ref_vars, strict=True))
    result["copy_ahead_bit_identical"] = all(np.array_equal(a, b) for a, b in zip(ahead_vars, ref_vars, strict=True))
    return result


def _aliases(value: Any, packed: Any, replicas: Any, slot: np.ndarray) -> list[list[bool]]:
    """Per array, per replica: whether the staged piece sees a write to its first byte in the slot (no copy)."""
    names = ("mel", "mel_len", "tokens", "tok_len")
    pieces = packed.layouts[0].pieces(names, replicas.count)
    out = []
    for j, per_replica in enumerate(value):
        seen = []
        for i, part in enumerate(replicas.strategy.experimental_local_results(per_replica)):
            offset = pieces[i][j][0]
            before = slot[offset]
            slot[offset] = before ^ 0xFF
            seen.append(int(part[0]) == int(slot[offset]))
            slot[offset] = before
        out.append(seen)
    return out
