"""The search rules of ``buckets.batch_size: auto`` (consumer/train/rows_search.py), with scripted trials."""

from __future__ import annotations

import pytest

from melfeed.consumer.train.rows_search import Trial, candidate_rows, fastest_rows, largest_fitting_rows, pick_fastest


def test_candidate_rows_double_up_to_the_cap_in_units_of_the_replicas() -> None:
    assert candidate_rows(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert candidate_rows(100, unit=4) == [4, 8, 16, 32, 64, 100]
    assert candidate_rows(3, unit=4) == [4]
    with pytest.raises(ValueError):
        candidate_rows(0)


def test_pick_fastest_keeps_the_smallest_rows_within_5_percent_of_the_best() -> None:
    trials = [
        Trial(8, True, step_s=0.100),
        Trial(16, True, step_s=0.166),
        Trial(32, True, step_s=0.320),
        Trial(64, False),
    ]
    assert pick_fastest(trials) == 16  # 96.4 rows/s >= 0.95 x 100 rows/s (32 rows)
    assert pick_fastest([Trial(1, False)]) == 0


def test_fastest_rows_stops_doubling_once_throughput_has_peaked() -> None:
    def saturating(rows: int) -> Trial:  # 1600 rows/s from 16 rows on
        return Trial(rows, True, step_s=max(rows, 16) / 1600)

    choice = fastest_rows(saturating, 256)
    assert choice.rows == 16
    assert [t.rows for t in choice.trials] == [1, 2, 4, 8, 16, 32, 64]  # two sizes without a gain, then stop


def test_fastest_rows_stops_at_the_first_size_that_does_not_fit() -> None:
    choice = fastest_rows(lambda rows: Trial(rows, rows <= 8, step_s=0.01 if rows <= 8 else None), 256)
    assert choice.rows == 8 and choice.trials[-1] == Trial(16, False)


def test_largest_fitting_rows_bisects_to_within_5_percent_under_the_memory_limit() -> None:
    def trial(rows: int) -> Trial:  # 10 MB a row, fits up to 90 rows (the allocator fails above)
        return Trial(rows, rows <= 90, peak_bytes=rows * 10_000_000 if rows <= 90 else None)

    roomy = largest_fitting_rows(trial, 256, limit_bytes=10**12)
    assert 90 / 1.05 <= roomy.rows <= 90 and roomy.largest_fitting == roomy.rows
    capped = largest_fitting_rows(trial, 256, limit_bytes=600_000_000)  # the memory share binds first
    assert 600 / 10 / 1.05 <= capped.rows <= 60
    assert largest_fitting_rows(lambda rows: Trial(rows, False), 256, 10**12).rows == 0
    assert largest_fitting_rows(trial, 64, 10**12).rows == 64  # the cap fits: no bisection


def test_largest_fitting_rows_starts_above_rows_known_to_fit() -> None:
    tried: list[int] = []

    def trial(rows: int) -> Trial:
        tried.append(rows)
        return Trial(rows, rows <= 100, peak_bytes=rows)

    choice = largest_fitting_rows(trial, 256, limit_bytes=10**9, known_fit=40)
    assert tried[:2] == [80, 160] and 100 / 1.05 <= choice.rows <= 100
    assert largest_fitting_rows(lambda rows: Trial(rows, False), 256, 10**9, known_fit=40).rows == 40


def test_fastest_rows_stops_doubling_after_a_step_of_a_second() -> None:
    choice = fastest_rows(lambda rows: Trial(rows, True, step_s=0.05 + rows / 20), 256)  # still growing
    assert [t.rows for t in choice.trials] == [1, 2, 4, 8, 16, 32]  # 32 rows: 1.65 s per step
    assert choice.rows == 16
