"""Window arithmetic on synthetic timings, against values computed by hand."""

from __future__ import annotations

import math

import pytest

from melfeed.shared.metrics import FEED_EFFICIENCY_MIN_STEPS, StepRecord, StepWindow, feed_efficiency_goal, percentile


def _rec(
    end_s: float, wait_s: float, step_s: float, rows: int = 4, real: int = 30, padded: int = 40, queue: int = 2
) -> StepRecord:
    return StepRecord(end_s, wait_s, step_s, rows, real, padded, queue)


def test_stall_rates_percentiles_cv_and_padding_by_hand() -> None:
    w = StepWindow(window_s=100.0)
    # Four steps back to back from t=0: (wait, step) = (1, 1), (0, 1), (0, 2), (1, 2) -> ends at 2, 3, 5, 8.
    for end, wait, step in ((2.0, 1.0, 1.0), (3.0, 0.0, 1.0), (5.0, 0.0, 2.0), (8.0, 1.0, 2.0)):
        w.add(_rec(end, wait, step, queue=int(step)))
    f = w.figures(now_s=8.0)
    assert f is not None
    assert f.wall_s == 8.0  # from 0 (first start) to now
    assert f.stall_pct == pytest.approx(100 * 2 / 8)  # 2 s waited of 8
    assert f.batches_per_s == pytest.approx(0.5) and f.samples_per_s == pytest.approx(2.0)
    assert (f.step_p50_s, f.step_p99_s) == (1.0, 2.0)  # nearest rank of [1, 1, 2, 2]
    assert f.step_cv == pytest.approx(0.5 / 1.5)  # std 0.5, mean 1.5
    assert f.padding_efficiency == pytest.approx(0.75) and f.queue_depth_mean == pytest.approx(1.5)


def test_old_records_leave_the_window_and_an_empty_window_has_no_figures() -> None:
    w = StepWindow(window_s=10.0)
    w.add(_rec(1.0, 0.5, 0.5))
    w.add(_rec(20.0, 0.0, 1.0))
    f = w.figures(now_s=20.0)
    assert f is not None and f.batches == 1 and f.wall_s == 1.0 and f.stall_pct == 0.0
    assert w.figures(now_s=100.0) is None


def test_memory_is_bounded_and_percentile_edges() -> None:
    w = StepWindow(window_s=1e9, max_records=3)
    for i in range(10):
        w.add(_rec(float(i + 1), 0.0, 1.0))
    f = w.figures(now_s=10.0)
    assert f is not None and f.batches == 3
    assert math.isnan(percentile([], 50)) and percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == 9.0
    with pytest.raises(ValueError):
        StepWindow(window_s=0)


def test_queue_depth_histogram_counts_the_window_only() -> None:
    w = StepWindow(window_s=10.0)
    for end_s, depth in [(1.0, 3), (12.0, 2), (13.0, 0), (14.0, 2), (15.0, 5)]:
        w.add(StepRecord(end_s, 0.0, 0.5, 4, 10, 20, depth))
    assert w.depth_histogram(15.0) == [1, 0, 2, 0, 0, 1]  # the record at 1.0 left the window
    assert w.depth_histogram(30.0) == []


def test_feed_efficiency_is_resident_time_of_the_same_buckets_over_the_wall_by_hand() -> None:
    w = StepWindow(window_s=100.0, feed_min_steps=1)
    # From t=0: (wait, step, resident) = (1, 1, 0.5), (0, 2, 1.5), (1, 1, 0.5) -> ends at 2, 4, 6.
    for end, wait, step, resident in ((2.0, 1.0, 1.0, 0.5), (4.0, 0.0, 2.0, 1.5), (6.0, 1.0, 1.0, 0.5)):
        w.add(StepRecord(end, wait, step, 4, 30, 40, 2, resident))
    f = w.figures(now_s=6.0)
    assert f is not None and f.wall_s == 6.0
    assert f.feed_efficiency == pytest.approx(2.5 / 6.0)  # resident 0.5 + 1.5 + 0.5 s for 6 s of wall
    # = fed steps/s over resident steps/s of the same buckets: (3 / 6) / (3 / 2.5)
    assert f.feed_efficiency == pytest.approx(f.batches_per_s / (3 / 2.5))
    # Every record since the first counts, not only the window's: at t=104.5 the first two left the window
    # (one batch remains for the rates), feed efficiency still covers all three over 104.5 s of wall.
    f_late = w.figures(now_s=104.5)
    assert f_late is not None and f_late.batches == 1
    assert f_late.feed_efficiency == pytest.approx(2.5 / 104.5)


def test_feed_efficiency_is_not_measured_yet_before_the_minimum_steps() -> None:
    assert FEED_EFFICIENCY_MIN_STEPS == 100  # docs/design.md "Feed efficiency" says why
    w = StepWindow(window_s=5.0, max_records=10)  # a short window, few records kept: neither matters
    for i in range(1, FEED_EFFICIENCY_MIN_STEPS):
        w.add(StepRecord(float(i), 0.0, 1.0, 4, 30, 40, 2, 0.9))
    f = w.figures(now_s=99.0)
    assert f is not None and f.batches == 5 and f.feed_efficiency is None  # 99 steps: not measured yet
    w.add(StepRecord(100.0, 0.0, 1.0, 4, 30, 40, 2, 0.9))
    f = w.figures(now_s=100.0)
    assert f is not None and f.feed_efficiency == pytest.approx(0.9)  # 100 x 0.9 s over 100 s


def test_feed_efficiency_is_unknown_when_any_record_has_no_resident_time() -> None:
    w = StepWindow(window_s=100.0, feed_min_steps=1)
    w.add(StepRecord(1.0, 0.0, 1.0, 4, 30, 40, 2, 0.9))
    f = w.figures(now_s=1.0)
    assert f is not None and f.feed_efficiency == pytest.approx(0.9)
    w.add(StepRecord(2.0, 0.0, 1.0, 4, 30, 40, 2))  # limit not measured for this one
    f = w.figures(now_s=2.0)
    assert f is not None and f.feed_efficiency is None


@pytest.mark.parametrize(("on_gpu", "goal"), [(False, 0.95), (True, 0.98)])
def test_feed_efficiency_goal_is_stricter_on_a_gpu(on_gpu: bool, goal: float) -> None:
    assert feed_efficiency_goal(on_gpu) == goal
