"""The ceiling on quarantined rows (consumer/train/quarantine.py): when it is judged, when it trips, its line.

The rule is pure, so it is driven with batches of sample ids and the ids quarantined in them; the
stop it causes in a real run is in tests/integration/resilience/test_resume.py. (Here, not in
tests/unit/consumer/train/: that folder holds its 12 modules.)
"""

from __future__ import annotations

import pytest

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.train.quarantine import MIN_ROWS, QuarantineCeiling, ceiling_for, judged_from
from melfeed.shared.errors import EXIT_DATA, DataError


def _feed(ceiling: QuarantineCeiling, batches: int, rows: int, bad: int, first: int = 0) -> list[int]:
    """``batches`` batches of ``rows`` rows, the first ``bad`` of each quarantined; the indices that tripped."""
    tripped = []
    for b in range(batches):
        ids = list(range(first + b * rows, first + (b + 1) * rows))
        if ceiling.add(ids, ids[:bad]):
            tripped.append(b)
    return tripped


def test_nothing_is_judged_before_min_rows_even_when_every_row_is_quarantined() -> None:
    ceiling = QuarantineCeiling(0.01, min_rows=100)
    assert _feed(ceiling, 3, 32, 32) == []  # 96 rows, all quarantined: not yet judged
    assert ceiling.add(list(range(96, 128)), list(range(96, 128)))  # 128 >= 100: trips on this batch
    assert ceiling.tripped and (ceiling.rows, ceiling.quarantined) == (128, 128)
    assert not ceiling.add([500], [500])  # trips once; later batches are still counted
    assert (ceiling.rows, ceiling.quarantined) == (129, 129)


def test_one_bad_row_in_the_first_batch_is_no_trend() -> None:
    ceiling = QuarantineCeiling(0.01, min_rows=MIN_ROWS)
    assert _feed(ceiling, 1, 32, 1) == []  # 3 % of the first batch
    assert _feed(ceiling, 100, 32, 0, first=32) == []  # 1 of 3232 rows once judged: 0.03 %
    assert not ceiling.tripped and ceiling.quarantined == 1


def test_it_trips_on_the_first_batch_that_takes_the_fraction_above_the_key() -> None:
    ceiling = QuarantineCeiling(0.05, min_rows=100)
    assert _feed(ceiling, 5, 20, 1) == []  # 5 of 100 = 5 %: not above
    assert not ceiling.add(list(range(100, 120)), [100])  # 6 of 120 = 5 %: still not above
    assert not ceiling.tripped
    assert ceiling.add(list(range(120, 140)), [120, 121])  # 8 of 140 = 5.7 %
    assert ceiling.tripped


def test_a_fraction_equal_to_the_key_is_not_above_it_whatever_the_float_rounding() -> None:
    exact = QuarantineCeiling(0.29, min_rows=100)  # 0.29 * 100 == 28.999999999999996 in floats
    assert not exact.add(list(range(100)), list(range(29)))  # 29 of 100 = 0.29: not above
    assert exact.add([100], [100])  # 30 of 101: above


def test_a_cache_lost_late_in_a_long_clean_run_trips_on_the_streak_not_the_fraction() -> None:
    ceiling = QuarantineCeiling(0.5, min_rows=100)
    assert _feed(ceiling, 100, 32, 0) == []  # 3200 clean rows
    ids = list(range(10_000, 10_099))
    assert not ceiling.add(ids, ids)  # 99 in a row: not yet
    assert ceiling.add([20_000], [20_000])  # the 100th: 100 of 3300 rows, 3 %, far below 50 %
    assert ceiling.streak == 100 and "the last 100 rows trained were all quarantined" in ceiling.message()


def test_a_good_row_ends_the_streak() -> None:
    ceiling = QuarantineCeiling(0.9, min_rows=10)
    for start in range(0, 200, 10):  # 9 quarantined, then one good row, over and over
        ids = list(range(start, start + 10))
        assert not ceiling.add(ids, ids[:9])
    assert ceiling.streak == 0 and ceiling.quarantined == 180 and not ceiling.tripped  # 90 %: not above 0.9
    assert not ceiling.add([1000, 1001], [1001]) and ceiling.streak == 1  # a batch ending in one quarantined


def test_one_turns_it_off_and_zero_tolerates_no_quarantined_row() -> None:
    off = QuarantineCeiling(1.0, min_rows=10)
    assert not off.enabled and _feed(off, 50, 32, 32) == [] and off.quarantined == 1600
    strict = QuarantineCeiling(0.0, min_rows=64)
    assert _feed(strict, 1, 32, 1) == []  # judged from 64 rows on
    assert _feed(strict, 1, 32, 0, first=32) == [0]  # 1 of 64
    assert _feed(QuarantineCeiling(0.0, min_rows=64), 10, 32, 0) == []


def test_only_the_batchs_real_rows_count_and_a_foreign_id_is_ignored() -> None:
    ceiling = QuarantineCeiling(0.5, min_rows=4)
    assert not ceiling.add([1, 2, 3], [3, 77, 77])  # a partial batch: 3 real rows, padding not counted
    assert (ceiling.rows, ceiling.quarantined) == (3, 1)
    assert not ceiling.add([], [])  # a batch without rows changes nothing
    assert (ceiling.rows, ceiling.streak) == (3, 1)


def test_min_rows_is_1000_or_one_epoch_of_the_plan_whichever_is_smaller() -> None:
    assert (judged_from(48), judged_from(1000), judged_from(13_100), judged_from(0)) == (48, 1000, 1000, 1)

    class _Plan:
        def __init__(self, rows: list[int]) -> None:
            self.batches = [PlannedBatch(i, 0, 0, tuple(range(n))) for i, n in enumerate(rows)]

        def epoch(self, data_epoch: int) -> list[PlannedBatch]:
            assert data_epoch == 0
            return self.batches

    assert ceiling_for(0.01, _Plan([8, 8, 5])).min_rows == 21  # type: ignore[arg-type]  # real rows only
    assert ceiling_for(0.01, _Plan([32] * 100)).min_rows == MIN_ROWS  # type: ignore[arg-type]
    assert not ceiling_for(1.0, _Plan([])).enabled  # type: ignore[arg-type]  # off: the plan is not even asked


def test_a_plan_that_ends_before_min_rows_is_judged_once_at_the_end_on_every_row_quarantined() -> None:
    bad = QuarantineCeiling(0.01, min_rows=100)
    assert _feed(bad, 2, 8, 8) == [] and not bad.tripped  # 16 rows, all empty: no verdict yet
    assert bad.judge_at_end() and bad.tripped and bad.at_end
    assert not bad.judge_at_end()  # once
    line = bad.message(resume_at=2)
    assert line.startswith(
        "producer.max_quarantined_fraction: 16 of the 16 rows trained were quarantined (100.00 %, above 1 %)"
    )
    assert line.endswith("the run reached the end of its plan on empty rows: fix the cache and train again")
    some = QuarantineCeiling(0.01, min_rows=100)
    _feed(some, 2, 8, 7)  # one good row in 16: still no trend
    assert not some.judge_at_end() and not some.tripped
    long = QuarantineCeiling(0.01, min_rows=16)
    _feed(long, 2, 8, 0)
    assert not long.judge_at_end()  # judged batch by batch already
    off, empty = QuarantineCeiling(1.0, min_rows=100), QuarantineCeiling(0.01, min_rows=100)
    _feed(off, 1, 8, 8)
    assert not off.judge_at_end() and not empty.judge_at_end()  # turned off; nothing trained


def test_the_line_names_the_key_the_counts_the_first_bad_row_and_what_to_do() -> None:
    ceiling = QuarantineCeiling(0.01, min_rows=8)
    ceiling.add([4, 5, 6, 7], [], utterance_ids=["a", "b", "c", "d"])
    assert ceiling.add(
        [8, 9, 10, 11], [9, 11], utterance_ids=["e", "LJ001-0010", "g", "h"], note="/cache/mels/LJ001-0010.npy: missing"
    )
    line = ceiling.message(resume_at=2)
    assert line.startswith(
        "producer.max_quarantined_fraction: 2 of the 8 rows trained were quarantined "
        "(25.00 %, above 1 %), so cache files are missing or bad; "
        "e.g. sample 9 (LJ001-0010): /cache/mels/LJ001-0010.npy: missing; "
    )
    assert "verify-cache" in line and line.endswith("run the same command again: it resumes at batch 2")
    assert ceiling.message(resumable=False).endswith("(no consumer.state_dir: nothing to resume)")
    err = DataError(line)
    assert str(err) == line and "\n" not in str(err) and EXIT_DATA == 65


def test_the_cli_turns_a_data_error_into_one_line_and_exit_65(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from melfeed import cli as run_pipeline

    def stopped(*args: object) -> int:
        raise DataError("producer.max_quarantined_fraction: 1000 of the 1000 rows trained were quarantined")

    monkeypatch.setattr("melfeed.shared.service.lifecycle.setup_logging", lambda *args, **kwargs: None)
    monkeypatch.setattr("melfeed.consumer.app.main_consumer", stopped)
    assert run_pipeline.main(["consumer", "--cache-dir", "/nonexistent"]) == 65
    assert capsys.readouterr().err == (
        "melfeed consumer: producer.max_quarantined_fraction: 1000 of the 1000 rows trained were quarantined\n"
    )
