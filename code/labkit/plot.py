"""One plotting path for every lab: ledger timelines and residency schedules.

``plot_timeline`` draws device bytes as a stacked area by category over the ledger's events, with
the phases as coloured bands, the CUDA allocator's own counters as lines when they were sampled,
and an optional analytic prediction drawn over the measurement. ``save`` writes PNG (notebooks)
or SVG (pages) by the file's suffix.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import matplotlib.transforms as transforms
from matplotlib.patches import Patch

from labkit.table import UNITS, pick_unit
from labkit.timeline import CATEGORIES, Timeline

CATEGORY_COLORS = {
    "parameters": "#4C72B0",
    "frozen_weights": "#64B5CD",
    "quant_constants": "#2E4A7D",
    "gradients": "#DD8452",
    "optimizer_state": "#8172B3",
    "kv_cache": "#CCB974",
    "activations": "#55A868",
    "dequantized": "#F2A7A9",
    "temporaries": "#C44E52",
    "host_copies": "#937860",
    "communication": "#DA8BC3",
    "other": "#8C8C8C",
}

PHASE_COLORS = {
    "encode": "#c6dbef",
    "denoise": "#fdd0a2",
    "decode": "#c7e9c0",
    "install": "#eeeeee",
    "remove": "#eeeeee",
    "forward": "#9ecae1",
    "backward": "#fdae6b",
    "optimizer": "#bcbddc",
    "transfer": "#fee391",  # its own colour: decode is green
    "zero_grad": "#d9d9d9",
}

def plot_timeline(
    tl: Timeline,
    ax=None,
    title: str | None = None,
    overlay: Mapping[str, Sequence[float]] | None = None,
    scope: str = "device",
    show_allocator: bool = True,
    max_points: int = 300,
    legend: bool = True,
    unit: str | None = None,
    ymax_bytes: float | None = None,
):
    """Stacked area of live bytes by category with phase bands; returns the figure.

    ``tl``: the ledger's timeline; ``ax``: draw into these axes (default: a new figure);
    ``title``: above the plot; ``overlay``: name -> one value per row, drawn dashed over the
    measurement (a derived prediction); ``scope``: ``device`` or ``host`` bytes;
    ``show_allocator``: draw the CUDA allocator's sampled counters when the run has them;
    ``max_points``: rows kept (every local peak survives, see :func:`decimate`); ``legend``: draw
    one; ``unit``/``ymax_bytes``: fix the axis, so that several figures compare at a glance.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 4.2), dpi=110, layout="constrained")
    else:
        fig = ax.figure
    columns = tl.device if scope == "device" else tl.host
    cats = [c for c in CATEGORIES if any(columns[c])]
    rows = decimate([sum(columns[c][i] for c in cats) for i in range(len(tl))], max_points)
    x = rows  # event indices kept; every local maximum of the total survives
    peak = max((sum(columns[c][i] for c in cats) for i in x), default=0)
    extra = []
    if show_allocator and tl.cuda_allocated:
        extra = tl.cuda_reserved
    if overlay:
        extra = extra + [v for ys in overlay.values() for v in ys]
    top_bytes = ymax_bytes or max([peak, *extra], default=1)
    unit, size = (unit, dict(UNITS)[unit]) if unit else pick_unit(top_bytes)

    # phase bands (named in the legend) and one "step N" label where each step begins
    step_start: dict[int, int] = {}
    for span in tl.spans:
        if span.step is not None:
            step_start[span.step] = min(step_start.get(span.step, span.start), span.start)
        if span.end > span.start:
            color = PHASE_COLORS.get(span.name, "#eeeeee")
            ax.axvspan(span.start - 0.5, span.end - 0.5, color=color, alpha=0.35, lw=0, zorder=0)
    if len(step_start) <= 24:
        for step, start in step_start.items():
            ax.axvline(start - 0.5, color="#555555", lw=0.6, zorder=1)
            ax.text(start, 1.0, f" step {step}", transform=ax.get_xaxis_transform(), ha="left",
                    va="bottom", fontsize=7.5, color="#333333")

    bottom = [0.0] * len(x)
    for c in cats:
        top = [b + columns[c][i] / size for b, i in zip(bottom, x)]
        ax.fill_between(x, bottom, top, step="post", color=CATEGORY_COLORS[c], lw=0, label=c.replace("_", " "),
                        zorder=2, rasterized=len(x) > 100)  # SVGs stay small: areas as pixels, text as text
        bottom = top
    if show_allocator and tl.cuda_allocated and scope == "device":
        ax.step(x, [tl.cuda_allocated[i] / size for i in x], where="post", color="black", lw=1.0,
                label="cuda memory_allocated", zorder=3)
        ax.step(x, [tl.cuda_reserved[i] / size for i in x], where="post", color="black", lw=1.0, ls=":",
                label="cuda memory_reserved", zorder=3)
    for k, (name, ys) in enumerate((overlay or {}).items()):
        ax.step(x, [ys[i] / size for i in x], where="post", lw=1.6, ls="--",
                color=("#111111", "#d62728", "#17becf")[k % 3], label=name, zorder=4)

    ax.set_xlim(-0.5, max(len(tl) - 0.5, 0.5))
    ax.set_ylim(0, top_bytes / size * 1.12 + 1e-9)
    ax.set_xlabel("ledger events (every allocation and free, in order)")
    ax.set_ylabel(f"live {scope} bytes ({unit})")
    if title:
        ax.set_title(title, loc="left", fontsize=10, pad=14)
    if legend:
        handles, labels = ax.get_legend_handles_labels()
        phase_names = [n for n in dict.fromkeys(s.name for s in tl.spans)]
        handles += [Patch(color=PHASE_COLORS.get(n, "#eeeeee"), alpha=0.35, label=f"phase: {n}") for n in phase_names]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3, zorder=1)
    return fig


def decimate(values: Sequence[float], max_points: int) -> list[int]:
    """Indices to plot: all of them if few, else per bucket the first row and the highest row.

    Keeping each bucket's maximum means no peak disappears from a figure, whatever its width.
    """
    n = len(values)
    if n <= max_points:
        return list(range(n))
    buckets = max_points // 2
    keep = set()
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        keep.add(lo)
        keep.add(max(range(lo, hi), key=values.__getitem__))
    keep.add(n - 1)
    return sorted(keep)


# ---------------------------------------------------------------------------------- the page style
#: Every figure a page shows is laid out for a phone first: one column of panels this wide, text no
#: smaller than MIN_FONT_PT. Shown at its natural width on a desktop (about 500 CSS px) and scaled
#: to a 390-px phone's content width (about 350 px), 12-pt text stays at 11 CSS px or more.
PAGE_WIDTH_IN = 5.2
MIN_FONT_PT = 13.0
PANEL_HEIGHT_IN = 3.1
LEGEND_GAP_IN = 0.62  # from the axes' bottom to a legend under them: below the tick labels and the x label
TITLE_WRAP = 44  # at most, characters of a title per line (fewer over a narrow plot)
LABEL_WRAP = 48  # at most, the same for an axis label
LEGEND_WRAP = 34  # characters of a legend label per line, at MIN_FONT_PT under a PAGE_WIDTH_IN plot


def page_layout(fig) -> None:
    """Re-lay a figure for the page: panels in one column, PAGE_WIDTH_IN wide, text at MIN_FONT_PT
    or more, legends that sat beside the plot moved under it. Notebooks draw as they like; what a
    page shows passes through here (:func:`save` calls it for SVG), so every figure on the site
    reads on a phone."""
    import matplotlib.gridspec as gridspec
    from matplotlib.text import Text

    groups: dict[tuple, list] = {}
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        if spec is None:
            continue
        rows, cols = spec.rowspan, spec.colspan
        groups.setdefault((rows.start, cols.start, rows.stop, cols.stop, id(spec.get_gridspec())), []).append(ax)
    panels = sorted(groups)
    if len(panels) > 1 and len({key[1] for key in panels}) > 1:  # side by side: stack them
        grid = gridspec.GridSpec(len(panels), 1, figure=fig)
        for k, key in enumerate(panels):
            for ax in groups[key]:
                ax.set_subplotspec(grid[k, 0])
                if len(ax.get_shared_y_axes().get_siblings(ax)) > 1:
                    ax.tick_params(axis="y", labelleft=True)  # a shared y axis is no longer beside its twin
    n_rows = len({key[0] for key in panels}) if len({key[1] for key in panels}) == 1 else len(panels)
    # Legends beside a plot go under it, one column (labels are long, phones narrow), their labels
    # wrapped so that a legend is never wider than its plot; the figure grows by their height.
    beside = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None and legend.get_bbox_to_anchor().transformed(ax.transAxes.inverted()).x0 >= 1.0:
            labels = [textwrap.fill(t.get_text(), LEGEND_WRAP) for t in legend.get_texts()]
            beside.append((ax, legend.legend_handles, labels))
            legend.remove()
    line_in = MIN_FONT_PT * 1.45 / 72
    extra = sum(sum(label.count("\n") + 1 for label in labels) * line_in + LEGEND_GAP_IN for _, _, labels in beside)
    width, height = fig.get_size_inches()
    new_height = max(height * PAGE_WIDTH_IN / width, PANEL_HEIGHT_IN * max(n_rows, 1)) + extra
    fig.set_size_inches(PAGE_WIDTH_IN, new_height)
    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < MIN_FONT_PT:
            text.set_fontsize(MIN_FONT_PT)
    for ax in fig.axes:  # tick labels are made at draw time, from the axis' own size
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":  # 10^3 sets its exponent small: plain numbers read on a phone
                axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))  # 8192, 1e+12: short
                axis.set_minor_formatter(ticker.NullFormatter())
            # Always through set_tick_params: it also sets the size of ticks made later (a taller
            # plot gets more of them at save time; they would otherwise start at the rc default).
            ticks = axis.get_major_ticks()[:1]
            size = max([MIN_FONT_PT] + [t.label1.get_fontsize() for t in ticks])
            axis.set_tick_params(which="both", labelsize=size)
        legend = ax.get_legend()
        if legend is not None:
            for text in legend.get_texts():
                text.set_fontsize(max(text.get_fontsize(), MIN_FONT_PT))
    fig.draw_without_rendering()  # where each plot sits, so that its texts wrap to its own width
    char_in = 0.6 * MIN_FONT_PT / 72  # the width of a character at MIN_FONT_PT, about
    for ax in fig.axes:  # a long title or label wraps to its plot rather than widen the figure
        box = ax.get_position()
        across = max(16, min(TITLE_WRAP, int(box.width * fig.get_figwidth() / char_in)))
        down = max(16, min(LABEL_WRAP, int(box.height * fig.get_figheight() / char_in)))
        for text, width in ((ax.title, across), (ax._left_title, across), (ax._right_title, across),
                            (ax.xaxis.label, across), (ax.yaxis.label, down)):
            if len(text.get_text()) > width:
                text.set_text(textwrap.fill(text.get_text(), width))
    for legend in list(fig.legends):  # a figure's own legend: one column of wrapped labels, at its foot
        handles, labels = legend.legend_handles, [textwrap.fill(t.get_text(), LEGEND_WRAP) for t in legend.get_texts()]
        legend.remove()
        fig.legend(handles, labels, loc="outside lower left", ncols=1, frameon=False, fontsize=MIN_FONT_PT,
                   handlelength=1.2)
        fig.set_size_inches(PAGE_WIDTH_IN, fig.get_size_inches()[1] + len(labels) * line_in)
    for ax in fig.axes:  # a legend of several columns, or of long labels, becomes one column under its plot
        legend = ax.get_legend()
        long_labels = legend is not None and any(len(t.get_text()) > LEGEND_WRAP for t in legend.get_texts())
        if legend is not None and (legend._ncols > 1 or long_labels) and not any(ax is b[0] for b in beside):
            labels = [textwrap.fill(t.get_text(), LEGEND_WRAP) for t in legend.get_texts()]
            beside.append((ax, legend.legend_handles, labels))
            legend.remove()
            fig.set_size_inches(PAGE_WIDTH_IN, fig.get_size_inches()[1] + len(labels) * line_in)
    for ax, handles, labels in beside:  # under the x label, a fixed distance below the axes, from the
        # figure's left edge (a plot pushed right by long tick labels would push its legend off the page)
        under = transforms.offset_copy(ax.transAxes, fig=fig, x=0, y=-LEGEND_GAP_IN, units="inches")
        anchor = transforms.blended_transform_factory(fig.transFigure, under)
        ax.legend(handles=handles, labels=labels, loc="upper left", bbox_to_anchor=(0.01, 0), bbox_transform=anchor,
                  ncols=1, frameon=False, fontsize=MIN_FONT_PT, handlelength=1.2, borderaxespad=0.0)


def save(fig, path: str | os.PathLike) -> Path:
    """Write a figure as PNG or SVG (by suffix), creating folders, all or nothing
    (:mod:`labkit.files`); SVG text stays text. An SVG (what pages show) is laid out for the page
    first (:func:`page_layout`) and has a transparent background, so the site's dark palette shows
    through (the stylesheet inverts its ink there)."""
    from labkit.files import atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    svg = path.suffix == ".svg"
    if svg:
        page_layout(fig)
    kwargs = {"metadata": {"Date": None}} if svg else {"metadata": {"Software": None}}
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "infralab"}), atomic(path, "wb") as f:
        fig.savefig(f, format=path.suffix.lstrip("."), bbox_inches="tight", dpi=160,
                    facecolor="none" if svg else "white", transparent=svg, **kwargs)
    return path


def plot_gantt(bars, ax=None, title: str | None = None, unit_colors: Mapping[str, str] | None = None):
    """Compute stream against copy stream: one row per lane, one bar per transfer or compute.

    ``bars``: :class:`labkit.schedule.Bar` (``Recorder.intervals()``); ``ax``: draw into these
    axes (default: a new figure); ``title``: above the plot; ``unit_colors``: stage -> colour.
    Transfers are hatched; a bar's colour says which pipeline stage it belongs to.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 2.6), dpi=110, layout="constrained")
    else:
        fig = ax.figure
    lanes = ["copy", "compute"]
    stages = list(dict.fromkeys(b.stage or "-" for b in bars))
    palette = ["#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52", "#937860"]
    colors = dict(unit_colors or {}) or {s: palette[i % len(palette)] for i, s in enumerate(stages)}
    for bar in bars:
        y = lanes.index(bar.lane) if bar.lane in lanes else len(lanes)
        ax.broken_barh([(bar.start_ms, max(bar.ms, 1e-6))], (y - 0.38, 0.76),
                       facecolors=colors.get(bar.stage or "-", "#999999"),
                       edgecolor="black" if bar.kind == "transfer" else "none", linewidth=0.4,
                       hatch="////" if bar.kind == "transfer" else None, alpha=0.85 if bar.kind == "compute" else 0.55)
    ax.set_yticks(range(len(lanes)), [f"{lane} stream" for lane in lanes])
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=colors[s], label=f"stage: {s}") for s in stages]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="////", label="transfer (host to device)"),
                Patch(facecolor="#bbbbbb", label="compute (solid)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return fig
