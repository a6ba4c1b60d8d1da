"""Tests for ``melfeed report``: a real PNG from a schema-conforming JSONL, checked by its pixels."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from melfeed.consumer.observe.report_data import read_metrics
from melfeed.consumer.observe.report_plot import PANELS, RenderedReport, main_report, render_report
from melfeed.shared.errors import ConfigError
from tests.fakes import realistic_run

REPO = Path(__file__).resolve().parents[4]


def _jsonl(path: Path, gpus: bool = True) -> Path:
    lines = realistic_run(n_lines=120, gpus=gpus)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _cli(*args: str, pythonpath: str = str(REPO)) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "melfeed", "report", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "PYTHONPATH": pythonpath, "MPLBACKEND": "TkAgg"},
    )


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def _pixels(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(str(path))[:, :, :3]  # RGB floats 0..1


def _panel(rgb: np.ndarray, report: RenderedReport, name: str) -> np.ndarray:
    x0, y0, x1, y1 = report.panel_boxes_px[name]
    return rgb[y0 + 2 : y1 - 2, x0 + 2 : x1 - 2]  # inside the frame


def _colored(area: np.ndarray) -> int:
    """Pixels of a drawn data line: strongly coloured (grid, text, frame and phase shading are grey or pale)."""
    return int(((area.max(axis=2) - area.min(axis=2)) > 0.3).sum())


def test_cli_writes_a_1600x1400_png(tmp_path: Path) -> None:
    out = tmp_path / "report.png"
    proc = _cli(str(_jsonl(tmp_path / "m.jsonl")), "-o", str(out), "--title", "two producers")
    assert proc.returncode == 0, proc.stderr
    assert _png_size(out) == (1600, 1400)
    assert proc.stdout == f"report: 120 snapshots over 238 s, 1600x1400 px -> {out}\n"
    rgb = _pixels(out)
    assert rgb.shape == (1400, 1600, 3) and rgb.std() > 0.05


def test_every_panel_shows_its_data(tmp_path: Path) -> None:
    out = tmp_path / "report.png"
    report = render_report(read_metrics(_jsonl(tmp_path / "m.jsonl")), out, "t")
    assert (report.width_px, report.height_px) == _png_size(out) == (1600, 1400)
    rgb = _pixels(out)
    boxes = [report.panel_boxes_px[name] for name in PANELS]
    assert all(b[1] < b[3] <= n[1] for b, n in zip(boxes, boxes[1:]))  # stacked top to bottom, no overlap
    for name in PANELS:
        area = _panel(rgb, report, name)
        assert area.shape[0] > 150 and area.shape[1] > 1200, (name, area.shape)  # readable panel sizes
        assert area.std() > 0.02, name  # not blank
        assert _colored(area) > 1000, (name, _colored(area))  # data lines drawn in it


def test_without_gpus_the_gpu_panel_says_so_instead_of_an_empty_plot(tmp_path: Path) -> None:
    out = tmp_path / "report.png"
    report = render_report(read_metrics(_jsonl(tmp_path / "m.jsonl", gpus=False)), out, "t")
    rgb = _pixels(out)
    gpu = _panel(rgb, report, "gpu")
    assert _colored(gpu) < 50, _colored(gpu)  # no data line
    dark = (gpu.max(axis=2) < 0.6).sum()  # but the n/a text is there
    assert dark > 500, dark
    assert _colored(_panel(rgb, report, "producers")) > 1500


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "cannot read metrics file: No such file or directory"),
        ("", "empty: no metrics snapshots"),
        ("{}\n{}\n", "missing keys t_unix_s"),
    ],
)
def test_bad_input_is_one_config_error_line_naming_the_file(tmp_path: Path, content: str | None, reason: str) -> None:
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    where = f"{path}:1" if content and content.startswith("{") else str(path)
    with pytest.raises(ConfigError) as err:
        read_metrics(path)
    assert str(err.value).startswith(f"{where}: {reason}") and "\n" not in str(err.value)


def test_bad_input_through_the_cli_is_that_one_line_and_exit_78_with_no_png(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("{}\n{}\n")  # the error of any bad input reaches the user the same way
    proc = _cli(str(path), "-o", str(tmp_path / "r.png"))
    assert proc.returncode == 78
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"melfeed report: {path}:1: missing keys")
    assert not (tmp_path / "r.png").exists()


def test_an_unwritable_output_is_one_line_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "no-such-dir" / "r.png"
    proc = _cli(str(_jsonl(tmp_path / "m.jsonl")), "-o", str(out))
    assert proc.returncode == 78
    assert proc.stderr.splitlines() == [f"melfeed report: {out}: cannot write the report: No such file or directory"]


def _output_aliasing_an_input(tmp_path: Path, metrics: Path, alias: str) -> Path:
    out = {
        "same": metrics,
        "relative": tmp_path / "sub" / ".." / "m.jsonl",
        "symlink": tmp_path / "link.png",
        "hardlink": tmp_path / "hard.png",
    }[alias]
    (tmp_path / "sub").mkdir()
    if alias == "symlink":
        out.symlink_to(metrics)
    elif alias == "hardlink":
        os.link(metrics, out)
    return out


@pytest.mark.parametrize("alias", ["same", "relative", "symlink", "hardlink"])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(tmp_path: Path, alias: str) -> None:
    metrics = _jsonl(tmp_path / "m.jsonl")
    before = metrics.read_bytes()
    out = _output_aliasing_an_input(tmp_path, metrics, alias)
    args = argparse.Namespace(
        metrics=[str(_jsonl(tmp_path / "other.jsonl")), str(metrics)], output=str(out), title=None
    )
    with pytest.raises(ConfigError) as err:
        main_report(args)
    assert str(err.value) == (
        f"--output: is the input file {metrics}; writing it would destroy the input, got {str(out)!r}"
    )
    assert metrics.read_bytes() == before


def test_the_cli_refuses_an_output_that_is_an_input_in_one_line_with_exit_78(tmp_path: Path) -> None:
    """Through the command, the hard link (the same file under another name: only its inode tells)."""
    metrics = _jsonl(tmp_path / "m.jsonl")
    before = metrics.read_bytes()
    out = _output_aliasing_an_input(tmp_path, metrics, "hardlink")
    proc = _cli(str(_jsonl(tmp_path / "other.jsonl")), str(metrics), "-o", str(out))
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.splitlines() == [
        f"melfeed report: --output: is the input file {metrics}; writing it would destroy the input, got {str(out)!r}"
    ]
    assert metrics.read_bytes() == before


def test_without_matplotlib_the_command_says_how_to_install_it(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('blocked for the test')\n")
    proc = _cli(
        str(_jsonl(tmp_path / "m.jsonl")),
        "-o",
        str(tmp_path / "r.png"),
        pythonpath=f"{blocker.parent}{os.pathsep}{REPO}",
    )
    assert proc.returncode == 78
    assert proc.stderr == "melfeed report: needs matplotlib: pip install 'melfeed[report]'\n"


def test_several_ranks_share_the_panels_on_one_time_axis_labelled_by_rank(tmp_path: Path) -> None:
    paths = []
    for rank, offset_s in ((0, 0.0), (1, 30.0)):  # rank 1 started 30 s later
        lines = realistic_run(n_lines=60, gpus=False, seed=rank)
        for line in lines:
            line.update(rank=rank, world=2, t_unix_s=float(line["t_unix_s"]) + offset_s)  # type: ignore[arg-type]
        paths.append(tmp_path / f"rank{rank}.jsonl")
        paths[-1].write_text("".join(json.dumps(line) + "\n" for line in lines))
    runs = [read_metrics(p) for p in paths]
    assert [r.rank for r in runs] == [0, 1] and runs[1].t0_unix_s - runs[0].t0_unix_s == 30.0
    report = render_report(runs, tmp_path / "ranks.png", "job")
    assert _png_size(report.path) == (1600, 1400) and report.x_max_s == 148.0  # rank 1 drawn 30 s later
    assert "rank 0 p50" in report.legend_labels["step"] and "rank 1 p50" in report.legend_labels["step"]
    assert {"rank 0 producer-1", "rank 1 producer-1"} <= set(report.legend_labels["producers"])
    single = render_report(runs[0], tmp_path / "one.png", "one")
    assert "p50" in single.legend_labels["step"]  # one run: labels without a rank prefix
    proc = _cli(str(paths[0]), str(paths[1]), "-o", str(tmp_path / "cli.png"))
    assert proc.returncode == 0, proc.stderr
    assert "snapshots from 2 files over 148 s" in proc.stdout  # 59 intervals of 2 s, + 30 s offset


def test_the_queue_panel_draws_the_depth_as_recorded_and_never_adds_the_leases_twice(tmp_path: Path) -> None:
    lines = realistic_run(n_lines=40, gpus=False)
    for line in lines[8:]:  # training: a full 3-slot ring, two of its slots leased
        line.update(queue_depth_mean=3.0, leases_outstanding=2, lease_window=2)
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = render_report(read_metrics(path), tmp_path / "q.png", "queue")
    assert report.legend_labels["queue"][:2] == ("ready + leased (mean)", "leased (at snapshot)")
    assert report.line_tops["queue"] == 3.0  # queue_depth_mean already holds the leases: 3, never 3 + 2
