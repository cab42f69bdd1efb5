"""Lab pages lead with the insight and stay short enough to read: measured on the built site.

What a reader sees of a lab page is its article (``<article class="md-content__inner">``) less the
template. Counted, for each lab page:

* **prose**: the words of the article's visible text outside code listings and outside collapsed
  blocks. Headings, paragraphs, lists, tables (their numbers too), open admonitions and figure
  captions are prose, and so is inline ``<code>`` inside a sentence.
  A listing's annotations (the numbered list after it, which the theme folds into tooltips inside
  the listing) are sentences a reader reads: they are prose too.
* **with the code**: the same plus the code listings (``<pre>`` blocks).

Never counted: collapsed blocks (``<details>`` without ``open``: ``??? note`` and the interview's
``??? question`` answers, which a reader opens on purpose), and the template around the article:
the tags, the header's edit and view buttons, the "measured on" badge, the "Run it" box (its
commands and buttons come from the front matter), the headings' permalink signs, the page's source
footer and the feedback form. Image alt text is not visible and not counted; a figure's caption is.

A word is a run of characters between white space that holds at least one letter or digit
("19.16", "`zero_grad`" and "Llama-3-8B" are one word each; "·" and "→" are none).

Targets (the handbook's issue on teaching): at most 2,000 words of prose and 4,000 with the code.
``pytest tests/test_lab_pages.py -s`` prints every page's two numbers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from bs4 import BeautifulSoup, Tag

from labkit import labs

ROOT = Path(__file__).resolve().parents[1]
LAB_PAGES = sorted((ROOT / "docs" / "labs").glob("lab-*.md"))
PROSE_LIMIT = 2000
WITH_CODE_LIMIT = 4000

pytestmark = pytest.mark.site

WORD = re.compile(r"\S+")
HAS_ALNUM = re.compile(r"[0-9A-Za-z]")
# The template's parts inside the article (overrides/main.html and Material's partials).
TEMPLATE = ["nav.md-tags", "a.md-content__button", "details.il-badge", "div.il-run-it", "a.headerlink",
            "aside.md-source-file", ".md-source-file", "form.md-feedback", ".md-feedback"]


def words(text: str) -> int:
    return sum(1 for w in WORD.findall(text) if HAS_ALNUM.search(w))


def article(html: str) -> Tag:
    """The page's article with the template's parts and the collapsed blocks taken out."""
    soup = BeautifulSoup(html, "html.parser")
    body = soup.select_one("article.md-content__inner")
    assert body is not None, "no article in the page"
    for selector in TEMPLATE:
        for node in body.select(selector):
            node.decompose()
    for node in body.find_all("details"):
        if not node.decomposed and not node.has_attr("open"):
            node.decompose()
    for node in body.find_all(["script", "style"]):
        node.decompose()
    return body


def listings(body: Tag) -> list[Tag]:
    """The code listings: each highlighted block (its file title with it), and any bare ``<pre>``."""
    found = body.find_all(lambda node: node.name == "div" and "highlight" in (node.get("class") or []))
    return found + [pre for pre in body.find_all("pre") if not any(pre in f.descendants for f in found)]


def count(html: str) -> tuple[int, int]:
    """(prose words, words with the code) of a built lab page."""
    body = article(html)
    with_code = words(body.get_text(" "))
    for listing in listings(body):
        listing.decompose()
    return words(body.get_text(" ")), with_code


def built_page(site: Path, page: Path) -> str:
    return (site / "labs" / page.stem / "index.html").read_text(encoding="utf-8")


def test_the_count_follows_its_rules():
    html = """<html><body><article class="md-content__inner md-typeset">
      <nav class="md-tags"><a class="md-tag">tag words</a></nav>
      <h1 id="t">Lab 99 · Title<a class="headerlink" href="#t">¶</a></h1>
      <details class="il-badge"><summary>measured on CPU</summary><p>template</p></details>
      <p>One sentence with <code>inline_code</code> and 19.16 GiB · here.</p>
      <div class="admonition il-run-it"><p>Commands</p><pre><code>python run.py</code></pre></div>
      <div class="language-python highlight"><pre><code>x = 1  # (1)!
y = 2</code></pre></div>
      <ol><li>An annotation of four.</li></ol>
      <pre>bare pre</pre>
      <table><tr><td>a cell</td><td>2</td></tr></table>
      <details class="note"><summary>Collapsed</summary><p>hidden words here</p></details>
      <details class="note" open><summary>Open</summary><p>shown</p></details>
    </article></body></html>"""
    # prose: Lab 99 Title | One sentence with inline_code and 19.16 GiB here. | An annotation of four.
    #        | a cell 2 | Open shown; code: x = 1 # (1)! y = 2 | bare pre
    assert count(html) == (3 + 8 + 4 + 3 + 2, 3 + 8 + 4 + 3 + 2 + 5 + 2)


def test_every_lab_page_is_built_and_counted(built_site):
    assert len(LAB_PAGES) == len(labs.STARTERS)  # every lab has its page
    for page in LAB_PAGES:
        prose, with_code = count(built_page(built_site["dir"], page))
        assert 0 < prose <= with_code


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_lab_page_stays_within_the_word_targets(built_site, page):
    prose, with_code = count(built_page(built_site["dir"], page))
    print(f"{page.stem}: {prose} words of prose, {with_code} with the code")
    assert prose <= PROSE_LIMIT, f"{page.stem}: {prose} words of prose (at most {PROSE_LIMIT})"
    assert with_code <= WITH_CODE_LIMIT, f"{page.stem}: {with_code} words with the code (at most {WITH_CODE_LIMIT})"


def lead(html: str) -> list[Tag]:
    """What a lab page shows between its title and its first section, template left out."""
    body = article(html)
    h1 = body.find("h1")
    assert h1 is not None
    out = []
    for node in h1.find_next_siblings():
        if node.name == "h2":
            assert node.get("id") == "concept-goal", f"the first section is {node.get('id')}"
            break
        out.append(node)
    return out


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_lab_page_leads_with_a_real_scale_sentence_and_a_figure(built_site, page):
    """Under the title, before "Concept goal": one sentence with a number, then a figure whose image
    has alt text and whose caption says what to notice."""
    nodes = lead(built_page(built_site["dir"], page))
    assert [n.name for n in nodes] == ["p", "figure"], f"{page.stem}: the lead is {[n.name for n in nodes]}"
    sentence = nodes[0].get_text(" ").strip()
    assert re.search(r"\d", sentence), f"{page.stem}: the lead sentence has no number: {sentence}"
    assert words(sentence) <= 60, f"{page.stem}: the lead is {words(sentence)} words; say it in one sentence"
    assert len(re.findall(r"[.!?](?=\s+[A-Z])", sentence)) == 0, f"{page.stem}: more than one sentence: {sentence}"
    img = nodes[1].find("img")
    assert img is not None and img.get("alt", "").strip(), f"{page.stem}: the lead figure needs alt text"
    caption = nodes[1].find("figcaption")
    assert caption is not None and "Notice" in caption.get_text(), f"{page.stem}: caption says what to notice"


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_lead_numbers_come_from_the_results(page):
    """The lead sentence's number is a build-hook placeholder, never typed."""
    text = page.read_text(encoding="utf-8").split("---\n", 2)[2]
    head = text.split("\n## Concept goal", 1)[0]
    paragraphs = [p for p in head.split("\n\n") if p.strip() and not p.lstrip().startswith(("#", "<figure"))]
    assert paragraphs, f"{page.name}: no lead sentence under the title"
    assert re.search(r"\{\{\s*lab-\d\d:[\w.\-\[\]=]+\s*\|", paragraphs[0]), f"{page.name}: the lead's number is typed"
