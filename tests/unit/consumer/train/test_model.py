"""Reference step: learns on demo-like data, ignores padding, is seeded, checkpoints, runs mixed."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import numpy.typing as npt
import pytest
import tensorflow as tf

from melfeed.consumer.train.model import StepSpec, build_reference_step

pytestmark = pytest.mark.tf

N_MELS = 80
VOCAB = 64


def demo_templates(rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """[VOCAB, N_MELS] smooth log-mel-like templates in about -10..1.5 (row 0 unused)."""
    axis = np.arange(N_MELS)[None, :] / N_MELS
    out = np.full((VOCAB, N_MELS), -10.0)
    for _ in range(3):
        centre, width = rng.uniform(0, 1, (VOCAB, 1)), rng.uniform(0.05, 0.2, (VOCAB, 1))
        out += rng.uniform(2, 8, (VOCAB, 1)) * np.exp(-0.5 * ((axis - centre) / width) ** 2)
    templates: npt.NDArray[np.float32] = np.clip(out, -11.5, 1.5).astype(np.float32)
    return templates


def demo_batch(
    rng: np.random.Generator, templates: npt.NDArray[np.float32], rows: int, frames: int, tokens: int
) -> dict[str, np.ndarray]:
    """Demo-like batch: ~4.5 frames per token, frame t shows token floor(t * L / T) + noise."""
    mel = np.zeros((rows, frames, N_MELS), np.float32)
    tok = np.zeros((rows, tokens), np.int32)
    mel_len, tok_len = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for b in range(rows):
        n_tok = int(rng.integers(max(2, tokens // 2), tokens + 1))
        n_frames = min(frames, int(round(n_tok * rng.uniform(4.0, 5.0))))
        ids = rng.integers(1, VOCAB, n_tok)
        which = ids[(np.arange(n_frames) * n_tok) // n_frames]
        mel[b, :n_frames] = templates[which] + 0.3 * rng.standard_normal((n_frames, N_MELS))
        tok[b, :n_tok], mel_len[b], tok_len[b] = ids, n_frames, n_tok
    return {"mel": mel, "mel_len": mel_len, "tokens": tok, "tok_len": tok_len}


def _spec(seed: int = 0, mixed: bool = False) -> StepSpec:
    return StepSpec(n_mels=N_MELS, vocab_size=VOCAB, learning_rate=1e-3, mixed_precision=mixed, seed=seed)


def _call(step: object, batch: dict[str, np.ndarray]) -> float:
    args = [tf.constant(batch[k]) for k in ("mel", "mel_len", "tokens", "tok_len")]
    return float(step(*args))  # type: ignore[operator]


def _values(step: object) -> list[np.ndarray]:
    return [v.numpy() for v in step.variables()]  # type: ignore[attr-defined]


def test_loss_falls_on_demo_like_data_within_150_steps() -> None:
    rng = np.random.default_rng(7)
    templates = demo_templates(rng)
    step = build_reference_step(_spec())
    program = tf.function(step.__call__, jit_compile=False)  # graph mode: learning, not XLA, is the subject
    losses = [_call(program, demo_batch(rng, templates, 16, 128, 28)) for _ in range(150)]
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert np.all(np.isfinite(losses))
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}"


def test_padding_rows_and_frames_change_neither_loss_nor_update() -> None:
    rng = np.random.default_rng(1)
    batch = demo_batch(rng, demo_templates(rng), 4, 64, 14)
    padded = {  # 3 padding rows (all zero, lengths 0) and 16 more padding frames
        "mel": np.pad(batch["mel"], ((0, 3), (0, 16), (0, 0))),
        "mel_len": np.pad(batch["mel_len"], (0, 3)),
        "tokens": np.pad(batch["tokens"], ((0, 3), (0, 0))),
        "tok_len": np.pad(batch["tok_len"], (0, 3)),
    }
    padded["mel"][4:] = 5.0  # garbage under mel_len 0 must not count either
    plain_step, padded_step = build_reference_step(_spec()), build_reference_step(_spec())
    plain_loss, padded_loss = _call(plain_step, batch), _call(padded_step, padded)
    assert plain_loss > 0.5
    np.testing.assert_allclose(padded_loss, plain_loss, rtol=1e-6)
    for a, b in zip(_values(plain_step), _values(padded_step)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_all_padding_batch_gives_zero_loss_and_finite_state() -> None:
    step = build_reference_step(_spec())
    zeros = {
        "mel": np.zeros((2, 8, N_MELS), np.float32),
        "mel_len": np.zeros(2, np.int32),
        "tokens": np.zeros((2, 4), np.int32),
        "tok_len": np.zeros(2, np.int32),
    }
    assert _call(step, zeros) == 0.0
    assert all(np.all(np.isfinite(v)) for v in _values(step))


def test_weights_depend_only_on_seed() -> None:
    a, b, c = (build_reference_step(_spec(seed)) for seed in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(_values(a), _values(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(_values(a), _values(c)))


def test_variables_cover_model_and_optimizer_state() -> None:
    step = build_reference_step(_spec())
    variables = step.variables()
    assert all(isinstance(v, tf.Variable) for v in variables)
    names = " ".join(v.name for v in variables)
    assert "iteration" in names and "embeddings" in names
    model = step.checkpoint_items()["model"]
    n_model = len(model.trainable_variables)  # type: ignore[attr-defined]  # a keras.Model, typed object here
    assert len(variables) >= 3 * n_model  # weights + Adam m and v for each


def test_checkpoint_items_restore_model_and_optimizer(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    batch = demo_batch(rng, demo_templates(rng), 2, 32, 8)
    trained, fresh = build_reference_step(_spec()), build_reference_step(_spec(seed=9))
    _call(trained, batch)
    path = tf.train.Checkpoint(**trained.checkpoint_items()).write(str(tmp_path / "ckpt"))
    tf.train.Checkpoint(**fresh.checkpoint_items()).read(path).assert_consumed()
    assert all(np.array_equal(x, y) for x, y in zip(_values(trained), _values(fresh)))


def test_mixed_precision_builds_and_runs_a_compiled_step() -> None:
    rng = np.random.default_rng(3)
    step = build_reference_step(_spec(mixed=True))
    optimizer = step.checkpoint_items()["optimizer"]
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    model = step.checkpoint_items()["model"]
    assert model.embed.compute_dtype in ("float16", "bfloat16")  # type: ignore[attr-defined]
    before = _values(step)
    loss = tf.function(step.__call__, jit_compile=True)(
        *[tf.constant(v) for v in demo_batch(rng, demo_templates(rng), 4, 48, 10).values()]
    )
    assert loss.dtype == tf.float32 and np.isfinite(float(loss)) and float(loss) > 0
    assert any(not np.array_equal(x, y) for x, y in zip(before, _values(step)))


def test_step_spec_rejects_impossible_sizes() -> None:
    with pytest.raises(ValueError):
        StepSpec(n_mels=0, vocab_size=VOCAB, learning_rate=1e-3, mixed_precision=False, seed=0)


def test_optimizer_variables_cover_keras3_and_tf_keras_with_a_schedule() -> None:
    from melfeed.consumer.train.model import optimizer_variables

    tf_keras = pytest.importorskip("tf_keras")  # the test extra installs it; importing it leaves tf.keras alone
    for ks in (keras, tf_keras):
        layer = ks.layers.Dense(2)
        layer.build((None, 3))
        opt = ks.optimizers.Adam(ks.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5))
        opt.build(layer.trainable_variables)
        found = optimizer_variables(opt)
        assert all(isinstance(v, tf.Variable) for v in found) and len({id(v) for v in found}) == len(found)
        names = [v.name.split(":")[0].rsplit("/", 1)[-1] for v in found]
        assert names.count("iteration") + names.count("iterations") == 1, names
        assert len(found) >= 5, names  # iterations + m and v of the kernel and the bias
        if ks is tf_keras:  # assigned on every step, outside optimizer.variables()
            assert "current_learning_rate" in names and len(opt.variables()) == len(found) - 1, names
