"""The figures the site shows (labkit.plot): a palette that reads on both of the site's palettes, SVGs
that use nothing else and follow the page's light or dark palette, and a page layout that fits the
content column and a phone, with legends beside or under their data and no panel taller than a screen.
"""

from __future__ import annotations

import colorsys
import importlib.util
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from conftest import ROOT  # noqa: E402

from labkit import plot  # noqa: E402

SVGS = sorted([*(ROOT / "results").rglob("*.svg"), *(ROOT / "docs" / "assets" / "figures").rglob("*.svg")])
MATERIAL_CSS = Path(importlib.util.find_spec("material").origin).parent / "templates" / "assets" / "stylesheets"


# ---------------------------------------------------------------------------------------- contrast
def luminance(color: str) -> float:
    """WCAG 2's relative luminance of ``#rrggbb``."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def material_background(scheme: str) -> str:
    """The page background of Material's ``default`` or ``slate`` scheme, read from its CSS."""
    css = "".join(p.read_text(encoding="utf-8") for p in sorted(MATERIAL_CSS.glob("*.min.css")))
    hue = float(re.search(r"--md-hue:(\d+(?:\.\d+)?)deg", css).group(1))
    if scheme == "default":
        value = re.search(r"\[data-md-color-scheme=default\]\{--md-hue:[^}]*?--md-default-bg-color:([^;}]+)", css)
    else:
        value = re.search(r"\[data-md-color-scheme=slate\]\{color-scheme:dark;[^}]*?--md-default-bg-color:([^;}]+)", css)
    text = value.group(1).strip()
    if text.startswith("#"):
        return "#" + "".join(c * 2 for c in text[1:4]) if len(text) == 4 else text[:7]
    s, lightness = (float(v) / 100 for v in re.findall(r"(\d+(?:\.\d+)?)%", text))
    r, g, b = colorsys.hls_to_rgb(hue / 360, lightness, s)
    return "#" + "".join(f"{round(v * 255):02x}" for v in (r, g, b))


def test_the_palette_backgrounds_are_materials():
    assert material_background("default") == plot.BACKGROUND["light"] == plot.PALETTE["paper"][0]
    assert material_background("slate") == plot.BACKGROUND["dark"] == plot.PALETTE["paper"][1]


@pytest.mark.parametrize("palette", [0, 1], ids=["light", "dark"])
def test_every_palette_colour_reads_on_its_background(palette):
    """WCAG 2.1 AA: graphics (1.4.11) 3:1 against the page, ink, which draws text, 4.5:1 (1.4.3)."""
    page = plot.BACKGROUND[("light", "dark")[palette]]
    faint = {}
    for name, values in plot.PALETTE.items():
        if name == "paper":
            continue
        need = 4.5 if name.startswith("ink") else 3.0
        if contrast(values[palette], page) < need:
            faint[name] = round(contrast(values[palette], page), 2)
    assert not faint, f"under {'4.5 (ink) or 3'}:1 against {page}: {faint}"


def test_the_named_colours_come_from_the_palette():
    lights = [light.lower() for light, _ in plot.PALETTE.values()]
    assert len(set(lights)) == len(lights), "each light value names one colour: save maps it back by its value"
    assert not {"#000000", "#ffffff"} & set(lights) - {plot.PAPER}, "black and white are read as ink and paper"
    used = [*plot.SERIES, *plot.CATEGORY_COLORS.values(), *plot.PHASE_COLORS.values(), plot.INK, plot.INK_MUTED]
    assert set(used) <= set(lights)
    assert len(set(plot.SERIES)) == len(plot.SERIES) >= 8
    assert set(plot.CATEGORY_COLORS) >= set(plot.CATEGORIES)


# ------------------------------------------------------------------------------------ SVG in the palette
PALETTE_BLOCK = re.compile(r'<style id="il-palette">(.*?)</style>', re.S)


def palette_block(text: str) -> tuple[dict, dict]:
    """The variables an SVG's palette block declares: (light, dark)."""
    css = PALETTE_BLOCK.search(text).group(1)
    light, dark = css.split("@media (prefers-color-scheme:dark)")
    declared = [dict(re.findall(r"(--il-[\w-]+):(#[0-9a-f]{6})", part)) for part in (light, dark)]
    return declared[0], declared[1]


def literal_colours(text: str) -> list[str]:
    """Colours written outside the palette block: hex, rgb(), or a colour keyword in fill or stroke."""
    rest = PALETTE_BLOCK.sub("", text)
    found = re.findall(r"(?<![\w#])#[0-9a-fA-F]{3,8}\b|rgba?\(", rest)
    found += [v for v in re.findall(r'(?:fill|stroke)(?:=|:\s*)"?([a-z]+)', rest) if v not in ("none", "url", "var")]
    return found


@pytest.mark.parametrize("path", SVGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_svg_draws_only_in_the_palette(path):
    text = path.read_text(encoding="utf-8")
    ET.fromstring(text.encode("utf-8"))  # well-formed
    assert "<image" not in text, "a raster image cannot follow the palette"
    assert PALETTE_BLOCK.search(text), "no palette block: not written by labkit.plot.save"
    assert not literal_colours(text), f"colours outside the palette: {sorted(set(literal_colours(text)))[:8]}"
    light, dark = palette_block(text)
    expected = {f"--il-{name.replace('_', '-')}": values for name, values in plot.PALETTE.items()}
    assert set(light) == set(dark) and set(light) <= set(expected)
    for var in light:
        assert (light[var], dark[var]) == expected[var], f"{var}: not the palette's values (re-draw the figure)"
    used = set(re.findall(r"var\((--il-[\w-]+)\)", PALETTE_BLOCK.sub("", text)))
    assert used <= set(light), f"undeclared: {used - set(light)}"


def test_every_page_figure_has_its_phone_layout_and_fits():
    """WIDE at most the content column (688 CSS px), PHONE 5.2 in (499 px), both written by save;
    no plot (a clip rectangle) taller than the layout allows."""
    wide = [p for p in SVGS if p.parent.name != "phone"]
    assert wide
    for path in wide:
        phone = plot.phone_path(path)
        assert phone.is_file(), f"{phone.relative_to(ROOT)} is missing: save() writes both"
        for file, layout in ((path, plot.WIDE), (phone, plot.PHONE)):
            text = file.read_text(encoding="utf-8")
            width_pt = float(re.search(r'<svg[^>]*\swidth="([\d.]+)pt"', text).group(1))
            assert width_pt <= layout.width_in * 72 + 0.5, f"{file.relative_to(ROOT)}: {width_pt * 4 / 3:.0f} px wide"
            plots = [float(h) for h in re.findall(r'<clipPath id="[^"]+">\s*<rect [^>]*height="([\d.]+)"', text)]
            assert max(plots, default=0) <= layout.max_panel_in * 72 + 1, f"{file.relative_to(ROOT)}: a plot too tall"
    assert not [p for p in SVGS if p.parent.name == "phone" and not (p.parent.parent / p.name).is_file()]


def test_themed_svg_writes_variables_and_refuses_what_it_cannot_theme():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], color=plot.SERIES[3])
    ax.plot([0, 1], [1, 0], "k--")  # black: ink
    ax.set_title("t")
    wide, phone = plot.page_svgs(fig)
    for text in (wide, phone):
        assert "var(--il-red)" in text and "var(--il-ink)" in text and not literal_colours(text)
        light, dark = palette_block(text)
        assert light["--il-red"] == plot.PALETTE["red"][0] and dark["--il-red"] == plot.PALETTE["red"][1]
    ax.plot([0, 1], [0.5, 0.5], color="#123456")
    with pytest.raises(ValueError, match="#123456, outside labkit.plot's palette"):
        plot.page_svgs(fig)
    plt.close(fig)
    fig, ax = plt.subplots()
    ax.imshow([[0, 1], [1, 0]], cmap="gray")
    with pytest.raises(ValueError, match="raster image"):
        plot.page_svgs(fig)
    plt.close(fig)


def test_save_writes_both_layouts_and_leaves_the_figure_as_it_was(tmp_path):
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([0, 1], [0, 1], label="a line")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    size = tuple(fig.get_size_inches())
    path = plot.save(fig, tmp_path / "f.svg")
    assert path.is_file() and plot.phone_path(path).is_file()
    assert tuple(fig.get_size_inches()) == size and ax.get_legend() is not None
    assert plot.save(fig, tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    plt.close(fig)


# ------------------------------------------------------------------------------------------- layout
def laid_out(fig, layout):
    plot.page_layout(fig, layout)
    fig.draw_without_rendering()
    return fig.canvas.get_renderer()


def inches(bbox, fig):
    return bbox.transformed(fig.dpi_scale_trans.inverted())


def check_common(fig, layout, renderer):
    """The figure is the layout's width; every plot within the layout's heights, and with its
    decorations under one screen of 800 px (less Material's header) when shown at 96 px/in; no text
    smaller than the layout's; nothing drawn outside the figure."""
    width = layout.width_in - 2 * plot.SAVE_PAD_IN
    assert fig.get_figwidth() == pytest.approx(width)
    box = inches(fig.get_tightbbox(renderer), fig)
    assert box.x0 >= -0.01 and box.x1 <= width + 0.01, box
    for ax in fig.axes:
        if not ax.axison:
            continue
        plot_in = inches(ax.bbox, fig)
        assert layout.panel_in - 0.1 <= plot_in.height <= layout.max_panel_in + 0.05, plot_in
        assert inches(ax.get_tightbbox(renderer), fig).height * 96 <= 700
    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_text() and t.get_visible()]
    assert min(sizes) >= layout.font_pt


def panel_columns(fig):
    return sorted({round(ax.get_position().x0, 2) for ax in fig.axes if ax.axison})


def test_a_single_plot_has_its_legend_beside_it_on_the_page_and_under_it_on_a_phone():
    for layout in (plot.WIDE, plot.PHONE):
        fig, ax = plt.subplots(figsize=(10, 4.2))
        for k in range(5):
            ax.plot([0, 1], [k, k + 1], label=f"series number {k}, measured on the device")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        renderer = laid_out(fig, layout)
        check_common(fig, layout, renderer)
        legend, plot_box = ax.get_legend().get_window_extent(renderer), ax.bbox
        if layout is plot.WIDE:
            assert legend.x0 >= plot_box.x1 and legend.y1 >= plot_box.y0 and legend.y0 <= plot_box.y1  # beside
        else:
            gap = (plot_box.y0 - legend.y1) / fig.dpi
            assert 0 < gap < 1.0 and legend.x0 >= plot_box.x0 - 1  # directly under, below the x axis
        plt.close(fig)


def test_stacked_panels_become_a_grid_with_their_shared_legend_beside_them():
    """Four timelines stacked in one column (1,500 px tall before): two by two on the page, their
    one legend under the grid; on a phone one column, the legend under the first plot."""
    for layout in (plot.WIDE, plot.PHONE):
        fig, axes = plt.subplots(4, 1, figsize=(10, 10))
        for k, ax in enumerate(axes):
            ax.fill_between(range(10), 0, range(10), color=plot.CATEGORY_COLORS["activations"], label="activations")
            ax.set(title=f"mode {k}: a memory timeline with a long title", xlabel="ledger events", ylabel="MiB")
        axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        renderer = laid_out(fig, layout)
        check_common(fig, layout, renderer)
        assert len(panel_columns(fig)) == (2 if layout is plot.WIDE else 1)
        if layout is plot.WIDE:
            assert fig.get_figheight() * 96 < 900, "two rows, not four"
            (legend,) = fig.legends
            box = legend.get_window_extent(renderer)
            lowest = min(ax.get_tightbbox(renderer).y0 for ax in axes)
            assert box.y1 <= lowest + 1 and lowest - box.y1 < 0.5 * fig.dpi, "directly under the grid"
        else:
            box = axes[0].get_legend().get_window_extent(renderer)
            assert axes[1].get_tightbbox(renderer).y1 <= box.y0 + 1 and box.y1 <= axes[0].bbox.y0, "under the first plot"
        plt.close(fig)


def test_three_panels_put_the_figure_legend_in_the_empty_cell():
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True, sharey=True)
    for ax in axes:
        ax.stackplot(range(5), [1, 2, 3, 2, 1], [1, 1, 1, 1, 1], labels=["stored", "waste"],
                     colors=[plot.CATEGORY_COLORS["kv_cache"], plot.SERIES[3]])
    axes[-1].set_xlabel("engine step")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8)
    renderer = laid_out(fig, plot.WIDE)
    check_common(fig, plot.WIDE, renderer)
    cell = next(ax for ax in fig.axes if not ax.axison)
    box = cell.get_legend().get_window_extent(renderer)
    assert box.x0 >= axes[2].bbox.x1 and box.y1 >= axes[2].bbox.y0, "beside the third plot, in the grid"
    assert axes[1].xaxis.get_label().get_text() == "engine step", "the lowest plot of each column is labelled"
    plt.close(fig)


def test_a_tall_plot_is_capped_at_one_screen():
    fig, ax = plt.subplots(figsize=(5, 12))
    ax.barh(range(30), range(30), color=plot.SERIES[0])
    renderer = laid_out(fig, plot.WIDE)
    check_common(fig, plot.WIDE, renderer)
    assert inches(ax.bbox, fig).height == pytest.approx(plot.WIDE.max_panel_in, abs=0.1)
    plt.close(fig)


def test_timeline_draws_in_the_palette_with_phase_strips(tmp_path):
    from test_labkit import _small_timeline

    tl = _small_timeline().timeline()
    fig = plot.plot_timeline(tl, title="t", overlay={"prediction": [4000] * len(tl)})
    text = plot.save(fig, tmp_path / "t.svg").read_text()
    assert "var(--il-blue)" in text and "var(--il-teal)" in text  # parameters; the forward phase
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels[:2] == ["parameters", "activations"] and "phase: forward" in labels and "prediction" in labels
    plt.close(fig)


def test_names_along_an_axis_never_run_into_each_other():
    names = ["none", "full", "every-k", "save-matmuls"]
    for layout in (plot.WIDE, plot.PHONE):
        fig, axes = plt.subplots(3, 1, figsize=(6.5, 8.5))
        for ax in axes:
            ax.bar(names, [3, 1, 2, 2.5], color=plot.SERIES[:4])
            ax.tick_params(axis="x", labelsize=8)
        renderer = laid_out(fig, layout)
        check_common(fig, layout, renderer)
        for ax in axes:
            labels = ax.get_xticklabels()
            boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
            if all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])):
                continue
            assert labels[0].get_rotation() == 30, "they run into each other and were not turned"
            # turned 30 degrees, neighbours a tick apart stand this far apart across their lines
            step = min(b.x1 - a.x1 for a, b in zip(boxes, boxes[1:])) * 0.5
            assert step >= labels[0].get_fontsize() * fig.dpi / 72, step
        plt.close(fig)
