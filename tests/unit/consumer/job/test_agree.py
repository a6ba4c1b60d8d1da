"""The rule every rank applies to the gathered offers: the newest checkpoint step that all ranks committed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumer.job.agree import NO_STEP, OFFER_WIDTH, common_step, offer_row


def test_offer_rows_are_fixed_width_newest_first_and_padded() -> None:
    assert offer_row([20, 40]) == [40, 20] + [NO_STEP] * (OFFER_WIDTH - 2)
    assert offer_row([]) == [NO_STEP] * OFFER_WIDTH
    assert offer_row(range(100)) == list(range(99, 99 - OFFER_WIDTH, -1))    # only the newest take part
    with pytest.raises(ValueError):
        offer_row([-3])


def test_the_newest_step_every_rank_committed_wins_not_the_newest_of_any_rank() -> None:
    # rank 1 committed 60 before the crash, rank 0 did not: both still hold 40 (keep_checkpoints >= 2)
    assert common_step([offer_row([20, 40]), offer_row([40, 60])]) == 40
    assert common_step([offer_row([40, 60]), offer_row([40, 60])]) == 60
    assert common_step([offer_row([]), offer_row([])]) is None                    # a new job starts at 0


def test_no_common_step_is_an_error_naming_each_ranks_newest_step() -> None:
    with pytest.raises(LookupError, match=r"no checkpoint step is committed by every rank \(newest per rank: "
                                          r"rank 0: 20, rank 1: none\)"):
        common_step([offer_row([20]), offer_row([])])
    with pytest.raises(LookupError, match="rank 0: 20, rank 1: 60"):
        common_step([offer_row([20]), offer_row([40, 60])])     # keep 1: the common one was pruned


@given(st.lists(st.sets(st.integers(0, 10_000), max_size=OFFER_WIDTH), min_size=1, max_size=8))
def test_the_answer_is_the_same_whichever_rank_computes_it_and_every_rank_holds_it(
        offers: list[set[int]]) -> None:
    rows = [offer_row(sorted(o)) for o in offers]
    try:
        step = common_step(rows)
    except LookupError:
        assert any(offers) and not set.intersection(*offers)
        return
    assert common_step(list(reversed(rows))) == step                  # symmetric: order of ranks does not matter
    if step is None:
        assert not any(offers)
    else:
        assert all(step in o for o in offers) and step == max(set.intersection(*offers))
