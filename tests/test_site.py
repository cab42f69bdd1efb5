"""The site: strict build, internal links and anchors, lab pages wired to real files, offline."""

from __future__ import annotations

import html as html_lib
import importlib.util
import json
import os
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LAB_PAGES = sorted((DOCS / "labs").glob("lab-*.md"))
TEMPLATE_SECTIONS = [
    "Concept goal", "Mental model", "Run it", "Annotated code", "Measured results",
    "At real scale", "What to notice", "Common misunderstandings", "Interview: how to say it out loud", "Exercises",
    "Further reading",
]
SNIPPET = re.compile(r'^\s*-{1,}8<-{1,}\s+"([^"]+)"', re.M)

pytestmark = pytest.mark.site


class PageParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (tag, url)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag == "link" and attrs.get("rel") in ("canonical", "alternate"):
            return  # names the page's address; loads nothing
        for attr in ("href", "src"):
            if attrs.get(attr) and tag in ("a", "img", "script", "link", "source", "iframe"):
                self.links.append((tag, attrs[attr]))


def parse(path: Path) -> PageParser:
    p = PageParser()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def front_matter(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("---\n"), path
    return yaml.safe_load(text.split("---\n", 2)[1])


def test_strict_build_has_no_warnings(built_site):
    assert "WARNING" not in built_site["log"]


def test_internal_links_and_anchors_resolve(built_site):
    site: Path = built_site["dir"].resolve()
    pages = {p.resolve(): parse(p) for p in site.rglob("*.html")}
    problems = []
    for page, parsed in pages.items():
        for tag, url in parsed.links:
            parts = urlsplit(url)
            if parts.scheme in ("http", "https", "mailto", "data", "javascript") or url.startswith("//"):
                continue
            if not parts.path:
                target = page
            elif parts.path.startswith("/"):  # 404.html links from the site root (site_url's path)
                target = (site / unquote(parts.path).lstrip("/")).resolve()
            else:
                target = (page.parent / unquote(parts.path)).resolve()
                if target.is_dir():
                    target = target / "index.html"
            if not target.exists():
                problems.append(f"{page.relative_to(site)}: {tag} -> {url} (missing file)")
                continue
            frag = unquote(parts.fragment)
            if frag and not frag.startswith("__") and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if frag not in ids:
                    problems.append(f"{page.relative_to(site)}: {url} (missing anchor #{frag})")
    assert not problems, "\n".join(problems[:40])


def test_no_external_scripts_styles_or_fonts(built_site):
    for page in built_site["dir"].rglob("*.html"):
        for tag, url in parse(page).links:
            if tag in ("script", "link", "img", "iframe", "source"):
                assert not re.match(r"^(https?:)?//", url), f"{page}: {tag} loads {url}"
        text = page.read_text(encoding="utf-8")
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, page


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_lab_page_front_matter_names_real_files(page):
    meta = front_matter(page)
    for key in ("lab", "starter", "notebook", "run_cpu", "run_gpu"):
        assert meta.get(key), f"{page.name}: front matter needs {key}"
    assert (ROOT / meta["starter"]).is_file(), meta["starter"]
    from labkit import labs  # the page quotes the file labs.load(N) returns: one starter per lab

    assert (ROOT / meta["starter"]).resolve() == labs.starter(int(meta["lab"])).resolve()
    assert (ROOT / meta["notebook"]).is_file(), meta["notebook"]
    launch = rf"^(\.venv/bin/)?(python|torchrun( --\S+)*) {re.escape(meta['starter'])}( |$)"  # plain or distributed
    assert re.match(launch, meta["run_cpu"]) and "--device cpu" in meta["run_cpu"], meta["run_cpu"]
    assert re.match(launch, meta["run_gpu"]) and "--device cuda" in meta["run_gpu"], meta["run_gpu"]


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_lab_page_has_every_template_section_in_order(page):
    headings = re.findall(r"^## (.+)$", page.read_text(encoding="utf-8"), re.M)
    assert headings == TEMPLATE_SECTIONS


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_lab_page_quotes_its_starter_through_snippet_sections(page):
    meta = front_matter(page)
    refs = SNIPPET.findall(page.read_text(encoding="utf-8"))
    starter_sections = [r.split(":", 1)[1] for r in refs if r.startswith(meta["starter"] + ":")]
    assert len(starter_sections) >= 2, "a lab page quotes its starter in named sections"
    source = (ROOT / meta["starter"]).read_text(encoding="utf-8")
    for name in starter_sections:
        assert f"# --8<-- [start:{name}]" in source and f"# --8<-- [end:{name}]" in source, name
    # no pasted code: every python block on the page is a snippet include
    for block in re.findall(r"```python[^\n]*\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
        assert SNIPPET.match(block.strip().splitlines()[0]), f"pasted code on {page.name}: {block[:80]}"


def test_every_snippet_reference_resolves():
    for page in DOCS.rglob("*.md"):
        for ref in SNIPPET.findall(page.read_text(encoding="utf-8")):
            path, _, section = ref.partition(":")
            target = ROOT / path
            assert target.is_file(), f"{page}: {path}"
            if section and not section[0].isdigit():
                text = target.read_text(encoding="utf-8")
                assert f"--8<-- [start:{section}]" in text and f"--8<-- [end:{section}]" in text, ref


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_rendered_lab_page_links_its_starter_and_notebook(built_site, page):
    meta = front_matter(page)
    html_path = built_site["dir"] / "labs" / page.stem / "index.html"
    html = html_path.read_text(encoding="utf-8")
    parsed = parse(html_path)
    hrefs = {(html_path.parent / unquote(urlsplit(u).path)).resolve() for t, u in parsed.links if t == "a"}
    site = built_site["dir"].resolve()
    nb = Path(meta["notebook"]).stem
    assert site / meta["starter"] in hrefs
    assert site / "notebooks" / nb in hrefs or site / "notebooks" / nb / "index.html" in hrefs
    download = site / "notebooks" / nb / f"{nb}.ipynb"
    assert download in hrefs and json.loads(download.read_text())["nbformat"] == 4
    assert 'data-il="run-it"' in html and meta["run_cpu"] in html.replace("&#34;", '"')
    assert 'class="il-slot-run-it"' not in html  # the template filled the slot
    assert "data-il-badge=" in html
    # the code on the page is the code in the file: every quoted section's lines appear, in order
    text = html_lib.unescape(re.sub(r"<[^>]+>", "", html))
    for ref in SNIPPET.findall(page.read_text(encoding="utf-8")):
        path, _, section = ref.partition(":")
        if not path.startswith("code/") or not section:
            continue
        source = (ROOT / path).read_text(encoding="utf-8")
        body = source.split(f"# --8<-- [start:{section}]", 1)[1].split(f"# --8<-- [end:{section}]", 1)[0]
        lines = [ln.strip() for ln in body.splitlines() if ln.strip() and "--8<--" not in ln]
        for line in (lines[0], lines[len(lines) // 2], lines[-1]):
            line = re.sub(r"\s*# \(\d+\)!$", "", line)  # annotation markers become bubbles
            assert line in text, (ref, line)


def test_badge_reflects_notebook_provenance(built_site):
    for page in LAB_PAGES:
        meta = front_matter(page)
        summary = json.loads((ROOT / "results" / Path(meta["notebook"]).stem / "summary.json").read_text())
        device_type = summary["provenance"]["device_type"]
        html = (built_site["dir"] / "labs" / page.stem / "index.html").read_text(encoding="utf-8")
        state = re.search(r'data-il-badge="(\w+)"', html).group(1)
        if state != "stale":
            assert state == ("gpu" if device_type == "cuda" else "cpu")
        if device_type != "cuda":
            assert "CPU only so far" in html


def test_badge_says_when_the_lab_code_changed_since_measurement(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("infralab_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    notebook = front_matter(LAB_PAGES[0])["notebook"]
    fresh = hooks.measured_badge(notebook)
    monkeypatch.setattr(hooks, "source_hash", lambda lab: "0000000000000000")
    monkeypatch.setattr(hooks, "labkit_hash", lambda: "1111111111111111")
    stale = hooks.measured_badge(notebook)
    assert stale["stale"] and stale["state"] == "stale" and "changed since" in stale["title"]
    assert stale["bench_changed"] and "instruments (labkit) have changed" in stale["title"]
    assert fresh["current_hash"] != "0000000000000000"


def test_notebook_pages_are_in_the_site(built_site):
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        page = built_site["dir"] / "notebooks" / nb.stem / "index.html"
        assert page.is_file(), page
        html = page.read_text(encoding="utf-8")
        assert 'class="il-figure"' in html and "data:image/svg+xml;base64" in html and "data-il-badge=" in html
        assert "data:image/png" not in html and "No description has been provided" not in html


def test_every_notebook_lab_page_and_chapter_is_in_the_nav(built_site):
    """The hook builds the nav from the lab pages; the home page's navigation must list them all."""
    nav_html = (built_site["dir"] / "index.html").read_text(encoding="utf-8").split('class="md-nav__list"', 1)[1]
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert f'notebooks/{nb.stem}/"' in nav_html, nb.name
    for page in LAB_PAGES:
        meta = front_matter(page)
        assert f'labs/{page.stem}/"' in nav_html, page.name
        assert f'{Path(meta["chapter"]).with_suffix("").as_posix()}/"' in nav_html, meta["chapter"]
        for extra in meta.get("extra_pages", []):
            assert f'{Path(extra).with_suffix("").as_posix()}/"' in nav_html, extra


class FigureParser(HTMLParser):
    """Every ``<figure>`` of a page: the images in it (src, alt) and its caption's text."""

    def __init__(self):
        super().__init__()
        self.figures: list[dict] = []
        self.depth, self.in_caption = 0, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self.depth += 1
            self.figures.append({"images": [], "caption": ""})
        elif self.depth and tag == "img":
            self.figures[-1]["images"].append((attrs.get("src", ""), attrs.get("alt") or ""))
        elif self.depth and tag == "figcaption":
            self.in_caption = True

    def handle_endtag(self, tag):
        if tag == "figure":
            self.depth -= 1
        elif tag == "figcaption":
            self.in_caption = False

    def handle_data(self, data):
        if self.in_caption:
            self.figures[-1]["caption"] += data


CHAPTERS = sorted(p for p in (DOCS / "handbook").glob("*.md") if p.name != "index.md")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_shows_a_mechanism_figure_with_alt_text_and_a_caption(built_site, chapter):
    """A chapter explains with a picture: at least one figure of ``docs/assets/figures/`` (drawn by
    ``scripts/figures/``) on the built page, its alt text five words or more, its caption saying what
    to notice."""
    parser = FigureParser()
    parser.feed((built_site["dir"] / "handbook" / chapter.stem / "index.html").read_text(encoding="utf-8"))
    drawn = [(src, alt, f["caption"]) for f in parser.figures for src, alt in f["images"]
             if re.search(r"assets/figures/[\w.-]+\.svg$", src)]
    assert drawn, f"{chapter.name} shows no figure from docs/assets/figures/"
    for src, alt, caption in drawn:
        assert len(alt.split()) >= 5, f"{chapter.name}: {src} has too little alt text: {alt!r}"
        assert "Notice" in caption, f"{chapter.name}: {src}'s caption does not say what to notice: {caption!r}"


def test_interview_page_gathers_each_labs_questions(built_site):
    html = (built_site["dir"] / "interview" / "index.html").read_text(encoding="utf-8")
    for page in LAB_PAGES:
        text = page.read_text(encoding="utf-8")
        section = text.split("[start:interview]", 1)[1].split("[end:interview]", 1)[0]
        first_question = re.search(r'\?\?\? question "([^"]+)"', section).group(1)
        assert first_question.replace('"', "&quot;") in html or first_question in html
    # the answers are inlined: a link in one still reaches the page or section it named on the lab page
    for href in re.findall(r'href="([^"]+)"', html):
        parts = urlsplit(href)
        if parts.scheme or href.startswith("#") or not parts.path:
            continue
        target = (built_site["dir"] / "interview" / unquote(parts.path)).resolve()
        assert (target / "index.html").exists() or target.is_file(), href


def test_inlined_markdown_keeps_its_relative_links(tmp_path):
    relink = hooks_on(tmp_path)._relink
    text = ("[a](#measured-results) [b](more/x.md) [c](../handbook/y.md#z) [d](https://e.org/f.md) "
            "[g](lab-02-single-gpu-training.md)")
    assert relink(text, "labs/lab-11-zero-fsdp.md", "interview.md") == (
        "[a](labs/lab-11-zero-fsdp.md#measured-results) [b](labs/more/x.md) [c](handbook/y.md#z) "
        "[d](https://e.org/f.md) [g](labs/lab-02-single-gpu-training.md)")


def test_readme_lab_index_links_every_lab():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in LAB_PAGES:
        meta = front_matter(page)
        assert f"docs/labs/{page.name}" in readme
        assert meta["starter"] in readme and meta["notebook"] in readme


def test_generated_indexes_list_every_lab(built_site):
    site = built_site["dir"]
    for page in LAB_PAGES:
        meta = front_matter(page)
        nb = Path(meta["notebook"]).stem
        for index in ("index.html", "labs/index.html", "notebooks/index.html"):
            html = (site / index).read_text(encoding="utf-8")
            assert f"labs/{page.stem}/" in html or f"{page.stem}/" in html, (index, page.stem)
        assert f'href="{nb}/"' in (site / "notebooks" / "index.html").read_text(encoding="utf-8")
        if meta.get("chapter"):
            assert Path(meta["chapter"]).stem in (site / "handbook" / "index.html").read_text(encoding="utf-8")
    home = (site / "index.html").read_text(encoding="utf-8")
    assert home.count("planned") + home.count("<strong>ready</strong>") >= 12, "the whole catalogue is listed"


def hooks_on(tmp_path):
    """A fresh copy of the site hooks, with empty results/ and bench/ folders made under tmp_path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"infralab_hooks_{tmp_path.name}", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    (tmp_path / "results").mkdir()
    (tmp_path / "bench").mkdir()
    return hooks


# The reading order the handbook promises (mkdocs.yml extra.reading_order): one GPU, moving memory off it,
# many GPUs, serving, debugging. A chapter listed here that does not exist yet is skipped.
READING_ORDER = [
    "handbook/memory-accounting.md", "handbook/training-step.md", "handbook/mixed-precision.md",
    "handbook/activation-checkpointing.md", "handbook/attention-memory.md", "handbook/gradient-accumulation.md",
    "handbook/optimizer-offload.md", "handbook/offload.md", "handbook/activation-offload.md",
    "handbook/data-parallel.md", "handbook/zero-fsdp.md", "handbook/model-parallel.md",
    "handbook/serving-memory.md",
    "handbook/memory-debugging.md", "oom.md",
]


def site_nav(tmp_path, edit=None) -> tuple[list, object]:
    """mkdocs.yml's nav as the hooks' on_config leaves it (after ``edit(config)``), and the hooks."""
    from mkdocs.config import load_config

    tmp_path.mkdir(parents=True, exist_ok=True)
    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    if edit:
        edit(config)
    hooks = hooks_on(tmp_path)
    return hooks.on_config(config)["nav"], hooks


def test_the_nav_starts_here_lists_each_page_once_and_the_chapters_in_the_reading_order(tmp_path):
    nav, hooks = site_nav(tmp_path)
    nav_pages = hooks.nav_pages
    pages = nav_pages(nav)
    assert pages[0] == "start.md", "Start here is first"
    assert len(pages) == len(set(pages)), sorted(p for p in pages if pages.count(p) > 1)
    handbook = nav_pages(next(item["Handbook"] for item in nav if isinstance(item, dict) and "Handbook" in item))
    assert handbook == ["handbook/index.md"] + [p for p in READING_ORDER if (DOCS / p).is_file()]
    assert {f"handbook/{p.name}" for p in (DOCS / "handbook").glob("*.md")} <= set(handbook), "every chapter"
    labs = nav_pages(next(item["Labs"] for item in nav if isinstance(item, dict) and "Labs" in item))
    expected = ["labs/index.md"]
    for page in LAB_PAGES:
        expected += [f"labs/{page.name}", *front_matter(page).get("extra_pages", [])]
    assert labs == expected, "the labs in lab order, each extra page after its lab"


def test_the_nav_refuses_a_page_twice_and_a_chapter_outside_the_reading_order(tmp_path):
    from mkdocs.exceptions import PluginError

    def oom_twice(config):
        config["nav"].append({"I have an OOM": "oom.md"})

    with pytest.raises(PluginError, match="oom.md more than once"):
        site_nav(tmp_path / "a", oom_twice)

    def forget_offload(config):
        for part in config["extra"]["reading_order"]:
            part["chapters"] = [c for c in part["chapters"] if c["page"] != "handbook/offload.md"]

    with pytest.raises(PluginError, match="handbook/offload.md is in no part of extra.reading_order"):
        site_nav(tmp_path / "b", forget_offload)

    def misspell(config):
        config["extra"]["reading_order"][0]["chapters"][0]["page"] = "handbook/memory-acounting.md"

    with pytest.raises(PluginError, match="memory-acounting.md, which does not exist"):
        site_nav(tmp_path / "c", misspell)


def test_the_built_sidebar_links_each_page_once_start_here_first(built_site):
    """What a reader sees: the primary navigation of a built page, the site's title link aside."""
    html = (built_site["dir"] / "labs" / "index.html").read_text(encoding="utf-8")
    start = html.rfind("<nav", 0, html.index("md-nav--primary"))
    depth, end = 0, None
    for m in re.finditer(r"<(/?)nav\b", html[start:]):
        depth += -1 if m.group(1) else 1
        if depth == 0:
            end = start + m.end()
            break
    links = [href for href in re.findall(r'<a href="([^"]+)"', html[start:end]) if href != ".."]
    assert links[0] == "../start/" and len(links) == len(set(links)), links
    chapters = [link for link in links if link.startswith("../handbook/") and link != "../handbook/"]
    assert chapters == [f"../{p[:-3]}/" for p in READING_ORDER if p.startswith("handbook/") and (DOCS / p).is_file()]


def test_start_here_cites_every_source_of_its_hardware_numbers():
    from labkit import labs

    page = (DOCS / "start.md").read_text(encoding="utf-8")
    for url in labs.load(14, "serving_speed").sources():
        assert f"({url})" in page, url
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    assert home.index("(start.md)") < home.index("(oom.md)") < home.index("(fit.md)"), "Start here is the first button"


def test_performance_page_renders_results_files_ratios_first(tmp_path, monkeypatch):
    hooks = hooks_on(tmp_path)
    (tmp_path / "bench" / "demo_bench.py").write_text('BENCH = "demo"\nRESULT_FILE = "results/demo.json"\n')
    (tmp_path / "bench" / "other_bench.py").write_text('BENCH = "other"\nRESULT_FILE = "results/other.json"\n')
    prov = {"device_type": "cuda", "device_name": "Some GPU", "date_utc": "2026-11-22T00:00:00+00:00",
            "git_commit": "abcdef1234567", "lab": None}
    rows = [{"metric": "bandwidth", "value": 50.0, "unit": "GB/s", "target": None},
            {"metric": "overhead", "value": 1.02, "unit": "x", "target": "<= 1.03"}]
    (tmp_path / "results" / "demo.json").write_text(json.dumps({"bench": "demo", "provenance": prov,
                                                                "summary_rows": rows}))
    monkeypatch.setattr(hooks, "ROOT", tmp_path)
    text = hooks.render_performance("performance.md")
    assert "Measured on a GPU: demo. Not yet measured on a GPU: other." in text
    pending, rest = text.split("## demo", 1)
    assert "`bench/other_bench.py`" in pending and "`bench/demo_bench.py`" not in text
    lines = [line for line in rest.splitlines() if line.startswith("| ")]
    assert lines[1] == "| overhead | 1.02x | &lt;= 1.03 | ✓ met | current |  | Some GPU (GPU) | 2026-11-22 | `abcdef1234` |"
    assert lines[2].startswith("| bandwidth | 50.0 GB/s | - | - | current |")


def test_performance_rows_of_several_labs_each_say_whether_their_lab_changed(tmp_path, monkeypatch):
    hooks = hooks_on(tmp_path)
    lab03, lab04 = "lab-03-mixed-precision", "lab-04-activation-checkpointing"
    prov = {"device_type": "cuda", "device_name": "Some GPU", "date_utc": "2026-11-22T00:00:00+00:00",
            "git_commit": "abcdef1234567", "lab": None}
    rows = [{"metric": "bf16 speed", "value": 2.0, "unit": "x", "lab": lab03},
            {"metric": "full overhead", "value": 0.3, "unit": "fraction", "lab": lab04}]
    hashes = {lab03: hooks.source_hash(lab03), lab04: "0000000000000000"}  # Lab 04 changed since
    (tmp_path / "results" / "multi.json").write_text(json.dumps({"bench": "multi", "provenance": prov,
                                                                 "source_hashes": hashes, "summary_rows": rows}))
    monkeypatch.setattr(hooks, "ROOT", tmp_path)
    text = hooks.render_performance("performance.md").split("## multi", 1)[1]
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines[1].startswith("| bf16 speed | 2.00x | - | - | current |")
    assert lines[2].startswith("| full overhead | 30.0 % | - | - | older (00000000) |")


def test_results_become_tables_and_numbers_on_a_page_escaped(tmp_path, monkeypatch):
    """A notebook publishes numbers; the build hook writes them into the page. Whatever a results
    file holds (it may come from another machine) reaches the page as text, never as HTML."""
    hooks = hooks_on(tmp_path)
    monkeypatch.setattr(hooks, "ROOT", tmp_path)
    hooks.results.cache_clear()
    folder = tmp_path / "results" / "lab-02-single-gpu-training"
    folder.mkdir(parents=True)
    evil = "<script>alert(1)</script>"
    prov = {"device_type": "cpu", "device_name": evil, "torch_version": "2.13.0", "python_version": "3.11.7",
            "git_commit": "abc", "source_hash": "x", "labkit_hash": "y", "date_utc": "2026-11-24"}
    table = {"columns": [["what", "text"], ["bytes", "B"]], "rows": [[evil, 3149824]], "unit": None, "strong": []}
    (folder / "summary.json").write_text(json.dumps({"provenance": prov, "numbers": {"a": {"b": 1536}, "name": evil},
                                                     "tables": {"t": table}, "figures": []}))
    page = ("Peak {{ lab-02:a.b | B }}, named {{ lab-02:name }}.\n\n!!! info\n"
            "    <!-- infralab:provenance lab-02 -->\n\n<!-- infralab:table lab-02 t -->\n")

    class Page:
        meta = {}
        file = type("F", (), {"src_uri": "labs/demo.md"})()

    out = hooks.on_page_markdown(page, Page(), {"extra": {}}, None)
    assert out.startswith("Peak 1,536 B, named &lt;script&gt;alert(1)&lt;/script&gt;.")
    assert "<script>" not in out and "| &lt;script&gt;alert(1)&lt;/script&gt; | 3,149,824 B |" in out
    assert "\n    | measured on | &lt;script&gt;" in out  # the provenance table stays inside the admonition
    with pytest.raises(Exception, match="no number missing"):
        hooks.on_page_markdown("{{ lab-02:missing | B }}", Page(), {"extra": {}}, None)
    with pytest.raises(Exception, match="published no table"):
        hooks.on_page_markdown("<!-- infralab:table lab-02 nope -->", Page(), {"extra": {}}, None)
    hooks.results.cache_clear()


def test_every_number_and_table_placeholder_is_filled_in(built_site):
    """Pages quote numbers with {{ lab-NN:name | kind }} and tables with <!-- infralab:... -->; none may
    reach a reader unrendered (the interview page gathers the labs' answers: theirs too)."""
    left = []
    for page in built_site["dir"].rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        if re.search(r"\{\{[^{}]*?[A-Za-z][\w-]*:[\w.\[]", text) or "infralab:" in text:  # a formula's too
            left.append(page.relative_to(built_site["dir"]).as_posix())
    assert not left, left


def test_no_page_includes_a_generated_results_file():
    """A page shows published numbers through the build hook, never text a notebook wrote."""
    for page in DOCS.rglob("*.md"):
        includes = [ref for ref in SNIPPET.findall(page.read_text(encoding="utf-8")) if ref.startswith("results/")]
        assert not includes, (page.name, includes)


def test_serve_refuses_a_busy_port_in_one_line_before_building():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([str(ROOT / "scripts" / "serve"), "--dev-addr", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHON="/nonexistent"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--dev-addr 127.0.0.1:8001" in lines[0] and str(port) in lines[0]
    # before the set-up: with no Python to set up with, the set-up would have said so instead
    assert proc.stdout == "" and "needs Python" not in proc.stderr


def test_page_weight_budgets(built_site):
    """What a reader downloads: the search index every page loads <= 450 KB (400 KB held fifteen labs and the
    handbook; Lab 16 and its validation page add 17 KB, Lab 15 14 KB, Lab 13's runs people launch 6 KB) (no notebook outputs,
    no code listings or their tooltips, no tables), each notebook page <= 600 KB (the Jupyter styles
    in one shared stylesheet), each lab page <= 400 KB."""
    site = built_site["dir"]
    index = site / "search" / "search_index.json"
    assert index.stat().st_size <= 450_000, f"search index {index.stat().st_size:,} B"
    text = index.read_text(encoding="utf-8")
    assert "Copied!" not in text and "data:image" not in text
    heavy = [f"{p.relative_to(site)}: {p.stat().st_size:,} B"
             for folder, budget in (("notebooks", 600_000), ("labs", 400_000))
             for p in sorted((site / folder).glob("*/index.html")) if p.stat().st_size > budget]
    assert not heavy, "\n".join(heavy)
    nb = (site / "notebooks" / "lab-02-single-gpu-training" / "index.html").read_text(encoding="utf-8")
    assert "notebook.css" in nb and len(re.findall(r"<style", nb)) == 0


def test_performance_rows_say_whether_their_target_is_met():
    spec = importlib.util.spec_from_file_location("infralab_hooks_perf", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.target_met(5.2, ">= 5", gpu_target=False, on_gpu=False) == "✓ met"
    assert hooks.target_met(2.8, ">= 5", gpu_target=False, on_gpu=True) == "✗ not met"
    assert hooks.target_met(12.0, "<= 15 s", gpu_target=False, on_gpu=False) == "✓ met"
    assert hooks.target_met(2.8, ">= 5", gpu_target=True, on_gpu=False) == "not comparable (CPU run)"
    assert hooks.target_met(2.8, None, gpu_target=False, on_gpu=False) == "-"
    page = hooks.render_performance("performance.md")
    assert page.startswith("## On a GPU: measured and not yet")
    assert "| metric | value | target | met? | lab code | note |" in page


def test_pytorch_reference_links_are_pinned_to_the_pinned_torch():
    """The docs and source a page (or a docstring) cites are those of the torch the project installs,
    not whatever "stable" or "main" says the day a reader clicks."""
    pinned = re.search(r"^torch==(\d+)\.(\d+)\.(\d+)$", (ROOT / "requirements.txt").read_text(encoding="utf-8"), re.M)
    major_minor, full = f"{pinned[1]}.{pinned[2]}", f"v{pinned[1]}.{pinned[2]}.{pinned[3]}"
    loose = []
    code = [*(ROOT / "code").rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "notebooks" / "src").glob("*.py")]
    for page in [*DOCS.rglob("*.md"), ROOT / "README.md", *code]:
        text = page.read_text(encoding="utf-8")
        for version in re.findall(r"https?://(?:docs\.)?pytorch\.org/docs/([^/\s)]+)/", text):
            if version != major_minor:
                loose.append((page.name, f"docs/{version}"))
        for ref in re.findall(r"github\.com/pytorch/pytorch/(?:blob|tree)/([^/\s)]+)/", text):
            if ref != full:
                loose.append((page.name, f"pytorch/pytorch@{ref}"))
    assert not loose, loose


FOLLOW_UP = '??? info "Follow-up'


def lines_read(text: str) -> int:
    """Source lines a reader reads in one sitting: all but those of the collapsed follow-ups under the
    interview answers (the exact figures behind a spoken answer, opened when asked "how do you know?")."""
    count, inside = 0, None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if inside is not None and (not line.strip() or indent > inside):
            continue
        inside = indent if line.lstrip().startswith(FOLLOW_UP) else None
        count += inside is None
    return count


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_lab_page_stays_readable_in_one_sitting(page):
    """A lab page is 250–360 source lines, its interview answers' collapsed follow-ups aside: a longer
    one repeats what its chapter, another lab or a table says (state it once and link), or carries a
    second lesson (give it an extra page, as Lab 11's sharded inference has). What a reader sees is
    measured on the built page by tests/test_lab_pages.py; the source also holds the collapsed blocks
    (toy tables, provenance, derivations), which this bound keeps from growing without end."""
    lines = lines_read(page.read_text(encoding="utf-8"))
    assert 250 <= lines <= 360, f"{page.name}: {lines} lines"
    assert lines_read('a\n??? info "Follow-up: x"\n    b\n\n    c\nd\n') == 2


def test_a_cpu_run_points_at_the_one_cpu_note_and_a_gpu_run_does_not(tmp_path, monkeypatch):
    """What a CPU run cannot show is said once (the labs index); a lab's "Where these figures come
    from" box links there while its figures are from a CPU, and stops once a GPU run is committed."""
    hooks = hooks_on(tmp_path)
    slug = "lab-02-single-gpu-training"
    data = json.loads((ROOT / "results" / slug / "summary.json").read_text(encoding="utf-8"))
    (tmp_path / "results" / slug).mkdir()
    monkeypatch.setattr(hooks, "ROOT", tmp_path)

    class Page:
        file = type("File", (), {"src_uri": f"labs/{slug}.md"})()
        meta = {}

    said = {}
    for device in ("cpu", "cuda"):
        data["provenance"]["device_type"] = device
        (tmp_path / "results" / slug / "summary.json").write_text(json.dumps(data), encoding="utf-8")
        hooks.results.cache_clear()
        said[device] = hooks.on_page_markdown("<!-- infralab:provenance lab-02 -->", Page(), {"extra": {}}, None)
    hooks.results.cache_clear()
    assert "[what a CPU run shows](index.md#what-a-cpu-run-shows)" in said["cpu"]
    assert "what a CPU run shows" not in said["cuda"]
    index = (DOCS / "labs" / "index.md").read_text(encoding="utf-8")
    assert "\n## What a CPU run shows\n" in index
    assert not [p.name for p in DOCS.rglob("*.md") if "gpu-pending" in p.read_text(encoding="utf-8")], "one note, not a banner per page"


def _value_references(hooks) -> list[tuple[str, str, str]]:
    """(page, results name, path) of every results reference on the site's pages, formulas' included."""
    refs = []
    for page in sorted(DOCS.rglob("*.md")):
        for m in hooks.VALUE.finditer(page.read_text(encoding="utf-8")):
            for ref in re.findall(hooks.REF, m.group("expr")):
                name, _, path = ref.partition(":")
                refs.append((page.relative_to(DOCS).as_posix(), name, path))
    return refs


def _node(hooks, name: str):
    data = hooks.results(name)
    return data.get("numbers", data) if name.startswith("lab-") else data


def test_no_page_reads_a_list_of_results_by_position():
    """A list of records (one per size, stage or mode a run covered) is read by a field
    (``sets[params=12905472]``), never by position (``sets.2``): a re-run with other sizes would move
    every position. A digit may index only a list of plain numbers (a band's ends, step 0 and 1)."""
    spec = importlib.util.spec_from_file_location("infralab_hooks_positions", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    refs, by_field = _value_references(hooks), 0
    assert len(refs) > 300
    for page, name, path in refs:
        node = _node(hooks, name)
        for step in hooks._steps(path):
            m = hooks.STEP.match(step)
            key, field, value = m.group("key"), m.group("field"), m.group("value")
            if isinstance(node, list):
                assert key.isdigit() and all(isinstance(v, (int, float)) for v in node), (page, name, path)
                node = node[int(key)]
                continue
            node = node[key]
            if field:
                (node,) = [r for r in node if str(r.get(field)) == value]
                by_field += 1
    assert by_field >= 40, "the benchmark, stage and mode lists are read by a field"
    # the hook refuses a position into records itself, naming the field to use instead
    with pytest.raises(Exception, match=r"by position \(2\); a list of records is looked up by a field"):
        hooks._lookup("cpu_adam_bench", "sets.2.impls.fused.ns_per_param", "demo.md")


def test_a_rerun_with_other_sizes_is_a_build_error_naming_the_missing_key(monkeypatch):
    """Re-run a benchmark or notebook with other sizes, stages or modes: every page that names an
    entry the new results lack stops the build with that entry and the ones there are, instead of
    quoting another size's number; entries in another order change nothing."""
    import copy

    spec = importlib.util.spec_from_file_location("infralab_hooks_rerun", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    published = hooks.results

    def rerun(change):
        def results(name):
            data = copy.deepcopy(published(name))
            change(name, data)
            return data
        monkeypatch.setattr(hooks, "results", results)

    def each_record_list(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from each_record_list(v)
        elif isinstance(node, list):
            if any(isinstance(v, dict) for v in node):
                yield node
            for v in node:
                yield from each_record_list(v)

    pages = {p.relative_to(DOCS).as_posix(): p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md")}
    render = lambda page: hooks.VALUE.sub(lambda m: hooks.render_value(m, page), pages[page])  # noqa: E731
    selecting = sorted({page for page, text in pages.items() if re.search(r"\{\{[^}]*\[\w+=[^\]]+\]", text)})
    assert "handbook/optimizer-offload.md" in selecting and "labs/lab-11-zero-fsdp.md" in selecting
    before = {page: render(page) for page in selecting}

    rerun(lambda name, data: [records.reverse() for records in each_record_list(data)])
    assert {page: render(page) for page in selecting} == before

    # the review's case: `bench/cpu_adam_bench.py --sizes 128x2` wrote one set, the smallest
    def one_small_set(name, data):
        if name == "cpu_adam_bench":
            data["sets"] = [s for s in data["sets"] if s["params"] == 470528]
    rerun(one_small_set)
    with pytest.raises(Exception, match=r"no entry sets\[params=12905472\] \(it has params=470528\)"):
        render("handbook/optimizer-offload.md")

    # every selector on every page: its entry gone, a build error that names it
    monkeypatch.setattr(hooks, "results", published)
    dropped = 0
    for page, name, path in _value_references(hooks):
        if "[" not in path:
            continue
        steps = hooks._steps(path)
        for i, step in enumerate(steps):
            m = hooks.STEP.match(step)
            if not m.group("field"):
                continue
            keys = [hooks.STEP.match(s).group("key") for s in steps[:i + 1]]
            selectors = steps[:i]
            field, value = m.group("field"), m.group("value")

            def drop(n, data, name=name, keys=keys, selectors=selectors, field=field, value=value):
                if n != name:
                    return
                node = data.get("numbers", data) if n.startswith("lab-") else data
                for key, sel in zip(keys, selectors + [None]):
                    node = node[key]
                    s = hooks.STEP.match(sel) if sel else None
                    if s and s.group("field"):
                        node = next(r for r in node if str(r.get(s.group("field"))) == s.group("value"))
                node[:] = [r for r in node if str(r.get(field)) != value]
            rerun(drop)
            with pytest.raises(Exception, match=re.escape(f"[{field}={value}]") + r" \(it has "):
                hooks._evaluate(f"{name}:{path}", page)
            dropped += 1
    assert dropped >= 40


def test_a_table_may_break_a_long_name_where_its_words_join_and_nowhere_else():
    """A table's text gets a break point after each underscore between word characters, escaped or
    not, and before a capital that starts a word inside a name; tags, attributes, units (GiB) and
    text outside tables are left as they were."""
    spec = importlib.util.spec_from_file_location("infralab_hooks_breaks", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = ('<p>keep_this</p><table><tr><td><a href="#a_b" title="NoBreak">gradient&#95;as&#95;bucket_view</a></td>'
            '<td>_lead and trail_ DDP + ZeroRedundancyOptimizer, 29.92 GiB, forward=False</td></tr></table>')
    assert hooks.table_break_points(page) == (
        '<p>keep_this</p><table><tr><td><a href="#a_b" title="NoBreak">gradient&#95;<wbr>as&#95;<wbr>bucket_<wbr>view'
        '</a></td><td>_lead and trail_ DDP + Zero<wbr>Redundancy<wbr>Optimizer, 29.92 GiB, forward=<wbr>False</td></tr></table>')
