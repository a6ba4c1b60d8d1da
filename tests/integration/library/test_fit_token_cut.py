"""Keras ``fit`` trains a Tacotron-kind model (tests/tts_models.py: a BiLSTM encoder masked to the batch's longest
row, r = 3 frames per decoder step, a guided-attention loss on the ``attn`` matrix extra) on
``as_dataset(token_axis="longest")`` with ``FitResume``, in graph mode, with no cut of its own, and ``melfeed audit``
finds every batch applied once. Without the cut the same model fails (tests/unit/consumer/train/test_step_axes.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import melfeed
from tests import procs
from tests.attention_data import attention_cache
from tests.tts_models import FIT_FEATURES, TacotronFit

_STEPS = 6


@pytest.mark.timeout(300)
def test_keras_fit_trains_a_tacotron_kind_model_on_the_longest_token_cut_and_audits_exact(
    demo_cache: Path, endpoint: str, tmp_path: Path
) -> None:
    import keras

    from melfeed.consumer.train.model import StepSpec

    cfg = melfeed.config_from_mapping(
        {
            "cache_dir": str(attention_cache(demo_cache, tmp_path)),
            "buckets": {"num_buckets": 2, "batch_size": 8, "frame_multiple": 3, "max_frames": 300, "partial": "drop"},
            "consumer": {"steps": _STEPS, "state_dir": str(tmp_path / "state"), "checkpoint_every_steps": 3},
            "transport": {"endpoint": endpoint},
        }
    )
    seen: list[dict[str, float]] = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda _, logs: seen.append({k: float(v) for k, v in logs.items()})
    )
    with melfeed.FitResume(cfg) as resume, melfeed.Consumer(cfg, start_batch=resume.next_batch, producers=1) as feed:
        dataset = feed.as_dataset(features=FIT_FEATURES, token_axis="longest")
        spec = dataset.element_spec[0]
        assert (spec["tokens"].shape.as_list(), spec["attn"].shape.as_list()) == ([None, None], [None, None, None])
        model = TacotronFit(StepSpec(cfg.n_mels, cfg.model.vocab_size, 0.01, False, 0))
        model.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=False)  # graph mode: the cut's width varies
        model.fit(
            dataset,
            epochs=1,
            steps_per_epoch=_STEPS,
            verbose=0,
            shuffle=False,
            callbacks=[resume.callback(model, feed, dataset), record],
        )
        assert feed.applied_ids == list(range(_STEPS))
    assert len(seen) == _STEPS and all(sorted(b) == ["guided_attn", "loss", "mel_l1"] for b in seen)
    assert all(np.isfinite(b["loss"]) and b["guided_attn"] > 0 for b in seen), seen
    rc, audit, text = procs.run_audit(tmp_path / "state", tmp_path)
    assert rc == 0 and audit["ok"] and audit["applied"] == _STEPS and audit["checkpoint_next_batch"] == _STEPS, text
