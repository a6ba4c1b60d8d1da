"""``python -m tests.replica_check OUT.json [MODE CONFIG ...]``: the replica and slot-poison checks in one interpreter.

Runs in a fresh interpreter because the CPU must be split into logical devices before TensorFlow
initialises its devices (``melfeed.consumer.placement.configure_memory``), which a pytest process that already
ran TensorFlow cannot do. It splits the CPU into 3: the replicas of the arithmetic and the loop's runs take the
first two (/CPU:0 and /CPU:1, as ``Replicas.from_config`` picks them), the fed path (tests/replica_feed_check.py)
the last two, so the host's /CPU:0 is neither of its replicas' devices. One TensorFlow start serves them all.

The arithmetic: builds the reference step twice with the same seed: once on one device (no
strategy) and once under ``melfeed.consumer.train.replicas.Replicas`` (MirroredStrategy over /CPU:0 and /CPU:1),
both through ``CompiledStep`` in graph mode, and runs the same batches through both. Then a checkpoint
of the replicated step (``CheckpointStore``) restored into it and the last batches run again must end
bit-identical to the uninterrupted run, with every replica's copy of every variable equal. Then a float16
wire (``transport.mel_dtype: float16``): the replicas split float16 slots (DLPack, no copy) and the reference
step casts inside each replica's program, bit-identical to float32 slots holding the same values. Last,
``jit_compile: true`` on these logical CPU replicas must fail with its one line.

The loop's runs (tests/integration/train/poison_runs.py): the built-in loop once per MODE CONFIG pair in turn,
on one replica or two as the CONFIG asks, each on its own state directory, fed by the producers the caller
started; its figures are named by the CONFIG's file name without ``.yaml``.
Writes the figures as JSON (``arithmetic``, ``feed``, ``runs``; each part as soon as it is done);
tests/integration/train/test_replicas.py asserts on them.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from melfeed.shared.config.loader import config_from_mapping

_ROWS, _FRAMES, _TOKENS, _MELS = 8, 48, 16, 80
_BATCHES = 4
_CUT = 2  # the checkpoint is taken after this many batches


def _batches() -> list[dict[str, np.ndarray]]:
    from melfeed.consumer.train.handoff import aligned_empty

    rng = np.random.default_rng(7)
    out = []
    for _ in range(_BATCHES):
        a = {
            "mel": aligned_empty((_ROWS, _FRAMES, _MELS), np.float32),
            "mel_len": aligned_empty((_ROWS,), np.int32),
            "tokens": aligned_empty((_ROWS, _TOKENS), np.int32),
            "tok_len": aligned_empty((_ROWS,), np.int32),
        }
        a["mel"][...] = rng.standard_normal(a["mel"].shape)
        # Unequal valid frames per replica half (a padding row in one half): a loss normalised by its own
        # rows' frames would differ from the whole batch's.
        a["mel_len"][...] = rng.integers(4, _FRAMES, _ROWS)
        a["mel_len"][:3] = [_FRAMES, 0, 5]
        a["tokens"][...] = rng.integers(1, 256, a["tokens"].shape)
        a["tok_len"][...] = rng.integers(2, _TOKENS, _ROWS)
        out.append(a)
    return out


def main(args: list[str]) -> int:
    from tests.integration.train.poison_runs import train_in_mode
    from tests.replica_feed_check import fed_path

    out_path, runs = args[0], list(zip(args[1::2], args[2::2], strict=True))
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]  # before any TensorFlow op: CPU:0..2
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
    result: dict[str, Any] = {}

    def record(part: str, figures: Any) -> None:  # after each part: a later failure keeps the earlier figures
        result[part] = figures
        Path(out_path).write_text(json.dumps(result), encoding="utf-8")

    record("arithmetic", _arithmetic())
    with _collective_keys_from(1000):
        record("feed", fed_path())
    with _collective_keys_from(2000):  # the runs' strategies build the same programs: they may share keys
        record("runs", {Path(config).stem: train_in_mode(config, mode) for mode, config in runs})
    return 0


@contextlib.contextmanager
def _collective_keys_from(base: int) -> Iterator[None]:
    """Strategies made inside start their collective keys at ``base``: a process ties a group key to one set of
    devices and an instance key to one shape, so the checks' strategies (other devices, other programs) must
    not reuse each other's keys (``_collective_key_base``: the hook TensorFlow's own tests use for that)."""
    import tensorflow as tf

    tf.distribute.MirroredStrategy._collective_key_base = base  # read when a strategy is made
    try:
        yield
    finally:
        tf.distribute.MirroredStrategy._collective_key_base = 0


def _arithmetic() -> dict[str, Any]:
    """One replica against two on the same global batches, a resumed checkpoint, float16 slots, XLA refused."""
    cfg = config_from_mapping(
        {
            "consumer": {"replicas": 2},
            "buckets": {"batch_size": _ROWS},
            "model": {"learning_rate": 0.01, "jit_compile": False},
        }
    )
    from melfeed.consumer.resume.checkpoint import CheckpointStore, Cursor
    from melfeed.consumer.train.handoff import to_tensors
    from melfeed.consumer.train.model import StepSpec, build_reference_step
    from melfeed.consumer.train.replicas import Replicas, replica_scope
    from melfeed.consumer.train.step import CompiledStep

    shapes = [{"mel": (_ROWS, _FRAMES, _MELS), "mel_len": (_ROWS,), "tokens": (_ROWS, _TOKENS), "tok_len": (_ROWS,)}]
    batches = _batches()

    def build(replicas: Replicas | None) -> tuple[Any, CompiledStep]:
        spec = StepSpec.from_config(cfg, shapes, None)
        with replica_scope(replicas):
            step = build_reference_step(spec)
        compiled = CompiledStep(step, shapes, jit_compile=False, replicas=replicas)
        compiled.warm_up()
        return step, compiled

    def run(compiled: CompiledStep, todo: list[dict[str, np.ndarray]]) -> list[float]:
        return [float(compiled.run(0, to_tensors(a)[0])["loss"]) for a in todo]

    result: dict[str, Any] = {}
    step_1, one = build(None)
    result["losses_1"] = run(one, batches)
    vars_1 = [v.numpy() for v in step_1.variables()]
    replicas = Replicas.from_config(cfg)
    step_2, two = build(replicas)
    result["devices"] = two.devices
    result["traces_2"] = two.traces
    result["losses_2"] = run(two, batches[:_CUT])
    items = step_2.checkpoint_items()
    with tempfile.TemporaryDirectory() as tmp:
        saved = CheckpointStore(Path(tmp), keep=1).save(Cursor(_CUT, _CUT, 0, "f", 1, 0.0), items)
        result["losses_2"] += run(two, batches[_CUT:])
        vars_2 = [v.numpy() for v in step_2.variables()]
        CheckpointStore.restore(saved, items)
        result["losses_resumed"] = run(two, batches[_CUT:])
    vars_resumed = [v.numpy() for v in step_2.variables()]
    result["max_abs_var_diff_1_vs_2"] = max(
        float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(vars_1, vars_2)
    )
    result["max_abs_var_1"] = max(float(np.max(np.abs(a))) for a in vars_1)
    result["resumed_bit_identical"] = all(np.array_equal(a, b) for a, b in zip(vars_2, vars_resumed))
    result["replica_copies_equal"] = all(
        all(np.array_equal(c.numpy(), v.values[0].numpy()) for c in v.values) for v in step_2.variables()
    )
    result["mirrored"] = sum(len(getattr(v, "values", ())) == 2 for v in step_2.variables())
    result["variables"] = len(vars_2)
    result["float16"] = _float16_replicas(shapes, replicas, batches[:2])
    result["jit_true_error"] = _xla_on_cpu_replicas(cfg, shapes, replicas)
    return result


def _float16_replicas(
    shapes: list[dict[str, tuple[int, ...]]], replicas: Any, batches: list[dict[str, np.ndarray]]
) -> dict[str, Any]:
    """Two replicas on float16 slots against two on float32 slots of the same (float16-rounded) values."""
    from melfeed.consumer.train.handoff import aligned_empty, to_tensors
    from melfeed.consumer.train.model import StepSpec, build_reference_step
    from melfeed.consumer.train.replicas import replica_scope
    from melfeed.consumer.train.step import CompiledStep

    out: dict[str, Any] = {}
    for mel_dtype in ("float32", "float16"):
        cfg = config_from_mapping(
            {
                "consumer": {"replicas": 2},
                "buckets": {"batch_size": _ROWS},
                "model": {"learning_rate": 0.01},
                "transport": {"mel_dtype": mel_dtype},
            }
        )
        with replica_scope(replicas):
            step = build_reference_step(StepSpec.from_config(cfg, shapes, None))
        compiled = CompiledStep(step, shapes, jit_compile=False, replicas=replicas, mel_dtype=mel_dtype)
        compiled.warm_up()
        losses, copies = [], 0
        for batch in batches:
            slot = dict(batch, mel=aligned_empty(batch["mel"].shape, mel_dtype))
            slot["mel"][...] = batch["mel"].astype(np.float16)
            tensors, n = to_tensors(slot)
            copies += n
            losses.append(float(compiled.run(0, tensors)["loss"]))
        out[mel_dtype] = (losses, [v.numpy().tobytes() for v in step.variables()], copies)
    (loss_32, vars_32, _), (loss_16, vars_16, copies_16) = out["float32"], out["float16"]
    return {"losses": loss_16, "bit_identical": loss_16 == loss_32 and vars_16 == vars_32, "copies": copies_16}


def _xla_on_cpu_replicas(cfg: Any, shapes: list[dict[str, tuple[int, ...]]], replicas: Any) -> str:
    """``jit_compile: true`` on logical CPU replicas: the one-line StepError (empty if none was raised)."""
    from melfeed.consumer.train.model import StepSpec
    from melfeed.consumer.train.replicas import replica_scope
    from melfeed.consumer.train.step import CompiledStep
    from melfeed.shared.errors import StepError
    from tests.steps import replica_tiny_step

    with replica_scope(replicas):
        step = replica_tiny_step(StepSpec.from_config(cfg, shapes, None))
    try:
        CompiledStep(step, shapes, jit_compile=True, factory="tiny", replicas=replicas).warm_up()
    except StepError as err:
        return str(err)
    return ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
