"""The handbook's mechanism figures (scripts/figures/): each committed SVG is exactly what its code
draws today, each is shown on a page with alt text, and no page shows a figure no code draws."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "figures"))
import make  # noqa: E402

from labkit.plot import phone_path  # noqa: E402

FIGURES = sorted(make.registry())
SHOWN = re.compile(r"!\[([^\]]*)\]\(([^)\s]*assets/figures/([\w.-]+)\.svg)")


def shown() -> dict[str, list[tuple[str, str]]]:
    """figure name -> [(page, alt text)] for every page that shows it."""
    out: dict[str, list[tuple[str, str]]] = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for alt, _, name in SHOWN.findall(page.read_text(encoding="utf-8")):
            out.setdefault(name, []).append((str(page.relative_to(ROOT)), alt))
    return out


@pytest.mark.parametrize("name", FIGURES)
def test_the_committed_figure_is_what_its_code_draws(name, tmp_path):
    committed = make.OUT / f"{name}.svg"
    assert committed.is_file(), f"run: .venv/bin/python scripts/figures/make.py {name}"
    drawn = make.draw(name, tmp_path)
    for mine, theirs in ((drawn, committed), (phone_path(drawn), phone_path(committed))):  # both layouts
        assert theirs.is_file() and mine.read_bytes() == theirs.read_bytes(), (
            f"{theirs.relative_to(ROOT)} is stale: run .venv/bin/python scripts/figures/make.py {name}")


@pytest.mark.parametrize("name", FIGURES)
def test_every_figure_is_shown_with_alt_text(name):
    pages = shown().get(name)
    assert pages, f"no page shows assets/figures/{name}.svg"
    for page, alt in pages:
        assert len(alt.split()) >= 5, f"{page}: the alt text of {name}.svg says too little: {alt!r}"


def test_no_page_shows_a_figure_no_code_draws():
    assert set(shown()) <= set(FIGURES), sorted(set(shown()) - set(FIGURES))
    on_disk = {p.stem for p in make.OUT.glob("*.svg")}
    assert on_disk <= set(FIGURES), f"SVGs no code draws: {sorted(on_disk - set(FIGURES))}"


def test_the_1f1b_schedule_keeps_p_minus_i_micro_batches_on_stage_i():
    """The pipeline figure's schedule obeys its dependencies and holds what Narayanan et al. say 1F1B
    holds: stage i (from 0) at most p - i micro-batches in flight, the first stage p."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("infralab_figures_chapters", ROOT / "scripts" / "figures" / "chapters.py")
    chapters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapters)
    for p, m in ((2, 4), (4, 4), (4, 6), (8, 16)):
        schedule = chapters.one_f_one_b(p, m)
        assert [chapters.in_flight(schedule[i]) for i in range(p)] == [min(p - i, m) for i in range(p)]
        end = {(kind, i, j): start + length for i, ops in schedule.items() for kind, j, start, length in ops}
        for i, ops in schedule.items():
            assert sorted((kind, j) for kind, j, *_ in ops) == sorted((k, j) for k in "FB" for j in range(m))
            spans = sorted((start, start + length) for *_, start, length in ops)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "a stage runs one op at a time"
            for kind, j, start, _ in ops:
                before = ("F", i - 1, j) if kind == "F" else ("B", i + 1, j) if i < p - 1 else ("F", i, j)
                assert before not in end or end[before] <= start, (kind, i, j)
