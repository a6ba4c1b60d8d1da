"""TensorBoard scalars: the tags of a snapshot, the events as the scalar plugin reads them, the loop's write points."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from melfeed.consumer.observe.board import Board, BoardWriter, board_dir, board_scalars, check_board_dir
from melfeed.consumer.observe.telemetry import build_snapshot
from melfeed.consumer.train.device.accumulators import IntervalRead
from melfeed.consumer.transport.receiver import ReceiverStats
from melfeed.shared.errors import ConfigError
from melfeed.shared.metrics import StepRecord, StepWindow
from tests.board_events import read_scalars
from tests.fakes import gpu_row, producer_row

pytestmark = pytest.mark.tf


def _snapshot() -> dict[str, object]:
    window = StepWindow(window_s=100.0, feed_min_steps=1)
    for end in (2.0, 4.0):  # 2 batches of 4 rows in 4 s, 1 s waited, 30 of 40 frames real
        window.add(StepRecord(end, 0.5, 1.5, 4, 30, 40, 3, resident_s=1.0))
    rs = ReceiverStats(
        batches_received=2,
        bytes_received=0,
        duplicates_dropped=0,
        stale_dropped=0,
        leases_outstanding=0,
        leases_reissued=0,
        producers_alive=2,
        producers_seen=2,
        rejects={},
        quarantined=0,
        lease_window=2,
        producers=(),
        hello_repeats=0,
    )
    gpus = [
        gpu_row("model", 1, util_pct=97.0, mem_used_mib=1000.0),
        gpu_row("data", 0, util_pct=None, mem_used_mib=10.0),
    ]  # util unknown: no tag
    producers = [producer_row("producer-0", batches_per_s=5.0), producer_row("producer-1", batches_per_s=None)]
    return build_snapshot(
        t_unix_s=1.0,
        uptime_s=1.0,
        phase="training",
        step=2,
        steps_total=None,
        loss=None,
        window_s=100.0,
        figures=window.figures(4.0),
        depth_hist=[],
        bytes_per_s=None,
        rs=rs,
        producers=producers,
        compiles_after_ready=0,
        gpus=gpus,
    )


def test_the_scalars_are_the_means_and_the_snapshots_known_figures() -> None:
    scalars = board_scalars(_snapshot(), {"loss": 0.5, "mel_l1": math.nan})
    assert math.isnan(scalars.pop("train/mel_l1"))  # a NaN mean is written: it is news
    assert scalars == pytest.approx(
        {
            "train/loss": 0.5,
            "feed/stall_pct": 25.0,
            "feed/feed_efficiency": 0.5,
            "feed/batches_per_s": 0.5,
            "feed/samples_per_s": 2.0,
            "feed/padding_efficiency": 0.75,
            "feed/queue_depth": 3.0,
            "feed/useful_work": 0.375,
            "gpu/model-1/util_pct": 97.0,
            "gpu/model-1/mem_mib": 1000.0,
            "gpu/data-0/mem_mib": 10.0,
            "producer/producer-0/batches_per_s": 5.0,
        }
    )  # unknown figures (null) are left out
    assert board_scalars(None, {"loss": 1.0}) == {"train/loss": 1.0}


def test_the_writer_writes_float32_scalars_of_the_scalars_plugin_and_closes_once(tmp_path: Path) -> None:
    writer = BoardWriter(tmp_path / "run")
    writer.write(3, {"train/loss": 0.25, "feed/stall_pct": 1.5})
    assert read_scalars(tmp_path / "run") == {"train/loss": [(3, 0.25)], "feed/stall_pct": [(3, 1.5)]}  # flushed
    writer.write(7, {"train/loss": 0.125})
    writer.close()
    writer.close()
    assert read_scalars(tmp_path / "run")["train/loss"] == [(3, 0.25), (7, 0.125)]
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(8, {})


def _read(steps: int, loss_sum: float) -> IntervalRead:
    return IntervalRead(steps, {"loss": loss_sum}, {"loss": 0.0}, {"loss": 0.0}, 0, 0, None)


def test_the_board_writes_the_means_of_its_reads_at_the_global_step_each_step_once(tmp_path: Path) -> None:
    with Board(tmp_path, every_steps=2, first_batch=100) as board:  # a run resumed at batch 100
        assert [board.is_due(n) for n in (1, 2, 3, 4)] == [False, True, False, True]
        assert board.needs_read(2)
        board.write(None)  # nothing read yet: nothing written, no file opened
        assert not list(tmp_path.iterdir())
        board.add_read(_read(2, 3.0))
        assert not board.needs_read(2) and board.needs_read(3)  # a checkpoint's read at step 2 serves
        board.write(None)
        board.write(None)  # no step since: dropped
        board.add_read(_read(1, 0.25))
        board.write(None)
    board.close()
    assert read_scalars(tmp_path) == {"train/loss": [(102, 1.5), (103, 0.25)]}
    assert not any(Board(tmp_path, every_steps=None).is_due(n) for n in range(1, 10))  # the status line paces it


def test_a_directory_that_cannot_be_made_is_one_line_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert board_dir(tmp_path, 0, 1) == tmp_path and board_dir(tmp_path, 1, 2) == tmp_path / "rank-1"
    with pytest.raises(ConfigError) as err:
        check_board_dir(tmp_path / "file" / "tb")
    assert str(err.value) == f"consumer.tensorboard_dir: cannot create {tmp_path}/file/tb: Not a directory"
    check_board_dir(tmp_path / "new" / "rank-0")
    assert (tmp_path / "new" / "rank-0").is_dir()
