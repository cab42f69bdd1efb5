"""One plotting path for every lab: ledger timelines, residency schedules, and the page's figures.

``plot_timeline`` draws device bytes as a stacked area by category over the ledger's events, with
the phases as coloured bands, the CUDA allocator's own counters as lines when they were sampled,
and an optional analytic prediction drawn over the measurement. ``save`` writes PNG as drawn, or
SVG for the pages: laid out twice (:data:`WIDE` for the content column, :data:`PHONE` for a phone,
beside it in ``phone/``), every colour taken from :data:`PALETTE` and written so that the figure
follows the site's light and dark palettes.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from copy import deepcopy
import re
import textwrap
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import matplotlib.transforms as transforms
from cycler import cycler
from matplotlib.patches import Patch

from labkit.table import UNITS, pick_unit
from labkit.timeline import CATEGORIES, Timeline

# ---------------------------------------------------------------------------------------- the palette
#: Every colour a figure may use, by name: (light palette, dark palette). Drawing code hands
#: matplotlib the light value (``SERIES[0]``, ``CATEGORY_COLORS["parameters"]``, ``INK``); :func:`save`
#: writes each colour it finds as a CSS variable that holds the light value, and the dark one under
#: ``@media (prefers-color-scheme: dark)``. An SVG shown through ``<img>`` answers that query with
#: the page's ``color-scheme``, which Material's slate palette sets to ``dark``: one file follows the
#: site's toggle (opened on its own, it follows the browser's). Every graphic colour has 3:1 contrast
#: or more against its palette's page background, the inks 4.5:1 (``tests/test_palette.py``).
#: Black is read as ink and white as paper, so ``"k--"`` draws in ink on both palettes.
PALETTE: dict[str, tuple[str, str]] = {
    "blue": ("#3a6fc4", "#7fa8f0"),
    "orange": ("#c8600f", "#f29a52"),
    "green": ("#2f8a46", "#6cc785"),
    "red": ("#cc3b3b", "#f27c78"),
    "purple": ("#7e5cc4", "#b49af0"),
    "brown": ("#8d6442", "#c9a07a"),
    "pink": ("#c2449a", "#f08cc8"),
    "grey": ("#737373", "#a3a3a3"),
    "gold": ("#9c7c00", "#e0c04f"),
    "teal": ("#1a8a99", "#5cc8d6"),
    "steel": ("#4f6f8f", "#9db7d1"),  # Lab 15's frozen weights
    "indigo": ("#3d4ab8", "#9aa3f5"),  # Lab 15's quantization constants
    "olive": ("#6f7f12", "#b8cc52"),  # Lab 15's dequantized weights
    "ink": ("#1f2328", "#e6e8ec"),  # text, axes, and every line that would be black
    "ink_muted": ("#5b616b", "#a7adb8"),  # secondary text, ticks, grid
    "paper": ("#ffffff", "#1e2129"),  # the page itself: legend frames, the ground under a hatch
}
#: The page background of each palette: Material's default (white) and slate (hsl(225 15% 14%)).
BACKGROUND = {"light": PALETTE["paper"][0], "dark": PALETTE["paper"][1]}
INK, INK_MUTED, PAPER = (PALETTE[name][0] for name in ("ink", "ink_muted", "paper"))
#: A colour cycle for lines and bars that are not ledger categories, in matplotlib's tab10 order of
#: hues: blue, orange, green, red, purple, brown, pink, grey, gold, teal.
SERIES = [PALETTE[name][0] for name in ("blue", "orange", "green", "red", "purple", "brown", "pink", "grey", "gold", "teal")]
_HUE = dict(zip(("blue", "orange", "green", "red", "purple", "brown", "pink", "grey", "gold", "teal"), SERIES))

CATEGORY_COLORS = {
    "parameters": _HUE["blue"],
    "frozen_weights": PALETTE["steel"][0],  # weights no gradient reaches (Lab 15): a greyed blue
    "quant_constants": PALETTE["indigo"][0],
    "gradients": _HUE["orange"],
    "optimizer_state": _HUE["purple"],
    "kv_cache": _HUE["gold"],
    "activations": _HUE["green"],
    "dequantized": PALETTE["olive"][0],
    "temporaries": _HUE["red"],
    "host_copies": _HUE["brown"],
    "communication": _HUE["pink"],
    "other": _HUE["grey"],
}

PHASE_COLORS = {  # a pipeline's phases take hues its timelines' categories do not (no optimizer state, no KV cache)
    "encode": _HUE["purple"],
    "denoise": _HUE["teal"],
    "decode": _HUE["gold"],
    "install": _HUE["grey"],
    "remove": _HUE["grey"],
    "forward": _HUE["teal"],
    "backward": _HUE["orange"],  # it makes the gradients
    "optimizer": _HUE["purple"],  # it makes the optimizer state
    "transfer": _HUE["brown"],  # to and from the host
    "zero_grad": _HUE["grey"],
}
PHASE_TINT = 0.12  # a phase's band behind the data; its colour at full strength is the strip along the top

#: matplotlib's defaults, in the palette: applied when labkit.plot is imported.
STYLE = {
    "axes.prop_cycle": cycler(color=SERIES),
    "text.color": INK,
    "axes.labelcolor": INK,
    "axes.edgecolor": INK_MUTED,
    "axes.facecolor": PAPER,
    "figure.facecolor": PAPER,
    "figure.edgecolor": PAPER,
    "xtick.color": INK_MUTED,
    "ytick.color": INK_MUTED,
    "xtick.labelcolor": INK,
    "ytick.labelcolor": INK,
    "grid.color": INK_MUTED,
    "grid.alpha": 0.3,
    "legend.facecolor": PAPER,
    "legend.edgecolor": INK_MUTED,
    "lines.color": INK,
    "patch.edgecolor": INK,
    "patch.facecolor": SERIES[0],
    "hatch.color": INK,
}
plt.rcParams.update(STYLE)


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

    # Each phase: a faint band behind the data and a strip of its full colour along the top (what
    # the legend's patch shows); one "step N" label where each step begins, under the strip, in the
    # headroom above the data.
    step_start: dict[int, int] = {}
    strip = ax.get_xaxis_transform()
    for span in tl.spans:
        if span.step is not None:
            step_start[span.step] = min(step_start.get(span.step, span.start), span.start)
        if span.end > span.start:
            color = PHASE_COLORS.get(span.name, INK_MUTED)
            ax.axvspan(span.start - 0.5, span.end - 0.5, color=color, alpha=PHASE_TINT, lw=0, zorder=0)
            ax.axvspan(span.start - 0.5, span.end - 0.5, ymin=0.965, ymax=1.0, color=color, lw=0, zorder=2.5)
    if len(step_start) <= 24:
        for step, start in step_start.items():
            ax.axvline(start - 0.5, color=INK_MUTED, lw=0.6, zorder=1)
            ax.text(start, 0.95, f" step {step}", transform=strip, ha="left", va="top", fontsize=7.5, color=INK_MUTED)

    # The stack, drawn as areas from zero, the tallest first: each area's outline is one line (its
    # top), half the points of a band between two lines, and the SVG stays vector and small.
    handles = ax.get_legend_handles_labels()[0]  # what the caller drew and labelled first comes first
    tops, running = [], [0.0] * len(x)
    for c in cats:
        running = [r + columns[c][i] / size for r, i in zip(running, x)]
        tops.append((c, running))
    areas = {c: ax.fill_between(x, 0, top, step="post", color=CATEGORY_COLORS[c], lw=0, zorder=2,
                                label=c.replace("_", " ")) for c, top in reversed(tops)}
    handles += [areas[c] for c in cats]
    if show_allocator and tl.cuda_allocated and scope == "device":
        handles += ax.step(x, [tl.cuda_allocated[i] / size for i in x], where="post", color=INK, lw=1.0,
                           label="cuda memory_allocated", zorder=3)
        handles += ax.step(x, [tl.cuda_reserved[i] / size for i in x], where="post", color=INK, lw=1.0, ls=":",
                           label="cuda memory_reserved", zorder=3)
    for k, (name, ys) in enumerate((overlay or {}).items()):
        handles += ax.step(x, [ys[i] / size for i in x], where="post", lw=1.6, ls="--",
                           color=(INK, _HUE["red"], _HUE["teal"])[k % 3], label=name, zorder=4)

    ax.set_xlim(-0.5, max(len(tl) - 0.5, 0.5))
    ax.set_ylim(0, top_bytes / size * 1.16 + 1e-9)
    ax.set_xlabel("ledger events (every allocation and free, in order)")
    ax.set_ylabel(f"live {scope} bytes ({unit})")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    if legend:
        phase_names = [n for n in dict.fromkeys(s.name for s in tl.spans)]
        handles += [Patch(color=PHASE_COLORS.get(n, INK_MUTED), label=f"phase: {n}") for n in phase_names]
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


# -------------------------------------------------------------------------------------- the page layout
@dataclass(frozen=True)
class Layout:
    """How the pages show a figure at one width.

    ``width_in``: the figure's width (an SVG shown at its natural size has 96 CSS px to the inch);
    ``font_pt``: no text smaller; ``columns``: panels side by side, at most; ``panel_in`` and
    ``max_panel_in``: a plot's height, at least and at most (between them it keeps the proportions
    it was drawn with); ``beside``: a single plot's legend goes beside it, not under it.
    """

    name: str
    width_in: float
    font_pt: float
    columns: int
    panel_in: float
    max_panel_in: float
    beside: bool

    @property
    def char_in(self) -> float:
        """The width of an average character at ``font_pt``."""
        return 0.6 * self.font_pt / 72


#: The content column at 1,280 px (688 CSS px): panels two by two, a single plot's legend beside it.
#: Text at 11 pt is 14.7 CSS px; the pages switch to PHONE before it would shrink under 12 px.
WIDE = Layout("wide", 688 / 96, 11.0, 2, 2.4, 4.6, True)
#: A phone: one column of plots, each legend under its plot. 5.2 in (499 CSS px) is shown about 350 px
#: wide at 390 px, so 13-pt text reads at 12 CSS px.
PHONE = Layout("phone", 5.2, 13.0, 1, 2.7, 4.6, False)
#: A diagram drawn for the phone first (scripts/figures/: boxes and words placed in inches) is drawn
#: at PHONE's width and text size; save widens it for the page as it does any figure.
PAGE_WIDTH_IN = PHONE.width_in
MIN_FONT_PT = PHONE.font_pt
#: Where a page shows PHONE instead of WIDE (a ``<picture>``'s source; scripts/mkdocs_hooks.py).
PHONE_MEDIA = "(max-width: 37.5em)"
SAVE_PAD_IN = 0.03  # the margin save() leaves around what a figure draws
LEGEND_BESIDE_WRAP = 24  # characters per line of a legend beside its plot (WIDE: 2.2 in of 7.2)


def _panels(fig) -> list[list]:
    """The figure's plots, in reading order: each a list of the axes that share one grid cell (a
    twin with its host, the host first). Axes outside any grid (an inset) are left alone."""
    cells: dict[tuple, list] = {}
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        if spec is None or not ax.axison and ax.get_label() == "legend":
            continue
        cells.setdefault((spec.rowspan.start, spec.colspan.start, id(spec.get_gridspec())), []).append(ax)
    return [cells[key] for key in sorted(cells, key=lambda k: (k[0], k[1]))]


def _legend_parts(legend) -> tuple[list, list[str], str]:
    title = legend.get_title().get_text()
    return list(legend.legend_handles), [t.get_text() for t in legend.get_texts()], title


def _outside(legend, ax) -> bool:
    """Whether a legend sits outside its plot (beside or under it) rather than on it."""
    box, plot = legend.get_window_extent(), ax.bbox
    w = max(0.0, min(box.x1, plot.x1) - max(box.x0, plot.x0))
    h = max(0.0, min(box.y1, plot.y1) - max(box.y0, plot.y0))
    return w * h < 0.5 * box.width * box.height


def _wrap(labels: list[str], width: int) -> list[str]:
    return [textwrap.fill(label, max(12, width), break_on_hyphens=False) for label in labels]


def _plain(value: float, _=None) -> str:
    """A log axis' number as a phone reads it: 200, 8192, 1e6 (not 10^3 in small type)."""
    return f"{value:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def _untangle_ticks(ax, renderer) -> None:
    """Names along an x axis that run into each other at the page's text size (bars side by side,
    two plots to a row) turn 30 degrees, each ending under its tick."""
    labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
    space = 0.25 * labels[0].get_fontsize() * ax.figure.dpi / 72 if labels else 0
    if any(a.x1 + space > b.x0 for a, b in zip(boxes, boxes[1:])):
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
            label.set_rotation_mode("anchor")


def _legend_kwargs(layout: Layout) -> dict:
    return dict(frameon=False, fontsize=layout.font_pt, title_fontsize=layout.font_pt, handlelength=1.3,
                handletextpad=0.5, labelspacing=0.35, borderaxespad=0.0, borderpad=0.0)


def page_layout(fig, layout: Layout = WIDE) -> None:
    """Re-lay a figure for a page at ``layout``'s width: its plots in a grid of ``layout.columns``
    (two on the wide page, one on a phone), text at ``layout.font_pt`` or more, titles and labels
    wrapped to their plot, and every legend beside or directly under the data it describes.

    Legends: a single plot's legend drawn beside it stays beside it on the wide page and goes under
    it on a phone. Of several plots side by side, when there are fewer legends than plots (they
    speak for several) or one legend repeated, the legends drawn outside them become one (each entry
    once), in the grid's empty cell if it has one, else right under the grid; on a phone, a legend
    shared by several plots (the figure's own, or the only one) goes under the first plot. Every
    other legend outside its plot goes under it. A legend on its plot stays there unless it is long
    or, at the page's text size, would cover an eighth of it. Each plot is ``layout.panel_in`` to
    ``layout.max_panel_in`` tall, so no panel is taller than a screen. :func:`save` lays out every
    SVG it writes twice, WIDE and PHONE.
    """
    import matplotlib.gridspec as gridspec
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    fig_w = layout.width_in - 2 * SAVE_PAD_IN  # saved with its margin, the figure is width_in wide
    if not hasattr(fig.canvas, "get_renderer"):  # unpickled in a kernel: a canvas that measures text
        FigureCanvasAgg(fig)
    panels = _panels(fig)
    if not panels:  # a diagram on axes placed by hand (fig.add_axes): no grid to lay out; narrowed to the
        # width if wider, never widened (its boxes would grow and its words would not), and narrowed again
        # by what its words reach past its edges (they keep their size as its boxes shrink)
        width = min(fig_w, fig.get_figwidth())
        for _ in range(3):
            fig.set_size_inches(width, width * fig.get_figheight() / fig.get_figwidth())
            box = fig.get_tightbbox(fig.canvas.get_renderer())
            if box.width <= fig_w:
                break
            width -= box.width - fig_w + 0.02
        return
    if fig.get_layout_engine() is None or type(fig.get_layout_engine()).__name__ != "ConstrainedLayoutEngine":
        fig.set_layout_engine("constrained")
    fig.get_layout_engine().set(w_pad=0.04, h_pad=0.06, wspace=0.06, hspace=0.06)
    with warnings.catch_warnings():  # a legend drawn beside a narrow plot may squeeze it to nothing: it moves below
        warnings.filterwarnings("ignore", "constrained_layout not applied", UserWarning)
        fig.draw_without_rendering()  # as drawn: each plot's proportions, and where its legend sits
    aspect = [max(ax.bbox.height / max(ax.bbox.width, 1.0) for ax in panel) for panel in panels]

    # Legends: taken off now, put back once the plots have their places.
    shared = [_legend_parts(legend) for legend in fig.legends]
    for legend in list(fig.legends):
        legend.remove()
    own: dict[int, tuple] = {}  # panel -> (axes, parts, where: "on" | "out")
    for k, panel in enumerate(panels):
        for ax in panel:
            legend = ax.get_legend()
            if legend is not None:
                handles, labels, title = _legend_parts(legend)
                box = legend.get_window_extent()  # at the size it was drawn; it grows with its text
                grow = max(1.0, layout.font_pt / min([t.get_fontsize() for t in legend.get_texts()] or [layout.font_pt]))
                big = box.width * box.height * grow**2 > 0.12 * ax.bbox.width * ax.bbox.height  # it would hide data
                long = legend._ncols > 1 or len(labels) > 6 or any(len(t) > 28 for t in labels) or big
                own[k] = (ax, (handles, labels, title), "out" if _outside(legend, ax) or long else "on")
                if own[k][2] == "out":
                    legend.remove()
    out = [k for k, (_, _, where) in own.items() if where == "out"]
    repeated = len(out) > 1 and len({tuple(own[k][1][1]) for k in out}) == 1  # the same legend on each plot
    if len(panels) > 1 and layout.columns > 1 and out and (len(own) < len(panels) or repeated):
        # Legends that speak for several plots (fewer legends than plots, or one repeated), under one
        # plot each, would leave holes in the grid: they become one, in the grid's empty cell or under it.
        merged: dict[str, object] = {}
        for handles, labels, _ in [*shared, *(own.pop(k)[1] for k in out)]:
            for handle, label in zip(handles, labels):
                merged.setdefault(label, handle)
        shared = [(list(merged.values()), list(merged), "")]
    elif len(panels) > 1 and not shared and len(own) == 1 and out:
        shared = [own.popitem()[1][1]]  # one legend outside one of several plots speaks for all of them
    elif repeated:  # one column: the same legend once, under the first plot that has it
        for k in out[1:]:
            own.pop(k)

    # The grid.
    n = len(panels)
    cols = max(1, min(layout.columns, n))
    rows = math.ceil(n / cols)
    grid = gridspec.GridSpec(rows, cols, figure=fig)
    lowest = {k % cols: k for k in range(n)}  # the last plot of each column
    for k, panel in enumerate(panels):
        r, c = divmod(k, cols)
        for ax in panel:
            ax.set_subplotspec(grid[r, c])
        host = panel[0]
        others = {id(ax) for p in panels if p is not panel for ax in p}
        if any(id(a) in others for a in host.get_shared_y_axes().get_siblings(host)):
            host.tick_params(axis="y", labelleft=True)  # beside its twin no more: its own numbers
        shares_x = [a for a in host.get_shared_x_axes().get_siblings(host) if id(a) in others]
        if shares_x and lowest[c] == k:
            host.tick_params(axis="x", labelbottom=True)
            if not host.get_xlabel():
                host.set_xlabel(next((a.get_xlabel() for a in shares_x if a.get_xlabel()), ""))

    # Text: never under the layout's size; log axes in plain numbers.
    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < layout.font_pt:
            text.set_fontsize(layout.font_pt)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":  # 10^3 sets its exponent small: plain numbers read on a phone
                low, high = sorted(abs(v) for v in axis.get_view_interval())
                if isinstance(axis.get_major_locator(), ticker.LogLocator) and 0 < low and high / low < 100:
                    axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))  # under two decades: 200, 500
                axis.set_major_formatter(ticker.FuncFormatter(_plain))
                axis.set_minor_formatter(ticker.NullFormatter())
            # through set_tick_params: ticks made later (a taller plot gets more) take the size too
            size = max([layout.font_pt] + [t.label1.get_fontsize() for t in axis.get_major_ticks()[:1]])
            axis.set_tick_params(which="both", labelsize=size)
        legend = ax.get_legend()
        if legend is not None:
            for text in legend.get_texts():
                text.set_fontsize(max(text.get_fontsize(), layout.font_pt))

    def wrap_texts(draw_after: bool) -> None:
        """A title or label longer than its plot wraps to it rather than widen the figure."""
        fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            for text, room in ((ax.title, ax.bbox.width), (ax._left_title, ax.bbox.width),
                               (ax._right_title, ax.bbox.width), (ax.xaxis.label, ax.bbox.width),
                               (ax.yaxis.label, ax.bbox.height)):
                flat = " ".join(text.get_text().split())
                if not flat:
                    continue
                text.set_text(flat)
                chars = len(flat)
                for _ in range(6):  # narrower until its widest line fits (characters differ in width)
                    box = text.get_window_extent(renderer)
                    length = box.height if text is ax.yaxis.label else box.width
                    if length <= 0.97 * room or chars <= 12:
                        break
                    chars = max(12, min(chars - 1, int(chars * room / length)))
                    text.set_text(textwrap.fill(flat, chars))
            _untangle_ticks(ax, renderer)
        if fig._suptitle is not None:
            fig._suptitle.set_text(textwrap.fill(fig._suptitle.get_text(), int(fig_w / layout.char_in)))
        if draw_after:
            fig.draw_without_rendering()

    fig.set_size_inches(fig_w, rows * (layout.panel_in + 1.3))
    guess = int((fig_w / cols - 0.8) / layout.char_in)  # a first wrap, before any text is measured
    for ax in fig.axes:
        for text in (ax.title, ax._left_title, ax._right_title, ax.xaxis.label):
            flat = " ".join(text.get_text().split())
            text.set_text(textwrap.fill(flat, max(16, guess)) if len(flat) > guess else flat)
    wrap_texts(draw_after=True)  # the x axes' decorations, measured, set where a legend under a plot goes

    renderer = fig.canvas.get_renderer()
    kwargs = _legend_kwargs(layout)
    line_in = layout.font_pt * 1.5 / 72
    grow = 0.0  # the height the legends placed under plots will take

    def lines(labels: list[str], title: str) -> int:
        return sum(label.count("\n") + 1 for label in labels) + bool(title)

    def under(ax, parts) -> None:
        """A legend under its plot: below the x axis' numbers and label, from the plot's left edge."""
        handles, labels, title = parts
        axis = ax.xaxis.get_tightbbox(renderer)
        gap = (ax.bbox.y0 - min(axis.y0, ax.bbox.y0)) / fig.dpi + 0.08 if axis is not None else 0.1
        anchor = transforms.offset_copy(ax.transAxes, fig=fig, x=0, y=-gap, units="inches")
        width = int(ax.bbox.width / fig.dpi / layout.char_in) - 3
        nonlocal grow
        labels = _wrap(labels, width)
        grow += gap + lines(labels, title) * line_in
        ax.legend(handles, labels, title=title or None, loc="upper left", bbox_to_anchor=(0, 0),
                  bbox_transform=anchor, ncols=1, **kwargs)

    for ax, parts, where in list(own.values()):
        if where == "on":
            continue
        if n == 1 and layout.beside:
            handles, labels, title = parts
            ax.legend(handles, _wrap(labels, LEGEND_BESIDE_WRAP), title=title or None, loc="upper left",
                      bbox_to_anchor=(1.03, 1.0), ncols=1, **kwargs)
        else:
            under(ax, parts)
    for handles, labels, title in shared:
        if rows * cols > n:  # the grid's empty cell: beside the plots, in their grid
            cell = fig.add_subplot(grid[rows - 1, cols - 1], label="legend")
            cell.set_axis_off()
            width = int(fig_w / cols / layout.char_in) - 4
            cell.legend(handles, _wrap(labels, width), title=title or None, loc="upper left", bbox_to_anchor=(0, 1),
                        ncols=1, **kwargs)
        elif cols == 1 and 0 not in own:  # a phone: under the first plot, before the rest
            under(panels[0][0], (handles, labels, title))
            own[0] = (panels[0][0], (handles, labels, title), "out")
        else:  # under the grid, in as many columns as fit
            wrapped = _wrap(labels, 30)
            widest = max((len(line) for label in wrapped for line in label.splitlines()), default=1)
            per_column = widest * layout.char_in + 0.6
            ncols = max(1, min(len(labels), int(fig_w / per_column)))
            ncols = math.ceil(len(labels) / math.ceil(len(labels) / ncols))  # balanced columns
            fig.legend(handles, wrapped, title=title or None, loc="outside lower left", ncols=ncols,
                       **(kwargs | {"columnspacing": 1.2}))
            grow += lines(wrapped, title) / ncols * line_in + 0.2
    fig.set_size_inches(fig_w, fig.get_figheight() + grow)

    if any(where == "out" for _, _, where in own.values()) and n == 1 and layout.beside:
        wrap_texts(draw_after=False)  # again: the legend beside the plot made it narrower

    # Heights: each row's plots as tall as their proportions ask, within the layout's bounds; the
    # figure grows by whatever its titles, labels and legends take.
    row_of = [divmod(k, cols)[0] for k in range(n)]
    width_of = [panels[k][0].bbox.width / fig.dpi for k in range(n)]
    target = [layout.panel_in] * rows
    for k in range(n):
        # 0.05 in under the bound: the SVG's text measures a little smaller than Agg's, which lays out
        # here, so the written plot comes out up to 0.03 in taller than measured
        want = min(layout.max_panel_in - 0.05, max(layout.panel_in, aspect[k] * width_of[k]))
        target[row_of[k]] = max(target[row_of[k]], want)
    grid.set_height_ratios(target)
    for _ in range(4):  # the titles, labels and legends keep their size: two rounds or three reach it
        fig.draw_without_rendering()
        actual = [min(panels[k][0].bbox.height for k in range(n) if row_of[k] == r) / fig.dpi for r in range(rows)]
        short = sum(t - a for t, a in zip(target, actual))
        if -0.01 < short < 0.05:  # a little short is close enough; taller than the layout allows is not
            break
        fig.set_size_inches(fig_w, max(1.0, fig.get_figheight() + short))
    box = fig.get_tightbbox(fig.canvas.get_renderer()).transformed(fig.dpi_scale_trans.inverted())
    if box.x0 < -0.01 or box.x1 > fig_w + 0.01:  # the heights moved a plot under a title: wrap again
        wrap_texts(draw_after=True)


# ------------------------------------------------------------------------------------ SVG in the palette
_HEX = re.compile(r"#[0-9a-fA-F]{6}\b")
_ATTR_COLOR = re.compile(r'\s(fill|stroke)="(#[0-9a-fA-F]{6})"')
_STYLE = re.compile(r'\sstyle="([^"]*)"')
_NUMBER = re.compile(r"-?\d+\.\d+")
_ALIASES = {"#000000": "ink", "#ffffff": "paper"}  # black is ink, white is paper
PALETTE_STYLE_ID = "il-palette"


def _var(name: str) -> str:
    return f"--il-{name.replace('_', '-')}"


def palette_css(names, light_selector: str = ":root", dark_selector: str | None = None, extra: str = "") -> str:
    """The palette's CSS for ``names``: light values on ``light_selector`` (with ``extra``
    declarations, which see the values of the same element), dark ones on ``dark_selector``, or
    under ``prefers-color-scheme: dark`` on the same element."""
    light = ";".join([f"{_var(n)}:{PALETTE[n][0]}" for n in names] + ([extra] if extra else []))
    dark = ";".join(f"{_var(n)}:{PALETTE[n][1]}" for n in names)
    if dark_selector:
        return f"{light_selector}{{{light}}}{dark_selector}{{{dark}}}"
    return f"{light_selector}{{{light}}}@media (prefers-color-scheme:dark){{{light_selector}{{{dark}}}}}"


def palette_name(color: str) -> str:
    """The palette's name of a colour drawing code uses (its light value): ``palette_name(SERIES[0])``
    is ``"blue"``. KeyError for a colour outside the palette."""
    return {light.lower(): name for name, (light, _) in PALETTE.items()}[color.lower()]


def site_css() -> str:
    """The palette as the site's CSS variables, for the default and the slate palette: ``--il-blue``
    and so on, and ``--il-cat-parameters`` and so on for the ledger's categories (declared where the
    palette's are, so that each takes the value of the palette in force there)."""
    categories = ";".join(f"--il-cat-{c.replace('_', '-')}:var({_var(palette_name(v))})" for c, v in CATEGORY_COLORS.items())
    return (palette_css(PALETTE, ":root,[data-md-color-scheme=default]", "[data-md-color-scheme=slate]")
            + f":root,[data-md-color-scheme]{{{categories}}}")


def themed_svg(svg: str) -> str:
    """A matplotlib SVG whose every colour is a palette variable: ``fill: #3a6fc4`` becomes
    ``fill: var(--il-blue)``, and a style block at the top holds each variable's light value and,
    under ``prefers-color-scheme: dark``, its dark one. Paths are written to 0.1 pt, without
    matplotlib's metadata or indentation.

    Raises ValueError for a colour outside :data:`PALETTE` (black and white read as ink and paper)
    and for a raster image, whose colours no style can change."""
    if "<image" in svg:
        raise ValueError("the figure holds a raster image (rasterized=True, imshow): its colours cannot follow "
                         "the site's palette; draw it as vectors")
    by_hex = {light.lower(): name for name, (light, _) in PALETTE.items()} | _ALIASES
    used, unknown = {"ink"}, set()

    def to_var(m: re.Match) -> str:
        name = by_hex.get(m.group(0).lower())
        if name is None:
            unknown.add(m.group(0).lower())
            return m.group(0)
        used.add(name)
        return f"var({_var(name)})"

    def tag(m: re.Match) -> str:
        text = m.group(0)
        moved = [f"{k}: {v}" for k, v in _ATTR_COLOR.findall(text)]  # a hatch's ground: an attribute
        if moved:
            text = _ATTR_COLOR.sub("", text)
            if _STYLE.search(text):
                text = _STYLE.sub(lambda s: f' style="{s.group(1)}; {"; ".join(moved)}"', text, count=1)
            else:
                text = text.replace(" ", f' style="{"; ".join(moved)}" ', 1)
        return _STYLE.sub(lambda s: f' style="{_HEX.sub(to_var, s.group(1))}"', text)

    svg = re.sub(r"<[a-zA-Z][^<>]*>", tag, svg)
    if unknown:
        raise ValueError(f"the figure draws in {', '.join(sorted(unknown))}, outside labkit.plot's palette: "
                         "colour it with SERIES, CATEGORY_COLORS, PHASE_COLORS, INK or INK_MUTED")
    svg = re.sub(r'\sd="([^"]*)"', lambda m: f' d="{_short_path(m.group(1))}"', svg)
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)  # matplotlib's name and version
    svg = re.sub(r">\n\s*<", ">\n<", svg)  # no indentation (text content is on one line, untouched)
    svg = _fewer_elements(svg)
    families = set(_FONT.findall(svg))
    svg = _FONT.sub("", svg)  # one font family for all text, said once in the style block
    order = [n for n in PALETTE if n in used]
    css = palette_css(order, extra=f"fill:var({_var('ink')})")  # what draws no fill of its own (black) draws ink
    css += "".join(f"text{{font-family:{family}}}" for family in sorted(families)[:1])
    start = re.search(r"<svg\b[^>]*>", svg).end()
    return svg[:start] + f'\n <style id="{PALETTE_STYLE_ID}">{css}</style>' + svg[start:]


_FONT = re.compile(r";? font-family: ([^;\"]*)")
_SINGLE_CHILD = re.compile(r'<g id="[^"]*">\n(<(?:path|use|text)\b[^>]*?(?:/>|>[^<]*</text>))\n</g>')
_STROKES = re.compile(r'(?:<path d="[^"]*"((?: clip-path="[^"]*")? style="fill: none; stroke: [^"]*")/>\n)'
                      r'(?:<path d="[^"]*"\1/>\n)+')


def _fewer_elements(svg: str) -> str:
    """The same drawing in fewer elements: a group that only wraps one element goes, and a run of
    sibling lines drawn alike (a collection's: ticks, whiskers), opaque, becomes one path."""
    svg = _SINGLE_CHILD.sub(r"\1", svg)

    def merge(m: re.Match) -> str:
        if "opacity" in m.group(1):  # overlapping translucent strokes would darken: kept apart
            return m.group(0)
        paths = re.findall(r'<path d="([^"]*)"', m.group(0))
        return f'<path d="{" ".join(paths)}"{m.group(1)}/>\n'

    return _STROKES.sub(merge, svg)


def _short_path(d: str) -> str:
    """Path data at 0.1 pt (a seventh of a CSS pixel), without repeated points or a point between its
    neighbours on one horizontal or vertical line (a step plot's flat runs), a segment along an axis
    as one number (H, V): the same drawing, a fraction of the bytes."""
    def num(v: str) -> str:
        text = f"{float(v):.1f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text

    tokens = d.split()
    if any(t not in ("M", "L", "z") and not _NUMBER.fullmatch(t) and not t.lstrip("-").isdigit() for t in tokens):
        return " ".join(_NUMBER.sub(lambda v: num(v.group()), t) for t in tokens)  # curves: rounded only
    out: list[list] = []  # [command, x, y] or ["z"]
    i = 0
    while i < len(tokens):
        if tokens[i] == "z":
            out.append(["z"])
            i += 1
            continue
        cmd, x, y = tokens[i], num(tokens[i + 1]), num(tokens[i + 2])
        i += 3
        if cmd == "L" and out and out[-1][0] != "z":
            if out[-1][1:] == [x, y]:
                continue
            if len(out) >= 2 and out[-1][0] == "L" and out[-2][0] != "z":
                (_, x0, y0), (_, x1, y1) = out[-2], out[-1]
                fx0, fx1, fx, fy0, fy1, fy = map(float, (x0, x1, x, y0, y1, y))
                if (fx0 == fx1 == fx and min(fy0, fy) <= fy1 <= max(fy0, fy)) or \
                        (fy0 == fy1 == fy and min(fx0, fx) <= fx1 <= max(fx0, fx)):
                    out[-1] = [cmd, x, y]
                    continue
        out.append([cmd, x, y])
    # A segment along an axis needs one number: H (horizontal) or V (vertical) to it.
    parts, last = [], None
    for p in out:
        if p[0] == "L" and last is not None and p[2] == last[1]:
            parts.append(f"H{p[1]}")
        elif p[0] == "L" and last is not None and p[1] == last[0]:
            parts.append(f"V{p[2]}")
        elif p[0] == "z":
            parts.append("z")
        else:
            parts.append(f"{p[0]}{p[1]} {p[2]}")
        if p[0] != "z":
            last = (p[1], p[2])
    return "".join(parts)


def _svg(fig, layout: Layout) -> str:
    """``fig`` laid out at ``layout``, as an SVG in the palette; ``fig`` itself is left as it was."""
    try:
        copy = pickle.loads(pickle.dumps(fig))
    except (AttributeError, TypeError, pickle.PicklingError):  # a lambda (a tick formatter): shared, not pickled
        copy = deepcopy(fig)
    try:
        page_layout(copy, layout)
        out = io.BytesIO()
        with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "infralab"}):
            copy.savefig(out, format="svg", bbox_inches="tight", pad_inches=SAVE_PAD_IN, transparent=True,
                         metadata={"Date": None})
        return themed_svg(out.getvalue().decode("utf-8"))
    finally:
        plt.close(copy)


_DRAWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # figure -> its SVGs, while it is unchanged


def page_svgs(fig) -> tuple[str, str]:
    """The figure as the pages show it: (:data:`WIDE` SVG, :data:`PHONE` SVG). A figure shown in a
    notebook and then published is laid out once: the SVGs are kept until an artist changes (which
    marks the figure stale)."""
    if fig in _DRAWN and not fig.stale:
        return _DRAWN[fig]
    svgs = _svg(fig, WIDE), _svg(fig, PHONE)
    _DRAWN[fig] = svgs
    fig.stale = False
    return svgs


def phone_path(path: str | os.PathLike) -> Path:
    """Where :func:`save` writes the phone layout of ``path``: ``phone/`` beside it."""
    path = Path(path)
    return path.parent / "phone" / path.name


def save(fig, path: str | os.PathLike) -> Path:
    """Write a figure as PNG or SVG (by suffix), creating folders, all or nothing
    (:mod:`labkit.files`). A PNG is the figure as drawn. An SVG is what the pages show: laid out
    for the content column (:data:`WIDE`) at ``path`` and for a phone (:data:`PHONE`) at
    :func:`phone_path`, text as text, every colour a palette variable (:func:`themed_svg`), so
    that it follows the site's light and dark palettes. ``fig`` itself is not changed."""
    from labkit.files import atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".svg":
        with atomic(path, "wb") as f:
            fig.savefig(f, format=path.suffix.lstrip("."), bbox_inches="tight", dpi=160, facecolor="white",
                        metadata={"Software": None})
        return path
    wide, phone = page_svgs(fig)
    for target, text in ((path, wide), (phone_path(path), phone)):
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic(target, "wb") as f:
            f.write(text.encode("utf-8"))
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
    colors = dict(unit_colors or {}) or {s: SERIES[i % len(SERIES)] for i, s in enumerate(stages)}
    for bar in bars:
        y = lanes.index(bar.lane) if bar.lane in lanes else len(lanes)
        ax.broken_barh([(bar.start_ms, max(bar.ms, 1e-6))], (y - 0.38, 0.76),
                       facecolors=colors.get(bar.stage or "-", INK_MUTED),
                       edgecolor=INK if bar.kind == "transfer" else "none", linewidth=0.4,
                       hatch="////" if bar.kind == "transfer" else None, alpha=0.85 if bar.kind == "compute" else 0.55)
    ax.set_yticks(range(len(lanes)), [f"{lane} stream" for lane in lanes])
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=colors[s], label=f"stage: {s}") for s in stages]
    handles += [Patch(facecolor="none", edgecolor=INK, hatch="////", label="transfer (host to device)"),
                Patch(facecolor=INK_MUTED, label="compute (solid)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return fig


def plot_segments(segments: Sequence[Sequence[tuple[int, str | None]]], ax=None, title: str | None = None,
                  rows: int = 8, unit: str | None = None, row_bytes: int | None = None):
    """The CUDA caching allocator's segments, as memory_viz's segment view draws them.

    ``segments``: one list per segment (a cudaMalloc, or a mapped range of an expandable segment),
    in address order, of its blocks as ``(bytes, label)``: a category (a live tensor, coloured as
    in :func:`plot_timeline`), ``None`` (a cached free block: hatched) or ``"waiting"`` (freed, but
    another stream may still use it). The segments are laid end to end and wrapped into ``rows``
    rows, like a text, each outlined: a row's length is the reserved bytes over ``rows`` (or
    ``row_bytes``, to draw several allocators to one scale), and whatever is not coloured is
    reserved and unused. Returns the figure.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.35 * rows + 1.2), dpi=110, layout="constrained")
    else:
        fig = ax.figure
    total = sum(n for seg in segments for n, _ in seg) or 1
    name, scale = next(((u, s) for u, s in UNITS if u == unit), pick_unit(total))
    width = row_bytes or total / rows
    rows = max(rows if row_bytes else 1, -(-int(total) // max(int(width), 1)))  # rows drawn
    edge, handles, at = CATEGORY_COLORS["other"], {}, 0.0

    def pieces(start: float, size: float):  # (row, x, length) of a range wrapped at the row length
        while size > 1e-9 * total:
            row, x = int(start // width + 1e-12), start % width
            length = min(size, width - x)
            yield min(row, rows - 1), x, length
            start, size = start + length, size - length

    for seg in segments:
        start = at
        for nbytes, label in seg:
            free = label is None
            color = "none" if free else CATEGORY_COLORS.get(label, edge)
            for row, x, length in pieces(at, nbytes):
                ax.broken_barh([(x / scale, length / scale)], (row - 0.4, 0.8), facecolors=color, edgecolor=edge,
                               linewidth=0.3 if free else 0, hatch="////" if free else None,
                               alpha=0.5 if label == "waiting" else 1.0)
            key = "cached, free" if free else label
            handles.setdefault(key, Patch(facecolor=color, edgecolor=edge, hatch="////" if free else None,
                                          label=key.replace("_", " ")))
            at += nbytes
        for row, x, length in pieces(start, at - start):
            ax.broken_barh([(x / scale, length / scale)], (row - 0.45, 0.9), facecolors="none", edgecolor=edge,
                           linewidth=0.8)
    ax.set_yticks([])
    ax.set_xlim(0, width / scale)
    ax.set_ylim(rows - 0.4, -0.6)
    ax.set_xlabel(f"{name}: {len(segments)} segments end to end, {width / scale:.3g} {name} a row")
    ax.legend(handles=list(handles.values()), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return fig
