"""``melfeed report``: one PNG timeline of a run from its metrics JSONL.

Role: draws ``melfeed.consumer.observe.report_data.RunSeries`` with matplotlib (Agg, never a display) as stacked
panels on one shared time axis: step time p50/p99, data stall, queue depth against the lease
window, per-producer batches/s, GPU utilisation per device. Phases other than "training"
(compiling, waiting) are shaded in every panel. The title carries the run's totals.
Several metrics files (the ranks of one job, ``report A.jsonl B.jsonl``) share the panels on one
wall-clock axis (from the earliest first snapshot); each line's label starts with its rank
(``rank 1 ``), or the file's position when the snapshots name no rank.
Invariants: matplotlib is an optional extra (``melfeed[report]``), imported only here and only when
the command runs; without it the command is one line and exit 78. The figure is always
``_FIGSIZE_IN`` x ``_DPI`` pixels (no tight bbox), so tests and docs can rely on its size.
Shutdown: the figure is closed after saving, also on error (no pyplot state survives).
"""

from __future__ import annotations

import argparse
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from melfeed.consumer.observe.report_data import RunSeries, read_metrics
from melfeed.shared.errors import ConfigError
from melfeed.shared.flag_checks import check_not_an_input
from melfeed.shared.metrics import PHASE_COMPILING, PHASE_WAITING
from melfeed.shared.output_files import write_output

__all__ = ["render_report", "main_report", "RenderedReport", "PANELS", "GPU_NA_TEXT", "run_labels"]

PANELS = ("step", "stall", "queue", "producers", "gpu")
GPU_NA_TEXT = "GPU n/a (no NVML / no GPU)"
_FIGSIZE_IN = (16.0, 14.0)
_DPI = 100  # 1600 x 1400 px: readable at a glance on a laptop screen, small enough for a README
_INSTALL_HINT = "needs matplotlib: pip install 'melfeed[report]'"
_SHADE = {PHASE_COMPILING: "#fde7c8", PHASE_WAITING: "#e6e6e6"}  # phases without steps (done: one last line)
_STALL_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "tab:blue")


@dataclass(frozen=True, slots=True)
class RenderedReport:
    """Where the PNG went and where each panel lies in it (pixels, origin top-left: x0, y0, x1, y1)."""

    path: Path
    width_px: int
    height_px: int
    panel_boxes_px: dict[str, tuple[int, int, int, int]]
    legend_labels: dict[str, tuple[str, ...]] = field(default_factory=dict)  # panel -> its legend's labels
    x_max_s: float = 0.0  # right end of the shared time axis (s since the earliest snapshot)
    line_tops: dict[str, float] = field(default_factory=dict)  # panel -> highest finite y of its drawn lines


def _import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(_INSTALL_HINT) from None
    matplotlib.use("Agg", force=True)  # a file, never a window: works on servers and in tests
    import matplotlib.pyplot as plt

    return plt


def _phase_spans(series: RunSeries) -> list[tuple[str, float, float]]:
    """(phase, start_s, end_s) runs of consecutive non-training snapshots (each to the next snapshot)."""
    spans: list[tuple[str, float, float]] = []
    t = series.t_s
    for i, phase in enumerate(series.phase):
        if phase not in _SHADE:
            continue
        end = float(t[i + 1]) if i + 1 < len(t) else float(t[i])
        if spans and spans[-1][0] == phase and spans[-1][2] == float(t[i]):
            spans[-1] = (phase, spans[-1][1], end)
        else:
            spans.append((phase, float(t[i]), end))
    return spans


def _shade(ax: Any, spans: list[tuple[str, float, float]], label: bool) -> None:
    seen: set[str] = set()
    for phase, start, end in spans:
        ax.axvspan(
            start, end, color=_SHADE[phase], zorder=0, lw=0, label=phase if label and phase not in seen else None
        )
        seen.add(phase)


def _line(ax: Any, t: np.ndarray, y: np.ndarray, label: str, **kw: Any) -> None:
    ax.plot(t, y, label=label, marker=".", markersize=4, linewidth=1.6, **kw)  # markers: lone points show


def _draw_step(ax: Any, s: RunSeries, prefix: str = "", index: int = 0) -> None:
    _line(ax, s.t_s, s.scalars["step_p50_ms"], f"{prefix}p50")
    _line(ax, s.t_s, s.scalars["step_p99_ms"], f"{prefix}p99")
    ax.set_ylabel("step time (ms)")


def _draw_stall(ax: Any, s: RunSeries, prefix: str = "", index: int = 0) -> None:
    y = s.scalars["stall_pct"]
    color = _STALL_COLORS[index % len(_STALL_COLORS)]
    _line(ax, s.t_s, y, f"{prefix}data stall", color=color)
    ax.fill_between(s.t_s, 0, np.nan_to_num(y), color=color, alpha=0.15, step=None)
    top = np.nanmax(y) if np.isfinite(y).any() else 0.0
    high = ax.get_ylim()[1] if index else 0.0  # another run's stall already drawn here
    ax.set_ylim(0, max(5.0, high, min(100.0, top * 1.15)))  # a near-zero stall stays visible as near zero
    ax.set_ylabel("data stall (%)")


def _draw_queue(ax: Any, s: RunSeries, prefix: str = "", index: int = 0) -> None:
    # queue_depth_mean already counts the leases: ready batches + leases outstanding, when a batch was taken
    depth, leased = s.scalars["queue_depth_mean"], s.scalars["leases_outstanding"]
    _line(ax, s.t_s, depth, f"{prefix}ready + leased (mean)")
    _line(ax, s.t_s, leased, f"{prefix}leased (at snapshot)")
    ax.plot(
        s.t_s,
        s.scalars["lease_window"],
        "k--",
        linewidth=1.2,
        drawstyle="steps-post",
        label=None if index else "lease window\n(per producer)",
    )
    values = np.concatenate([depth, s.scalars["lease_window"]])
    top = float(np.nanmax(values)) if np.isfinite(values).any() else 1.0
    high = ax.get_ylim()[1] if index else 0.0
    ax.set_ylim(0, max(high, top * 1.2 + 0.5))  # headroom: a steady queue at its limit must not hide on the frame
    ax.set_ylabel("queue depth (batches)")


def _draw_producers(ax: Any, s: RunSeries, prefix: str = "", index: int = 0) -> None:
    _line(ax, s.t_s, s.scalars["batches_per_s"], f"{prefix}consumer (all)", color="0.55", linestyle=":")
    for pid in sorted(s.producers):
        _line(ax, s.t_s, s.producers[pid], f"{prefix}{pid}")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("batches/s")


def _draw_gpu(ax: Any, runs: Sequence[tuple[str, RunSeries]]) -> bool:
    """Returns whether a legend is useful (there were GPUs)."""
    if all(not s.gpus or all(np.isnan(v).all() for v in s.gpus.values()) for _, s in runs):
        ax.text(0.5, 0.5, GPU_NA_TEXT, transform=ax.transAxes, ha="center", va="center", fontsize=16, color="0.35")
        ax.set_yticks([])
        ax.set_ylabel("GPU utilisation")
        return False
    for prefix, s in runs:
        for label, util in s.gpus.items():
            _line(ax, s.t_s, util, f"{prefix}{label}")
    ax.set_ylim(0, 105)
    ax.set_ylabel("GPU utilisation (%)")
    return True


def run_labels(runs: Sequence[RunSeries]) -> list[str]:
    """Legend prefixes of several runs: ``rank R `` from their snapshots, else ``run N ``; one run: none."""
    if len(runs) == 1:
        return [""]
    return [f"rank {s.rank} " if s.rank is not None else f"run {i} " for i, s in enumerate(runs)]


def _aligned(runs: Sequence[RunSeries]) -> list[RunSeries]:
    """Each run's times shifted onto one axis: seconds since the earliest first snapshot."""
    start = min(s.t0_unix_s for s in runs)
    return [replace(s, t_s=s.t_s + (s.t0_unix_s - start)) for s in runs]


def _title(series: RunSeries, name: str) -> str:
    tot = series.totals()

    def fmt(value: float, spec: str) -> str:
        return "n/a" if math.isnan(value) else format(value, spec)

    return (
        f"{name}\n{tot.steps} steps in {tot.duration_s:.0f} s  ·  mean {fmt(tot.batches_per_s_mean, '.1f')} "
        f"batches/s  ·  data stall {fmt(tot.stall_pct_mean, '.1f')} % overall  ·  "
        f"{len(series.producers)} producers  ·  " + (f"{len(series.gpus)} GPUs" if series.gpus else "GPU n/a")
    )


def render_report(series: RunSeries | Sequence[RunSeries], out: str | Path, title: str) -> RenderedReport:
    """Draw ``series`` (one run, or several ranks on one time axis) into the PNG ``out``.

    Raises:
        ConfigError: matplotlib is missing, or ``out`` cannot be written (names it), or another user could
            redirect the write (a symbolic link in its place: ``melfeed.shared.output_files.open_output``).
    """
    plt = _import_pyplot()
    runs = _aligned([series] if isinstance(series, RunSeries) else list(series))
    named = list(zip(run_labels(runs), runs))
    drawers = (_draw_step, _draw_stall, _draw_queue, _draw_producers)
    with plt.rc_context({"font.size": 12, "axes.grid": True, "grid.alpha": 0.35}):
        fig, axes = plt.subplots(
            len(PANELS),
            1,
            sharex=True,
            figsize=_FIGSIZE_IN,
            dpi=_DPI,
            layout="constrained",
            height_ratios=[1, 0.8, 1, 1.2, 1],
        )
        try:
            spans = [_phase_spans(s) for s in runs]
            for i, (ax, draw) in enumerate(zip(axes, drawers)):
                for k, (prefix, s) in enumerate(named):
                    draw(ax, s, prefix, k)
                    _shade(ax, spans[k], label=i == 0 and k == 0)
            has_gpus = _draw_gpu(axes[-1], named)
            for run_spans in spans:
                _shade(axes[-1], run_spans, label=False)
            for ax in axes[:-1] if not has_gpus else axes:
                ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=11, frameon=False)
            axes[-1].set_xlabel("time since the first snapshot (s)")
            axes[-1].set_xlim(0, max(max(float(s.t_s[-1]) for s in runs), 1.0))
            fig.suptitle(_title(runs[0], title) if len(runs) == 1 else _ranks_title(named, title), fontsize=15)
            return _save(fig, axes, Path(out))
        finally:
            plt.close(fig)


def _ranks_title(named: Sequence[tuple[str, RunSeries]], name: str) -> str:
    parts = [f"{prefix.strip()}: {s.totals().steps} steps in {s.totals().duration_s:.0f} s" for prefix, s in named]
    return f"{name}\n{len(named)} runs on one time axis  ·  " + "  ·  ".join(parts)


def _save(fig: Any, axes: Any, out: Path) -> RenderedReport:
    png = io.BytesIO()
    fig.savefig(png, dpi=_DPI, format="png")  # drawn whole first: the file is replaced only by a complete image
    try:
        write_output(out, png.getvalue(), what="--output")  # never through another user's link (exit 78)
    except OSError as err:
        raise ConfigError(f"cannot write the report: {err.strerror or err}", path=(str(out),)) from None
    width, height = fig.canvas.get_width_height()
    boxes, labels, tops = {}, {}, {}
    for name, ax in zip(PANELS, axes):
        x0, y0, x1, y1 = ax.get_window_extent().extents  # display pixels, origin bottom-left
        boxes[name] = (int(x0), int(height - y1), int(x1), int(height - y0))
        legend = ax.get_legend()
        labels[name] = tuple(t.get_text() for t in legend.get_texts()) if legend is not None else ()
        ys = [np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()]
        finite = np.concatenate([y[np.isfinite(y)] for y in ys]) if ys else np.empty(0)
        tops[name] = float(finite.max()) if finite.size else float("nan")
    return RenderedReport(out, width, height, boxes, labels, float(axes[-1].get_xlim()[1]), tops)


def main_report(args: argparse.Namespace) -> int:
    """``melfeed report METRICS.jsonl [METRICS.jsonl ...] -o PNG [--title T]``; 0 on success, 78 on
    bad input. Several files (the ranks of one job) share the panels on one time axis."""
    _import_pyplot()  # before reading: a missing extra is the only message
    paths = [args.metrics] if isinstance(args.metrics, str) else list(args.metrics)
    check_not_an_input(args.output, paths, "--output")  # `report m.jsonl -o m.jsonl` would overwrite the data
    runs = [read_metrics(path) for path in paths]
    title = args.title or ", ".join(Path(path).name for path in paths)
    rendered = render_report(runs, args.output, title)
    span_s = max(float(s.t_s[-1]) + s.t0_unix_s for s in runs) - min(s.t0_unix_s for s in runs)
    files = f" from {len(runs)} files" if len(runs) > 1 else ""
    print(
        f"report: {sum(len(s) for s in runs)} snapshots{files} over {span_s:.0f} s, "
        f"{rendered.width_px}x{rendered.height_px} px -> {rendered.path}"
    )
    return 0
