"""The rules every rank applies to the gathered rows: the same settings on every rank, a refusal seen by all, and
the newest checkpoint step that all ranks committed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from melfeed.consumer.job.agree import (
    NO_STEP,
    OFFER_WIDTH,
    REFUSED,
    SETTINGS,
    common_rows,
    common_step,
    job_settings,
    offer_row,
    refused_ranks,
    settings_mismatch,
    settings_row,
)
from melfeed.shared.config.loader import config_from_mapping


def test_offer_rows_are_fixed_width_newest_first_and_padded() -> None:
    assert offer_row([20, 40]) == [40, 20] + [NO_STEP] * (OFFER_WIDTH - 2)
    assert offer_row([]) == [NO_STEP] * OFFER_WIDTH
    assert offer_row(range(100)) == list(range(99, 99 - OFFER_WIDTH, -1))  # only the newest take part
    with pytest.raises(ValueError):
        offer_row([-3])


def test_the_newest_step_every_rank_committed_wins_not_the_newest_of_any_rank() -> None:
    # rank 1 committed 60 before the crash, rank 0 did not: both still hold 40 (keep_checkpoints >= 2)
    assert common_step([offer_row([20, 40]), offer_row([40, 60])]) == 40
    assert common_step([offer_row([40, 60]), offer_row([40, 60])]) == 60
    assert common_step([offer_row([]), offer_row([])]) is None  # a new job starts at 0


def test_no_common_step_is_an_error_naming_each_ranks_newest_step() -> None:
    with pytest.raises(
        LookupError,
        match=r"no checkpoint step is committed by every rank \(newest per rank: "
        r"rank 0: 20, rank 1: none\)",
    ):
        common_step([offer_row([20]), offer_row([])])
    with pytest.raises(LookupError, match="rank 0: 20, rank 1: 60"):
        common_step([offer_row([20]), offer_row([40, 60])])  # keep 1: the common one was pruned


@given(st.lists(st.sets(st.integers(0, 10_000), max_size=OFFER_WIDTH), min_size=1, max_size=8))
def test_the_answer_is_the_same_whichever_rank_computes_it_and_every_rank_holds_it(offers: list[set[int]]) -> None:
    rows = [offer_row(sorted(o)) for o in offers]
    try:
        step = common_step(rows)
    except LookupError:
        assert any(offers) and not set.intersection(*offers)
        return
    assert common_step(list(reversed(rows))) == step  # symmetric: order of ranks does not matter
    if step is None:
        assert not any(offers)
    else:
        assert all(step in o for o in offers) and step == max(set.intersection(*offers))


# ---- the settings every rank must share, compared before any state directory is opened --------------------------


def _settings(fingerprint: str = "bb48", **sections: object) -> dict[str, object]:
    return job_settings(config_from_mapping({"cache_dir": "/data/cache", **sections}), fingerprint)


def test_ranks_that_differ_in_plan_or_step_count_are_named_with_the_key_and_this_ranks_value() -> None:
    base = _settings()
    assert settings_mismatch([settings_row(base)] * 3, base) is None
    seed7 = _settings(seed=7)
    line = settings_mismatch([settings_row(base), settings_row(seed7)], seed7)
    assert line is not None and "\n" not in line
    assert line.startswith("the ranks of this job differ in seed (rank 1 differs from rank 0; here: 7): every rank")
    short = _settings(consumer={"steps": 20, "feed_efficiency_steps": 3})
    line = settings_mismatch([settings_row(base), settings_row(base), settings_row(short)], base)
    assert (
        line is not None
        and (
            "consumer.steps (rank 2 differs from rank 0; here: 300); consumer.feed_efficiency_steps"
            " (rank 2 differs from rank 0; here: 10)"
        )
        in line
    )
    for other in (
        _settings("0123"),
        _settings(buckets={"batch_size": 16}),
        _settings(model={"learning_rate": 0.01}),
        _settings(n_mels=64),
        _settings(consumer={"checkpoint_every_steps": 50}),
    ):
        assert settings_mismatch([settings_row(base), settings_row(other)], other) is not None


def test_what_may_differ_between_hosts_does_not_stop_the_job() -> None:
    base = _settings()
    local = job_settings(
        config_from_mapping(
            {
                "cache_dir": "/mnt/other/copy",
                "transport": {"endpoint": "tcp://10.0.0.11:5555", "insecure": True},
                "producer": {"count": 7},
                "consumer": {"state_dir": "/var/lib/x", "model_gpu": "1", "keep_checkpoints": 3, "metrics_port": 9100},
            }
        ),
        "bb48",
    )  # the same cache copied elsewhere
    assert settings_mismatch([settings_row(base), settings_row(local)], local) is None


def test_a_rank_that_cannot_start_offers_a_refusal_the_others_see() -> None:
    assert offer_row(None) == [REFUSED] * OFFER_WIDTH and settings_row(None) == [REFUSED] * len(SETTINGS)
    assert refused_ranks([settings_row(_settings()), settings_row(None), offer_row(None)]) == [1, 2]
    assert refused_ranks([offer_row([40]), offer_row([])]) == []


def test_the_job_takes_each_buckets_fewest_rows_any_rank_offers() -> None:
    gathered = [[32, 16, 8], [24, 16, 12], [32, 8, 12]]
    assert common_rows(gathered, 3) == [24, 8, 8]
    assert common_rows(list(reversed(gathered)), 3) == [24, 8, 8]  # whichever rank asks
