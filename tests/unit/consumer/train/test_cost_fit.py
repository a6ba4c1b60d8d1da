"""``buckets.cost: measured``'s arithmetic (consumer/train/cost_fit.py): the probes span the lengths and hold
utterances that fit them, and the fit gives back the weights that made the times."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from melfeed.consumer.train.cost_fit import fit_weights, probe_rows, probe_shapes


def _lengths(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    frames = rng.integers(90, 870, n)
    tokens = np.maximum(1, (frames / rng.uniform(4.5, 6.5, n)).astype(np.int64))
    return frames, tokens


def _times(
    probes: list[tuple[int, int, int]], token_cost: float, attention_cost: float, fixed_s: float = 0.004
) -> list[tuple[int, int, int, float]]:
    k = 2e-7  # seconds per frame of row cost
    return [(T, L, r, fixed_s + k * r * (T + token_cost * L + attention_cost * T * L)) for T, L, r in probes]


def test_probes_span_the_lengths_and_each_holds_utterances_that_fit_it() -> None:
    frames, tokens = _lengths()
    probes = probe_shapes(frames, tokens, 8)
    assert probes is not None and len(probes) == 5
    assert max(p.frames for p in probes) == -(-int(frames.max()) // 8) * 8
    assert max(p.tokens for p in probes) == int(tokens.max())
    assert len({p.frames for p in probes}) >= 2 and len({p.tokens for p in probes}) >= 2
    for p in probes:
        assert p.frames % 8 == 0 and p.samples
        assert all(frames[i] <= p.frames and tokens[i] <= p.tokens for i in p.samples)
        assert [frames[i] for i in p.samples] == sorted((frames[i] for i in p.samples), reverse=True)


def test_left_out_utterances_never_feed_a_probe_and_one_cell_of_lengths_measures_nothing() -> None:
    frames, tokens = _lengths()
    frames[:50] = -1
    probes = probe_shapes(frames, tokens, 8)
    assert probes is not None and all(min(p.samples) >= 50 for p in probes)
    same = np.full(30, 400)
    assert probe_shapes(same, np.full(30, 70), 8) is None


def test_probe_rows_follow_the_row_setting_and_the_replicas() -> None:
    assert probe_rows(400, 12, None, 256, 1) == 12
    assert probe_rows(400, None, 8000, 256, 1) == 20
    assert probe_rows(400, "auto", None, 256, 1) == 32 and probe_rows(400, "auto", None, 16, 1) == 16
    assert probe_rows(400, 7, None, 256, 2) == 6 and probe_rows(4000, None, 1000, 256, 2) == 2


@settings(max_examples=60, deadline=None)
@given(
    token_cost=st.integers(0, 3000).map(lambda v: v / 1000),
    attention_cost=st.integers(0, 20).map(lambda v: v / 1000),
)
def test_the_fit_gives_back_the_weights_that_made_the_times(token_cost: float, attention_cost: float) -> None:
    frames, tokens = _lengths()
    probes = probe_shapes(frames, tokens, 8)
    assert probes is not None
    fit = fit_weights(_times([(p.frames, p.tokens, 8) for p in probes], token_cost, attention_cost))
    assert fit.token_cost == pytest.approx(token_cost, abs=0.0011)
    assert fit.attention_cost == pytest.approx(attention_cost, abs=0.0011)
    assert fit.worst_error < 1e-6


def test_a_step_whose_time_shrinks_with_tokens_gets_no_negative_weight() -> None:
    shapes = [(496, 89, 8), (872, 89, 8), (496, 190, 8), (872, 190, 8), (688, 139, 8)]
    timed = [(T, L, r, 0.01 + 1e-6 * r * T - 1e-7 * r * L) for T, L, r in shapes]
    fit = fit_weights(timed)
    assert fit.token_cost == 0 and fit.attention_cost == 0


def test_tokens_alone_cost_give_the_largest_token_weight_and_a_flat_step_gives_none() -> None:
    shapes = [(496, 89, 8), (872, 89, 8), (496, 190, 8), (872, 190, 8), (688, 139, 8)]
    tokens_only = fit_weights([(T, L, r, 0.002 + 1e-5 * r * L) for T, L, r in shapes])
    assert tokens_only.token_cost == 1000 and tokens_only.attention_cost == 0
    flat = fit_weights([(T, L, r, 0.05) for T, L, r in shapes])
    assert flat.token_cost is None and flat.attention_cost is None
