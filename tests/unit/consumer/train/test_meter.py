"""The loop meter: named-scalar means per status interval and the status line's window figures."""

from __future__ import annotations

import math

import pytest

from melfeed.consumer.train.meter import LoopMeter, OutputMeans, format_outputs, format_status_line
from melfeed.shared.metrics import FEED_EFFICIENCY_MIN_STEPS, StepRecord


def test_means_are_per_interval_and_per_name_and_survive_an_empty_interval() -> None:
    means = OutputMeans()
    assert means.take() == {}
    means.add_sums({"mel_l1": 1.0, "loss": 3.0}, 1)  # a read of one step, then one of two
    means.add_sums({"loss": 5.0, "mel_l1": 4.0}, 2)
    assert list(means.take().items()) == [("loss", 8.0 / 3), ("mel_l1", 5.0 / 3)]
    means.add_sums({"loss": 9.0}, 0)  # an empty read changes nothing
    assert means.take() == {"loss": 8.0 / 3, "mel_l1": 5.0 / 3}  # no step since: the last means
    means.add_sums({"loss": float("nan")}, 2)
    taken = means.take()
    assert list(taken) == ["loss"] and math.isnan(taken["loss"])
    assert means.latest() is not means.latest() and math.isnan(means.latest()["loss"])


def test_format_outputs_shows_every_name() -> None:
    assert (
        format_outputs({"loss": 0.91234, "mel_l1": 0.5, "stop_bce": float("nan")})
        == "loss 0.9123 mel_l1 0.5000 stop_bce nan"
    )


def test_status_line_rates_come_from_the_window_the_snapshot_uses() -> None:
    """Slow steps: one 2 s step (after 0.5 s waiting) seen 1 ms after it ended is ~0.4 batches/s.

    Dividing the batches since the last line by the time since the first step after warm-up *ended*
    would give 1 batch / 1 ms = 1000 batches/s while the snapshot, built from the same records, says 0.52.
    """
    meter = LoopMeter(window_s=30.0)
    meter.add(
        StepRecord(end_s=100.0, wait_s=0.5, step_s=2.0, rows=16, real_frames=80, padded_frames=100, queue_depth=2)
    )
    figures = meter.live.figures(100.001)
    assert figures is not None and figures.batches_per_s == pytest.approx(1 / 2.501)
    line = format_status_line(
        step=6,
        steps_total=300,
        outputs={"loss": 0.5, "mel_l1": 0.25},
        figures=figures,
        queue_depth=2,
        producers_alive=2,
        rejects=0,
        quarantined=0,
    )
    assert line == (
        "step 6/300 loss 0.5000 mel_l1 0.2500 | 0.40 batches/s 6 samples/s | stall 20.0% | "
        "queue 2 | producers 2 | rejects 0"
    )
    meter.add(
        StepRecord(end_s=102.0, wait_s=0.0, step_s=2.0, rows=16, real_frames=80, padded_frames=100, queue_depth=1)
    )
    live, steps = meter.live.figures(102.0), meter.steps.figures(102.0)
    assert live is not None and live.batches_per_s == pytest.approx(2 / 4.5)
    assert meter.batches == 2 and meter.samples == 32 and steps is not None and steps.batches == 2


def test_status_line_before_any_measured_step_shows_no_rate() -> None:
    line = format_status_line(
        step=3,
        steps_total=None,
        outputs={},
        figures=None,
        queue_depth=0,
        producers_alive=1,
        rejects=2,
        quarantined=1,
        gpus="gpu n/a",
    )
    assert line == (
        "step 3 loss - | - batches/s - samples/s | stall - | queue 0 | producers 1 | rejects 2 | "
        "quarantined 1 | gpu n/a"
    )


def test_status_line_shows_feed_efficiency_once_enough_steps_were_measured() -> None:
    meter = LoopMeter(window_s=30.0)

    def line_at(end_s: float) -> str:
        return format_status_line(
            step=6,
            steps_total=None,
            outputs={"loss": 0.5},
            figures=meter.live.figures(end_s),
            queue_depth=2,
            producers_alive=2,
            rejects=0,
            quarantined=0,
        )

    # 0.5 s wait + 2 s step each; the same bucket takes 2 s on a resident batch: 2 / 2.5 = 0.8.
    for i in range(1, FEED_EFFICIENCY_MIN_STEPS + 1):
        meter.add(
            StepRecord(
                end_s=2.5 * i,
                wait_s=0.5,
                step_s=2.0,
                rows=16,
                real_frames=80,
                padded_frames=100,
                queue_depth=2,
                resident_s=2.0,
            )
        )
        if i == FEED_EFFICIENCY_MIN_STEPS - 1:
            assert "| stall 20.0% | feed efficiency - (not measured yet: 1 steps to go) | queue 2 |" in line_at(2.5 * i)
    assert "| stall 20.0% | feed efficiency 0.800 | queue 2 |" in line_at(2.5 * FEED_EFFICIENCY_MIN_STEPS)
    assert meter.last_end_s == 2.5 * FEED_EFFICIENCY_MIN_STEPS
