"""The site in a real browser: Debian's headless Chromium, driven by Playwright.

Every page loads with no console error and no request outside loopback; search finds Lab 02;
the dark-mode toggle works; on a 390-px phone in dark mode and at 1,280 px in light mode every page
keeps to the screen's width, every text and control reads at WCAG AA contrast, no table breaks a
word, and the figures follow the palette. Skipped where Chromium or Playwright is missing, except
under CI=true, where that is a failure.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlencode, urlsplit

import pytest

from labkit.labs import STARTERS
from conftest import ROOT
from test_bench import load_bench
pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = load_bench("fit_ui_bench").ARGS  # Chromium's flags, one list for the tests and the benchmark
LOOPBACK_ONLY = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost"  # no other host resolves


def _missing(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"browser tests cannot run in CI: {reason}")
    pytest.skip(reason)


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture(scope="module")
def server(built_site):
    handler = functools.partial(QuietHandler, directory=str(built_site["dir"]))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM:
        _missing("Debian's chromium is not installed")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[*ARGS, LOOPBACK_ONLY], headless=True)
        yield b
        b.close()


class Watch:
    """Records console errors, page errors and every request that leaves loopback, and blocks it: by
    intercepting each request (``intercept``), or, cheaper for a walk over every page, by watching the
    requests the page makes while the browser's resolver (``browser``'s LOOPBACK_ONLY) sends any other
    host nowhere."""

    def __init__(self, page, intercept: bool = True):
        self.errors: list[str] = []
        self.outside: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        if intercept:
            page.route("**/*", self._route)
        else:
            page.on("request", lambda request: None if _loopback(request.url) else self.outside.append(request.url))

    def _route(self, route):
        if _loopback(route.request.url):
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()


def _loopback(url: str) -> bool:
    return url.startswith(("data:", "blob:")) or urlsplit(url).hostname in ("127.0.0.1", "localhost")


def site_pages(site_dir: Path) -> list[str]:
    pages = []
    for html in sorted(site_dir.rglob("index.html")):
        rel = html.parent.relative_to(site_dir).as_posix()
        pages.append("/" if rel == "." else f"/{rel}/")
    return pages


def test_search_finds_lab_02_by_checkpoint(browser, server):
    page = browser.new_page()
    watch = Watch(page)
    page.goto(server + "/", wait_until="load")
    box = page.locator("input.md-search__input")
    box.click()
    box.press_sequentially("checkpoint", delay=30)  # Material searches on key events
    results = page.locator(".md-search-result__item a")
    results.first.wait_for(timeout=15_000)
    hrefs = [results.nth(i).get_attribute("href") for i in range(results.count())]
    assert any("labs/lab-02-single-gpu-training/" in (h or "") for h in hrefs), hrefs
    assert not watch.errors and not watch.outside
    page.close()


def test_dark_mode_toggle(browser, server):
    context = browser.new_context(color_scheme="light")
    page = context.new_page()
    watch = Watch(page)
    page.goto(server + "/labs/lab-02-single-gpu-training/", wait_until="load")
    scheme = "document.body.getAttribute('data-md-color-scheme')"
    assert page.evaluate(scheme) == "default"
    page.locator("form[data-md-component=palette] label:visible").first.click()
    page.wait_for_function(f"{scheme} === 'slate'", timeout=5_000)
    page.reload(wait_until="load")
    assert page.evaluate(scheme) == "slate", "the choice survives a reload"
    assert not watch.errors and not watch.outside
    context.close()


def test_lab_page_features_on_a_phone_in_dark_mode(browser, server):
    context = browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="dark",
                                  device_scale_factor=2, is_mobile=True, has_touch=True)
    page = context.new_page()
    watch = Watch(page)
    page.goto(server + "/labs/lab-02-single-gpu-training/", wait_until="load")
    assert page.evaluate("document.body.getAttribute('data-md-color-scheme')") == "slate"
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the page scrolls sideways by {overflow}px on a phone"
    assert page.locator("[data-il=run-it]").is_visible()
    assert page.locator("[data-il-badge]").first.is_visible()
    details = page.locator(".il-badge__details").first
    assert not details.is_visible()
    page.locator("[data-il-badge] > summary").first.tap()  # provenance opens on a tap, not only on hover
    assert details.is_visible() and "torch" in details.inner_text()
    assert page.locator(".md-annotation").count() >= 4, "code annotations rendered"
    assert page.locator(".md-code__button, .md-clipboard").count() >= 3, "copy buttons"
    for img in page.locator("figure img").all():
        img.scroll_into_view_if_needed()
        assert img.evaluate("i => i.complete && i.naturalWidth > 0"), img.get_attribute("src")
    assert not watch.errors and not watch.outside
    context.close()


def test_instant_navigation_and_notebook_figures(browser, server):
    page = browser.new_page()
    watch = Watch(page)
    page.goto(server + "/notebooks/", wait_until="load")
    page.locator("article a[href$='notebooks/lab-02-single-gpu-training/']:visible").first.click()
    page.wait_for_url("**/notebooks/lab-02-single-gpu-training/", timeout=10_000)
    page.locator(".jp-OutputArea-output img").first.wait_for(timeout=10_000)
    widths = page.locator(".jp-OutputArea-output img").evaluate_all("imgs => imgs.map(i => i.naturalWidth)")
    assert widths and min(widths) > 100
    download = page.locator("a[download]").first.get_attribute("href")
    assert download.endswith(".ipynb")
    assert not watch.errors and not watch.outside
    page.close()


PHONE_DARK = dict(viewport={"width": 390, "height": 844}, color_scheme="dark", device_scale_factor=2,
                  is_mobile=True, has_touch=True)
DESKTOP_LIGHT = dict(viewport={"width": 1280, "height": 800}, color_scheme="light")

FIGURE_FONTS = """async (img) => {
  // The smallest text of an SVG figure, in CSS pixels as this screen shows it. The SVG the <img> shows
  // (its currentSrc: the phone layout on a phone) is laid out off-screen at the <img>'s rendered width,
  // and each <text> is measured as the browser lays it out: its computed font size (from its own
  // style, a class or a parent group alike) times the scale of its screen matrix (the viewBox's
  // scale and any transform on the way, rotation included).
  const src = img.currentSrc || img.src;
  const text = await (await fetch(src)).text();
  const svg = document.importNode(new DOMParser().parseFromString(text, "image/svg+xml").documentElement, true);
  for (const style of svg.querySelectorAll("style")) style.textContent = style.textContent.replace(/:root/g, "svg");
  const width = img.getBoundingClientRect().width;
  const host = document.createElement("div");
  host.style.cssText = `position:absolute;left:0;top:0;width:${width}px;visibility:hidden;pointer-events:none`;
  svg.setAttribute("width", String(width));
  svg.removeAttribute("height");
  host.appendChild(svg);
  document.body.appendChild(host);
  try {
    const sizes = [...svg.querySelectorAll("text")].filter((t) => t.textContent.trim()).map((t) => {
      const m = t.getScreenCTM();
      return parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b);
    });
    return {src: img.getAttribute("src"), shown: src, texts: sizes.length, min_px: Math.min(...sizes), width};
  } finally {
    host.remove();
  }
}"""


FIGURES = """async () => {
  // Every SVG figure of the article, brought into view (a lazy one loads then), waited for (10 s at most)
  // and measured by FIGURE_FONTS, with the CSS filter drawn over it.
  const fonts = @FONTS@;
  const out = [];
  for (const img of document.querySelectorAll("article img[src$='.svg']")) {
    img.scrollIntoView({block: "center"});
    for (let waited = 0; !(img.complete && img.naturalWidth > 0) && waited < 10000; waited += 25)
      await new Promise((done) => setTimeout(done, 25));
    if (!(img.complete && img.naturalWidth > 0)) out.push({src: img.getAttribute("src"), loaded: false});
    else out.push({...(await fonts(img)), loaded: true, filter: getComputedStyle(img).filter});
  }
  return out;
}""".replace("@FONTS@", FIGURE_FONTS)


def _palette_pixels(png: bytes, name: str) -> tuple[int, int]:
    """How many pixels of a screenshot are the palette colour ``name`` as the light palette draws it,
    and as the dark one does."""
    import io

    from PIL import Image

    from labkit.plot import PALETTE

    image = Image.open(io.BytesIO(png)).convert("RGB")
    targets = [tuple(int(value[i:i + 2], 16) for i in (1, 3, 5)) for value in PALETTE[name]]
    counts = [0, 0]
    for pixel, n in Counter(image.get_flattened_data()).items():
        for k, target in enumerate(targets):
            if max(abs(a - b) for a, b in zip(pixel, target)) <= 3:
                counts[k] += n
    return counts[0], counts[1]


def test_figures_follow_the_site_palette_and_its_toggle(browser, server):
    """An SVG shown through <img> takes the page's color-scheme: on the light palette its areas are
    the palette's light values, on slate its dark ones, and the toggle switches them without a reload."""
    context = browser.new_context(color_scheme="light", viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(server + "/labs/lab-02-single-gpu-training/", wait_until="load")
    figure = page.locator("article img[src*='results/'][src$='timeline.svg']").first
    figure.scroll_into_view_if_needed()
    page.wait_for_function("i => i.complete", arg=figure.element_handle())
    light, dark = _palette_pixels(figure.screenshot(), "blue")  # the parameters' area
    assert light > 500 and dark == 0, (light, dark)
    page.locator("form[data-md-component=palette] label:visible").first.click()
    page.wait_for_function("document.body.getAttribute('data-md-color-scheme') === 'slate'")
    page.wait_for_timeout(200)
    light, dark = _palette_pixels(figure.screenshot(), "blue")
    assert dark > 500 and light == 0, (light, dark)
    context.close()


READABLE = """(root) => {
  // WCAG 2.1 contrast of each visible text and control under root against what is drawn behind it:
  // the backgrounds up the tree to the first opaque one, translucent ones blended as drawn, the text's
  // colour faded by the opacity of it and its ancestors. Text needs 4.5:1, large text (24 px, or
  // 18.66 px bold) and a control without text (an icon) 3:1.
  const rgba = (c) => { const v = (c.match(/[\\d.]+/g) || [0, 0, 0, 0]).map(Number); return [v[0], v[1], v[2], v.length > 3 ? v[3] : 1]; };
  const over = (top, under) => [0, 1, 2].map((i) => top[i] * top[3] + under[i] * (1 - top[3]));
  const lum = (rgb) => { const [r, g, b] = rgb.map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  // Both walk up the tree; each element's answer is kept, so a page's texts share their ancestors' work.
  const known = new Map(), opacity = new Map();
  const behind = (el) => {  // the colour drawn behind el's text: white under the root
    if (!el) return [255, 255, 255];
    if (!known.has(el)) {
      const c = rgba(getComputedStyle(el).backgroundColor);
      known.set(el, c[3] >= 1 ? c.slice(0, 3) : c[3] > 0 ? over(c, behind(el.parentElement)) : behind(el.parentElement));
    }
    return known.get(el);
  };
  const faded = (el) => {
    if (!el) return 1;
    if (!opacity.has(el)) opacity.set(el, Number(getComputedStyle(el).opacity) * faded(el.parentElement));
    return opacity.get(el);
  };
  const out = [], seen = new Set();
  const check = (el, control) => {
    if (seen.has(el)) return;
    seen.add(el);
    const s = getComputedStyle(el), box = el.getBoundingClientRect();
    if (s.visibility !== "visible" || !box.width || !box.height || box.right <= 0 || box.left >= innerWidth) return;
    if (el.closest("svg, [hidden], .md-sidebar, .md-search, .md-skip, .md-tooltip, .md-dialog")) return;
    const o = faded(el);
    if (o < 0.05) return;
    const bg = behind(el), fg = rgba(s.color), ink = over([fg[0], fg[1], fg[2], fg[3] * o], bg);
    const a = lum(ink), b = lum(bg), px = parseFloat(s.fontSize), text = (el.innerText || el.value || "").trim();
    if (!control && !text) return;  // no rendered text (innerText empty, as a link being redrawn): nothing to read
    const large = px >= 24 || (px >= 18.66 && Number(s.fontWeight) >= 700);
    out.push({tag: el.tagName.toLowerCase(), cls: String(el.className).slice(0, 50), text: text.slice(0, 40), px,
              contrast: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05), need: large || (control && !text) ? 3 : 4.5,
              color: s.color, bg: `rgb(${bg.map(Math.round).join(", ")})`});
  };
  const top = document.querySelector(root);
  const walker = document.createTreeWalker(top, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) if (n.textContent.trim() && n.parentElement) check(n.parentElement, false);
  for (const el of top.querySelectorAll("input, select, textarea, button, .md-button")) check(el, true);
  return out;
}"""

SETTLED = """() => {
  // Every running CSS transition and finite animation at its end: contrast is read as the page settles
  // (a tab strip's scroll arrow fades in over 125 ms; read half-way, it is faint).
  for (const a of document.getAnimations()) if (a.effect && a.effect.getComputedTiming().endTime !== Infinity) a.finish();
}"""

BROKEN_WORDS = """() => {
  // Words (runs of letters and digits; a CamelCase name's words each on its own) that a table cell
  // breaks across two lines.
  const out = [];
  for (const cell of document.querySelectorAll("article td, article th")) {
    if (!cell.getClientRects().length) continue;
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      // a word: a run of letters and digits; a name's words joined in CamelCase count one by one
      for (const m of n.textContent.matchAll(/\\p{Lu}?\\p{Ll}+(?=\\p{Lu}\\p{Ll})|[\\p{L}\\p{N}]+?(?=\\p{Lu}\\p{Ll}|[^\\p{L}\\p{N}]|$)/gu)) {
        if (m[0].length < 2) continue;
        const r = document.createRange();
        r.setStart(n, m.index);
        r.setEnd(n, m.index + m[0].length);
        const lines = new Set([...r.getClientRects()].filter((q) => q.width > 0).map((q) => Math.round(q.top)));
        if (lines.size > 1) out.push(`${m[0]} in "${cell.textContent.trim().slice(0, 40)}"`);
      }
    }
  }
  return out;
}"""


LEAD_ON_FIRST_SCREEN = """() => {
  const h1 = document.querySelector('article h1');
  let p = h1.nextElementSibling;
  while (p && p.tagName !== 'P') p = p.nextElementSibling;  // past the "measured on" badge
  const img = document.querySelector('article figure img');
  return {sentence_bottom: p.getBoundingClientRect().bottom, image_top: img.getBoundingClientRect().top,
          screen: window.innerHeight};
}"""


TABLE_OVERFLOW = """(path) => [...document.querySelectorAll('article .md-typeset__scrollwrap')].flatMap(w => {
  // a lab table scrolls by 128 px at most, and its "total" column is on screen before any scrolling
  const out = [], over = w.scrollWidth - w.clientWidth, head = w.querySelector('tr');
  if (over > 128) out.push(`${path}: a table scrolls by ${over}px: ${head.innerText.slice(0, 60)}`);
  for (const th of w.querySelectorAll('th')) {
    if (th.innerText.trim() === 'total' && th.getBoundingClientRect().right > w.getBoundingClientRect().right + 1)
      out.push(`${path}: "total" is off screen: ${head.innerText.slice(0, 60)}`);
  }
  return out; })"""


def figure_problems(page, path: str, phone: bool) -> tuple[int, list[str]]:
    """Every SVG figure of the page fits its column, shows its smallest text at 12 CSS px or more (on
    a 390-px phone, the phone layout the page's <picture> picks there; at 1,280 px, the wide one), and
    draws its own palette (no filter). Returns how many it checked, and what is wrong. (One call into
    the page for all of its figures.)"""
    column = page.evaluate("document.querySelector('article').getBoundingClientRect().width")
    problems, checked = [], 0
    for info in page.evaluate(FIGURES):
        if not info["loaded"]:
            problems.append(f"{path} {info['src']}: the figure did not load in 10 s")
            continue
        checked += 1
        if info["width"] > min(column, 688) + 0.5 or info["texts"] == 0:
            problems.append(f"{path}: a figure is wider than its column or has no text: {info}")
        if info["min_px"] < 12:
            problems.append(f"{path} {info['src']}: small text in a figure, {info['min_px']:.1f}px")
        if info["filter"] != "none":
            problems.append(f"{path} {info['src']}: a CSS filter repaints the figure")
        if ("/results/" in info["src"] or "/assets/figures/" in info["src"]) and ("/phone/" in info["shown"]) != phone:
            problems.append(f"{path} {info['src']}: shows {info['shown']}")  # labkit.plot.save drew both layouts
    return checked, problems


@pytest.mark.parametrize("part", range(3))
@pytest.mark.parametrize("screen", ["phone-dark", "desktop-light"])
def test_every_page_on_a_phone_in_dark_mode_and_a_desktop_in_light_mode(browser, server, built_site, screen, part):
    """Every page (a third of them per test), opened once on a 390 x 844 phone in dark mode and once
    on a 1280 x 800 screen in light mode, is checked for all of this at each visit:
    - it loads (HTTP 200) with no console or page error and no request outside loopback (blocked);
    - the document never scrolls sideways, every visible text and control meets WCAG AA contrast
      against what is behind it, and no table breaks a word across two lines;
    - a lab page shows its real-scale sentence whole and the top of its figure (200 px of it at
      least) before any scrolling (tests/test_lab_pages.py checks that they are the page's lead);
    - at 1,280 px a lab table fits its column, or scrolls by 128 px at most, and its "total"
      column (right after the row label) is on screen before any scrolling;
    - every figure of a lab page or a handbook chapter passes :func:`figure_problems`."""
    phone = screen == "phone-dark"
    context = browser.new_context(**(PHONE_DARK if phone else DESKTOP_LIGHT))
    page = context.new_page()
    watch = Watch(page, intercept=False)
    problems, figures = [], 0
    every = site_pages(built_site["dir"])
    assert "/labs/lab-02-single-gpu-training/" in every and "/notebooks/lab-02-single-gpu-training/" in every
    assert len([p for p in every if re.match(r"^/labs/lab-\d\d-", p)]) == len(STARTERS)  # every lab's page
    pages = every[part::3]
    for path in pages:
        response = page.goto(server + path, wait_until="load")
        if response is None or response.status != 200:
            problems.append(f"{path}: HTTP {response.status if response else 'no response'}")
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        if overflow > 1:
            problems.append(f"{path}: scrolls sideways by {overflow}px")
        if re.match(r"^/labs/lab-\d\d-", path):
            at = page.evaluate(LEAD_ON_FIRST_SCREEN)
            if at["sentence_bottom"] > at["screen"] or at["image_top"] > at["screen"] - 200:
                problems.append(f"{path}: the lead is below the first screen: {at}")
            if not phone:
                problems += page.evaluate(TABLE_OVERFLOW, path)
        page.evaluate(SETTLED)
        faint = [t for t in page.evaluate(READABLE, "body") if t["contrast"] < t["need"]]
        problems += [f"{path}: {t['contrast']:.2f}:1 < {t['need']}: <{t['tag']} class={t['cls']!r}> {t['text']!r} "
                     f"({t['color']} on {t['bg']})" for t in faint[:5]]
        problems += [f"{path}: a table breaks {w}" for w in page.evaluate(BROKEN_WORDS)[:5]]
        if path.startswith(("/labs/lab-", "/handbook/")):
            checked, wrong = figure_problems(page, path, phone)
            figures, problems = figures + checked, problems + wrong
        page.wait_for_timeout(50)  # a late console error still lands on this page
        problems += [f"{path}: {e}" for e in watch.errors] + [f"{path}: request outside loopback: {u}"
                                                              for u in watch.outside]
        watch.errors.clear()
        watch.outside.clear()
    context.close()
    assert len(pages) >= 10 and figures >= 4, (len(pages), figures)
    assert not problems, f"{screen}:\n" + "\n".join(problems)




def serve_as_deployed(page, site_dir: Path) -> str:
    """Answer the page's requests for the site's own address (``site_url``) from the built site,
    without a server, and return that address. Material's instant navigation follows only links
    under the address its sitemap names, so a server on another port reloads every page."""
    site_url = re.search(r"^site_url:\s*(\S+)", (Path(__file__).parents[1] / "mkdocs.yml").read_text(encoding="utf-8"),
                         re.M).group(1).rstrip("/")

    def fulfil(route):
        target = site_dir / unquote(urlsplit(route.request.url).path).lstrip("/")
        if target.is_dir():
            target = target / "index.html"
        if target.is_file():
            route.fulfill(path=str(target))
        else:
            route.fulfill(status=404, body="not in the site")
    page.route(site_url + "/**", fulfil)  # registered after Watch's route, so it answers first
    return site_url


def home_on_a_phone(browser, site_dir: Path):
    """A 390-px phone in dark mode on the home page, served as deployed, marked so that
    ``follow_instantly`` can tell an instant navigation from a page load."""
    context = browser.new_context(**PHONE_DARK)
    page = context.new_page()
    watch = Watch(page)
    page.goto(serve_as_deployed(page, site_dir) + "/", wait_until="load")
    page.evaluate("window.__same_document = true")
    return context, page, watch


def follow_instantly(page, link, path: str, title: str) -> None:
    """Tap a link and wait for the page it opens (the address changes before the content does)."""
    link.tap()
    page.wait_for_url(f"**{path}", timeout=10_000)
    page.locator("article h1", has_text=title).wait_for(timeout=10_000)
    assert page.evaluate("window.__same_document === true"), "instant navigation, not a page load"


def test_interview_drill_by_keyboard_on_a_phone_in_dark_mode(browser, built_site):
    """The drill deals every question once, in a random order, one at a time: set up after an
    instant navigation, started from the keyboard, the answer hidden until Space, N and ← moving,
    Esc leaving, nothing passed on to Material's own N (next page), no sideways scrolling at 390 px."""
    context, page, watch = home_on_a_phone(browser, built_site["dir"])
    follow_instantly(page, page.locator("article a[href$='interview/']").first, "/interview/", "Interview prep")
    start = page.get_by_role("button", name="Start the drill")
    start.wait_for(timeout=10_000)  # set up by drill.js on Material's document$
    assert page.evaluate("document.body.getAttribute('data-md-color-scheme')") == "slate"
    questions = page.locator("article details.question")
    n = questions.count()
    assert n >= 40, f"only {n} questions gathered"
    panel, answer = page.locator(".il-drill__panel"), page.locator(".il-drill__answer")
    assert not panel.is_visible()

    start.focus()
    page.keyboard.press("Enter")
    assert panel.is_visible() and not start.is_visible()
    assert page.evaluate("document.activeElement.classList.contains('il-drill__panel')"), "focus moves to the drill"
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none", "focus is visible"
    assert answer.get_attribute("aria-live") == "polite"
    assert answer.inner_text().strip() == "", "the answer stays hidden until asked for"
    reveal = page.get_by_role("button", name="Show the answer")
    assert reveal.get_attribute("aria-expanded") == "false"

    first = int(panel.get_attribute("data-il-drill-index"))
    summary = questions.nth(first).locator(":scope > summary").inner_text().strip()
    assert page.locator(".il-drill__question").inner_text().strip() == summary
    assert "Question 1 of" in page.locator(".il-drill__status").inner_text()
    page.keyboard.press(" ")
    shown = answer.inner_text().strip()
    expected = questions.nth(first).evaluate(
        "d => [...d.children].filter(c => c.tagName !== 'SUMMARY').map(c => c.textContent).join(' ')")
    assert shown and shown.split()[:8] == expected.split()[:8], (shown[:80], expected[:80])
    follow_up = answer.locator("details")  # the spoken answer first; its exact figures behind a closed follow-up
    assert follow_up.count() == 1 and follow_up.get_attribute("open") is None, follow_up.count()
    assert follow_up.locator("summary").inner_text().startswith("Follow-up")
    assert page.get_by_role("button", name="Hide the answer").get_attribute("aria-expanded") == "true"
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the drill scrolls sideways by {overflow}px on a phone"

    order = [first]
    for _ in range(n - 1):
        page.keyboard.press("n")
        order.append(int(panel.get_attribute("data-il-drill-index")))
        assert answer.inner_text().strip() == "", "each question starts with its answer hidden"
    assert sorted(order) == list(range(n)), "every question exactly once"
    assert order != list(range(n)), "a random order, not the page's"
    assert urlsplit(page.url).path == "/interview/", "N moved the drill, not Material to the next page"
    assert page.get_by_role("button", name="Next →").is_disabled()
    page.keyboard.press("ArrowLeft")
    assert int(panel.get_attribute("data-il-drill-index")) == order[-2]

    page.keyboard.press("Escape")
    assert not panel.is_visible() and start.is_visible()
    assert page.evaluate("document.activeElement.textContent") == "Start the drill", "focus returns to the button"
    assert not watch.errors and not watch.outside
    context.close()


def test_oom_page_is_one_tap_from_the_home_page_on_a_phone(browser, built_site):
    """The home page's first screen links "I have an OOM"; the page opens by instant navigation,
    reads on a 390-px phone in dark mode without sideways scrolling, and its lever tabs switch on a
    tap."""
    context, page, watch = home_on_a_phone(browser, built_site["dir"])
    link = page.locator("article a[href$='oom/']").first
    box = link.bounding_box()
    assert box and box["y"] + box["height"] <= 844, f"the OOM link is below the first screen: {box}"
    follow_instantly(page, link, "/oom/", "I have an OOM")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the OOM page scrolls sideways by {overflow}px on a phone"
    page.locator(".tabbed-labels label", has_text="Optimizer step").tap()
    assert page.locator(".tabbed-block", has_text="fused=True").is_visible()
    assert not watch.errors and not watch.outside
    context.close()

def test_start_here_and_two_chapters_read_on_a_phone_in_dark_mode(browser, server, tmp_path):
    """Start here and two chapters at 390 px in dark mode, each screenshotted (under tmp_path): the page
    does not scroll sideways, and every figure shows its smallest text at 12 CSS px or more (its SVG
    font size times the rendered width over the viewBox width)."""
    context = browser.new_context(**PHONE_DARK)
    page = context.new_page()
    watch = Watch(page)
    small, figures = [], {}
    for path in ("/start/", "/handbook/memory-accounting/", "/handbook/serving-memory/"):
        page.goto(server + path, wait_until="load")
        assert page.evaluate("document.body.getAttribute('data-md-color-scheme')") == "slate"
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{path} scrolls sideways by {overflow}px on a phone"
        images = page.locator("article img[src$='.svg']").all()
        for img in images:
            img.scroll_into_view_if_needed()
            page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=img.element_handle())
            info = img.evaluate(FIGURE_FONTS)
            assert info["width"] <= 390, info
            if info["min_px"] < 12:
                small.append(f"{path} {info['src']}: {info['min_px']:.1f}px")
        figures[path] = len(images)
        shot = tmp_path / f"{path.strip('/').replace('/', '-')}-390-dark.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000, shot
    context.close()
    assert figures["/start/"] >= 3, figures
    assert not small, "figure text under 12 CSS px on a 390-px phone:\n" + "\n".join(small)
    assert not watch.errors and not watch.outside


# ---------------------------------------------------------------- "Will it fit?" (docs/fit.md, docs/assets/fit.js)
FIT_TABLE = Path(__file__).resolve().parents[1] / "results" / "fit" / "table.json"
READ_FIT = """() => {
  const cats = {}, formulas = {};
  for (const tr of document.querySelectorAll('#fit-table tr[data-category]')) cats[tr.dataset.category] = tr.dataset.bytes;
  for (const el of document.querySelectorAll('#fit-formulas [data-formula]'))
    formulas[el.dataset.formula] = [el.querySelector('.il-fit__text').textContent, el.querySelector('.il-fit__filled').textContent.slice(2)];
  const m = document.getElementById('fit-moment');
  return {total: document.getElementById('fit-total').dataset.bytes, capacity: document.getElementById('fit-capacity').dataset.bytes,
          moment: m.dataset.moment, pool_requests: m.dataset.poolRequests || null, cats, formulas,
          fits: document.getElementById('fit-verdict').classList.contains('il-fit__verdict--yes'),
          levers: [...document.querySelectorAll('#fit-levers li[data-lever]')].map(li => [li.dataset.lever, li.dataset.kept === 'true', li.dataset.total, li.dataset.pulls]),
          command: [document.getElementById('fit-command').dataset.command || null, document.getElementById('fit-command').dataset.why || null],
          text: document.getElementById('fit').innerText};
}"""


def fit_query(fields: dict, gpu: str | None = None) -> str:
    """A configuration as the page's address carries it: each key a flag's spelling (``zero-stage``, as
    ``fit.py --zero-stage``; ``kv-dtype``, as ``serve_memory.py --kv-dtype``)."""
    text = {k.replace("_", "-"): ("true" if v is True else "false" if v is False else ",".join(v) if isinstance(v, list)
                                  else str(v)) for k, v in fields.items()}
    return "?" + urlencode(text | ({"gpu": gpu} if gpu else {}))


def open_fit(browser, server, query: str = "", **context):
    ctx = browser.new_context(**context)
    page = ctx.new_page()
    watch = Watch(page)
    page.goto(server + "/fit/" + query, wait_until="load")
    page.wait_for_selector("#fit-total[data-bytes]", timeout=15_000)
    return ctx, page, watch


def fit_gaps(got: dict, row: dict) -> tuple[float, list[str]]:
    """The largest relative gap of any category, and what differs from Python's row."""
    worst, problems = 0.0, []
    for cat, want in row["bytes"].items():
        value = int(got["cats"][cat])
        gap = abs(value - want) / want if want else float(value != 0)
        worst = max(worst, gap)
        if gap > 0.001:
            problems.append(f"{cat}: page {value:,}, Python {want:,}")
    v = row["verdict"]
    for key, page_value in (("total", int(got["total"])), ("capacity", int(got["capacity"])), ("moment", got["moment"]),
                            ("fits", got["fits"])):
        if page_value != v[key]:
            problems.append(f"{key}: page {page_value}, Python {v[key]}")
    if "pool_requests" in v and int(got["pool_requests"] or -1) != max(v["pool_requests"], 0) and v["pool"] > 0:
        problems.append(f"pool requests: page {got['pool_requests']}, Python {v['pool_requests']}")
    if [[name, kept, int(total), int(pulls)] for name, kept, total, pulls in got["levers"]] != row["levers"]:
        problems.append(f"levers: page {got['levers']}, Python {row['levers']}")
    if got["command"] != row["command"]:  # the command that traces it, or why none can: Python's words
        problems.append(f"command: page {got['command']}, Python {row['command']}")
    for cat, texts in row.get("formulas", {}).items():
        if row["bytes"][cat] and got["formulas"].get(cat) != texts:
            problems.append(f"formula of {cat}: page {got['formulas'].get(cat)}, Python {texts}")
    return worst, problems


def test_fit_calculator_agrees_with_python_in_every_configuration(browser, server):
    """Every configuration of results/fit/table.json (written by scripts/fit_table.py from the Python
    formulas) set through the page's address: every category within 0.1 % of Python, and the same
    total, moment, verdict, KV pool, levers, filled-in formulas, and command that traces it (or why
    none can). Each goes through the function the page runs on its address at load; every 50th is
    also a real load of that address."""
    table = json.loads(FIT_TABLE.read_text())
    rows = table["configurations"]
    assert len(rows) >= 500
    ctx, page, watch = open_fit(browser, server)
    worst, problems = 0.0, []
    for i, row in enumerate(rows):
        query = fit_query(row["query"], row["gpu"])
        if i % 50 == 0:
            page.goto(page.url.split("?")[0] + query, wait_until="load")
            page.wait_for_selector("#fit-total[data-bytes]")
        else:
            page.evaluate("q => InfraLabFit.load(q)", query)
        got = page.evaluate(READ_FIT)
        gap, wrong = fit_gaps(got, row)
        worst = max(worst, gap)
        problems += [f"{query}: {w}" for w in wrong]
        assert "NaN" not in got["text"] and "undefined" not in got["text"], query
    print(f"fit: {len(rows)} configurations, largest relative gap {worst:.2e}")
    assert not problems, "\n".join(problems[:20])
    assert not watch.errors and not watch.outside
    ctx.close()


def test_fit_controls_write_the_address_and_a_link_gives_the_result(browser, server):
    from labkit import labs

    fit = labs.load(1, "fit_formula")
    Inputs = labs.load(1, "fit_inputs").Inputs
    ctx, page, watch = open_fit(browser, server)
    page.select_option("#fit-model", "llama-3-70b")
    page.fill("#fit-dp", "8")
    page.select_option("#fit-zero_stage", "3")
    page.select_option("#fit-checkpointing", "full")
    want = sum(fit.estimate(Inputs(model="llama-3-70b", dp=8, zero_stage=3, checkpointing="full")).values())
    assert int(page.get_attribute("#fit-total", "data-bytes")) == want
    page.wait_for_function("location.search.includes('checkpointing=full')")  # written after the last change
    for part in ("model=llama-3-70b", "dp=8", "zero-stage=3", "checkpointing=full"):  # the flags' spellings
        assert part in page.url, page.url
    assert "zero_stage" not in page.url
    page.goto(page.url, wait_until="load")  # the address is the result
    page.wait_for_selector("#fit-total[data-bytes]")
    assert int(page.get_attribute("#fit-total", "data-bytes")) == want
    for query in ("?model=llama-3-70b&dp=8&zero-stage=3&checkpointing=full",
                  "?model=llama-3-70b&dp=8&zero_stage=3&checkpointing=full"):  # an old link (the field's name) too
        page.goto(page.url.split("?")[0] + query, wait_until="load")
        page.wait_for_selector("#fit-total[data-bytes]")
        assert int(page.get_attribute("#fit-total", "data-bytes")) == want, query
        assert page.input_value("#fit-zero_stage") == "3" and not page.locator("#fit-ignored").is_visible(), query
    page.select_option("#fit-task", "serve")
    page.select_option("#fit-kv_dtype", "fp8")
    page.fill("#fit-tp", "4")
    want = fit.estimate(Inputs(model="llama-3-70b", task="serve", kv_dtype="fp8", tp=4, dp=8, zero_stage=3,
                               checkpointing="full"))
    assert int(page.get_attribute("#fit-total", "data-bytes")) == sum(want.values())
    assert int(page.get_attribute("#fit-table tr[data-category=kv_cache]", "data-bytes")) == want["kv_cache"]
    # a pasted config.json: Meta-Llama-3-8B's sizes give the preset's bytes
    page.select_option("#fit-task", "train")
    page.locator(".il-fit__dims > summary").click()
    page.fill("#fit-config_json", json.dumps({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                                              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}))
    assert page.input_value("#fit-model") == "custom"
    want = fit.estimate(Inputs(model="llama-3-8b", dp=8, zero_stage=3, checkpointing="full", tp=4))
    assert int(page.get_attribute("#fit-total", "data-bytes")) == sum(want.values())
    assert not watch.errors and not watch.outside
    ctx.close()


def test_fit_verdict_says_by_how_much_it_does_not_fit(browser, server):
    """Llama-3-8B in pure bf16 (seq 1024) on an H100 is over by 77,898,892 B (80,302,613,644 against 80,224,714,752):
    the verdict says "over by 74.29 MiB" (Lab 13's report says "short"), not a ratio that rounds to 1.00×."""
    ctx, page, watch = open_fit(browser, server, "?precision=bf16&seq=1024")
    total, capacity = (int(page.get_attribute(i, "data-bytes")) for i in ("#fit-total", "#fit-capacity"))
    assert total - capacity == 77_898_892 and total > capacity
    text = page.inner_text("#fit-verdict")
    assert text.endswith("over by 74.29 MiB") and "×" not in text, text
    page.evaluate("q => InfraLabFit.load(q)", "?model=llama-3.2-1b")
    assert "to spare" in page.inner_text("#fit-verdict")
    assert not watch.errors
    ctx.close()


def test_fit_ladder_halves_the_batch_again_and_links_each_lever_to_its_lab(browser, server):
    """Llama-3-8B, a bf16 prefill of batch 8 on an L4: half the micro-batch twice (batch 2) fits; its cost
    is inference's, its link Lab 13's; a training step's fused AdamW links to Lab 02 (foreach against fused)."""
    ctx, page, watch = open_fit(browser, server, "?model=llama-3-8b&task=infer&precision=bf16&batch=8&gpu=l4-24gb")
    lever = page.locator("#fit-levers li[data-lever='half the micro-batch']")
    assert lever.get_attribute("data-pulls") == "2" and "fits" in lever.inner_text(), lever.inner_text()
    assert "lower throughput" in lever.inner_text() and "accumulation" not in lever.inner_text()
    assert "lab-13-will-it-fit" in lever.locator("small a").get_attribute("href")
    assert "batch=2" in lever.locator("strong a").get_attribute("href")
    assert "No combination" not in page.inner_text("#fit-levers")
    page.evaluate("q => InfraLabFit.load(q)", "?model=llama-3-70b&dp=8")
    fused = page.locator("#fit-levers li[data-lever='fused AdamW'] small a")
    assert "lab-02-single-gpu-training" in fused.get_attribute("href")
    assert not watch.errors
    ctx.close()


def test_fit_lora_and_qlora_link_their_categories_to_lab_15(browser, server):
    """Lab 13 traces LoRA and QLoRA with Lab 15's adapters and NF4 weights: a QLoRA step's adapters, their
    gradients and optimizer state, the frozen weights and their constants say Lab 15 measures them; the
    activations stay Lab 04's, and a full step's parameters are Lab 02's again."""
    ctx, page, watch = open_fit(browser, server, "?method=qlora&precision=bf16&lora-rank=16")
    for cat in ("parameters", "gradients", "optimizer_state", "frozen_weights", "quant_constants"):
        cell = page.locator(f"#fit-table tr[data-category={cat}] td:last-child")
        assert cell.inner_text() == "Lab 15", cat
        assert "lab-15-fine-tuning" in cell.locator("a").get_attribute("href"), cat
    assert page.inner_text("#fit-table tr[data-category=activations] td:last-child") == "Lab 04"
    page.evaluate("q => InfraLabFit.load(q)", "")
    assert page.inner_text("#fit-table tr[data-category=parameters] td:last-child") == "Lab 02"
    assert not watch.errors
    ctx.close()


def test_fit_page_puts_the_calculator_first_and_its_code_behind_a_legend(browser, server):
    """The inputs and the verdict come before any prose section; the formula code is in one collapsed block,
    closed on load, whose legend names every name that code uses (S.c, x.seq, ROW, ceil_div: the names
    scripts/fit_table.py finds in the code as the page shows it); the precision choice "bf16" says it is
    pure bf16, with no fp32 master."""
    from test_fit_formula import table_script

    ctx, page, watch = open_fit(browser, server)
    first = page.evaluate("""() => { const fit = document.getElementById('fit'), h2 = document.querySelector('article h2');
        return !!(fit.compareDocumentPosition(h2) & Node.DOCUMENT_POSITION_FOLLOWING); }""")
    assert first, "the calculator comes before the page's first section"
    block = page.locator("article details", has=page.locator("summary", has_text="How the formulas are written"))
    assert block.count() == 1 and block.evaluate("d => d.open") is False
    assert not block.locator("pre").first.is_visible() and not block.locator("table").is_visible()
    codes = block.locator("pre code").evaluate_all("els => els.map(e => e.textContent)")
    assert len(codes) == 8, len(codes)  # state, activations, moments, serve (fit_formula.py), flags (fit_moments.py),
    # compiled (fit_compiled.py), lora (fit_lora.py), serve-terms (fit_serve.py)
    used = set(table_script().names_used("\n".join(codes)))
    named = set(block.locator("table tbody tr td:first-child").evaluate_all("tds => tds.map(t => t.textContent.trim())"))
    assert {"S.c", "S.Pt", "ROW", "SLOT", "LSE", "ceil_div", "x.zero_stage"} <= used, used
    assert used <= named, sorted(used - named)
    block.locator("summary").click()
    assert block.locator("table").is_visible()
    option = page.locator("#fit-precision option[value=bf16]")
    assert option.inner_text() == "pure bf16 (no fp32 master)"
    assert "pure bf16 (no fp32 master)" in page.inner_text("#fit-hint-precision")
    assert not watch.errors and not watch.outside
    ctx.close()


def test_every_kind_of_change_updates_the_calculator(browser, server):
    """Every change a reader makes (bench/fit_ui_bench.py's list, which times them on a throttled CPU),
    made one after another on one page, leaves the answer a fresh page gives for the same inputs
    (its address), with no script error."""
    bench = load_bench("fit_ui_bench")
    ctx, page, watch = open_fit(browser, server, viewport={"width": 390, "height": 844}, is_mobile=True)
    fresh = ctx.new_page()
    total = "document.getElementById('fit-total').dataset.bytes"
    state, wrong = {}, []
    for name, a, b in [("task", "train", "train"), *bench.TRAIN, ("task", "serve", "serve"), *bench.SERVE]:
        for value in (a, b):
            page.evaluate(bench.CHANGE, [name, value])
            state[name] = value
            fresh.goto(f"{server}/fit/?{urlencode(state)}", wait_until="load")
            fresh.wait_for_selector("#fit-total[data-bytes]", timeout=15_000)
            if page.evaluate(total) != fresh.evaluate(total):
                wrong.append(f"{name}={value}: {page.evaluate(total)} on the page, {fresh.evaluate(total)} fresh")
    assert len(state) > 10 and not wrong, wrong
    assert not watch.errors
    ctx.close()


def test_fit_ui_bench_times_every_change(built_site, tmp_path):
    """The benchmark runs on the built site and writes a median per change with its provenance."""
    bench = load_bench("fit_ui_bench")
    out = tmp_path / "ui.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_ui_bench.py"), "--site-dir", str(built_site["dir"]),
                           "--repeats", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(out.read_text())
    assert set(saved["median_ms"]) == {f"{n}={a}" for n, a, _ in (*bench.TRAIN, *bench.SERVE)}
    assert all(ms > 0 for ms in saved["median_ms"].values()) and saved["provenance"]["device_type"] == "cpu"
    assert "slowest:" in proc.stdout


def test_fit_reads_on_a_phone_in_dark_mode(browser, server):
    """390 px, dark palette, the longest formulas and every lever open: nothing scrolls sideways, no text
    under 11 CSS px, every text at 4.5:1 contrast or more against what is behind it (WCAG AA)."""
    ctx, page, watch = open_fit(browser, server, "?model=mixtral-8x7b&dp=8&zero_stage=3&lora_rank=8&checkpointing=none",
                                viewport={"width": 390, "height": 844}, color_scheme="dark", device_scale_factor=2,
                                is_mobile=True, has_touch=True)
    assert page.evaluate("document.body.getAttribute('data-md-color-scheme')") == "slate"
    page.locator(".il-fit__dims > summary").tap()
    page.locator("#fit-symbols").evaluate("el => el.closest('details').open = true")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the calculator scrolls sideways by {overflow}px on a phone"
    texts = page.evaluate(READABLE, "#fit")
    assert len(texts) > 50
    small = [t for t in texts if t["px"] < 11]
    faint = [t for t in texts if t["contrast"] < t["need"]]
    assert not small, small[:5]
    assert not faint, faint[:5]
    bar = page.locator("#fit-bar").bounding_box()
    assert bar["width"] > 300 and bar["x"] >= 0 and bar["x"] + bar["width"] <= 390
    assert page.locator("#fit-bar .il-fit__seg").count() >= 3
    assert not watch.errors and not watch.outside
    ctx.close()


def test_fit_is_keyboard_reachable_with_labels(browser, server):
    ctx, page, watch = open_fit(browser, server)
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('#fit input, #fit select, #fit textarea')]
        .filter(c => !document.querySelector(`label[for="${c.id}"]`)?.textContent.trim()).map(c => c.id || c.name)""")
    assert not unlabelled
    page.focus("#fit-model")
    seen = []
    for _ in range(40):
        page.keyboard.press("Tab")
        seen.append(page.evaluate("document.activeElement.id || document.activeElement.tagName"))
    order = [s for s in seen if s in ("fit-task", "fit-precision", "fit-seq", "fit-checkpointing", "fit-dp", "fit-gpu")]
    assert order == sorted(order, key=seen.index) and {"fit-task", "fit-seq", "fit-dp"} <= set(order), seen
    page.focus("#fit-seq")
    page.keyboard.press("Control+A")
    page.keyboard.type("8192")
    from labkit import labs

    fit, Inputs = labs.load(1, "fit_formula"), labs.load(1, "fit_inputs").Inputs
    assert int(page.get_attribute("#fit-total", "data-bytes")) == sum(fit.estimate(Inputs(seq=8192)).values())
    assert not watch.errors
    ctx.close()


@pytest.mark.parametrize("width", [390, 1280])
def test_fit_result_area_keeps_its_size_while_typing(browser, server, width):
    """Typing into Sequence, an invalid character included (its message comes and goes): the result
    area, the table and every field below Sequence stay where they are."""
    ctx, page, watch = open_fit(browser, server, viewport={"width": width, "height": 844})
    page.locator("#fit-seq").scroll_into_view_if_needed()
    page.focus("#fit-seq")
    page.keyboard.press("Control+A")
    rect = ("id => { const r = document.getElementById(id).getBoundingClientRect(); "
            "return [r.x, r.y + (id === 'fit-result' ? 0 : window.scrollY), r.width, r.height]; }")
    below = page.evaluate("""() => { const top = document.getElementById('fit-seq').getBoundingClientRect().bottom;
        return [...document.querySelectorAll('#fit form input, #fit form select, #fit form textarea')]
          .filter(c => c.offsetParent && c.getBoundingClientRect().top > top).map(c => c.id); }""")
    assert {"fit-checkpointing", "fit-dp", "fit-tp", "fit-gpu"} <= set(below), below
    before = {i: page.evaluate(rect, i) for i in ("fit-result", "fit-table", *below)}
    marked = False
    for key in ["4", "0", "x", "Backspace", "Backspace", "Backspace",
                "1", "3", "1", "0", "7", "2", "x", "Backspace", "Backspace", "Backspace", "Backspace", "Backspace",
                "Backspace", "Backspace", "-", "5", "Backspace", "Backspace", "6", "5", "5", "3", "6"]:
        page.keyboard.press(key)
        marked |= page.locator("#fit-err-seq").is_visible()
        for i, r in before.items():
            now = page.evaluate(rect, i)
            assert all(abs(a - b) < 0.5 for a, b in zip(now, r)), (key, i, r, now)
    assert marked, "typing 40x never showed Sequence's error"
    assert page.input_value("#fit-seq") == "65536"
    page.wait_for_function("location.search.includes('seq=65536')")
    assert not watch.errors
    ctx.close()


def test_fit_bad_input_is_shown_next_to_the_field_never_nan(browser, server):
    table = json.loads(FIT_TABLE.read_text())
    ctx, page, watch = open_fit(browser, server)
    for case in table["bad"]:
        page.evaluate("q => InfraLabFit.load(q)", "")
        if "query" in case:
            page.evaluate("q => InfraLabFit.load(q)", fit_query(case["query"]))
        else:
            page.evaluate("() => { const d = document.querySelector('.il-fit__dims'); d.open = true; }")
            page.fill("#fit-config_json", case["config_json"])
        error = page.locator(f"#fit-err-{case['field']}")
        assert error.is_visible() and error.inner_text().strip(), (case, page.evaluate(READ_FIT)["text"][:200])
        control = "#fit-config_json" if case["field"] == "config_json" else f"#fit-{case['field']}"
        assert page.locator(control).is_visible(), case  # beside a field the reader sees, whatever the task
        assert page.get_attribute(control, "aria-invalid") == "true", case
        got = page.evaluate(READ_FIT)
        assert got["total"].isdigit() and "NaN" not in got["text"] and "undefined" not in got["text"], case
        task = case.get("query", {}).get("task", "train")  # the result is the task's, never another's
        assert got["moment"] == task if task != "train" else got["moment"] not in ("infer", "serve"), (case, got["moment"])
        offered = "([c, v]) => { const s = document.querySelector(c); return s.tagName !== 'SELECT' || [...s.options].some(o => o.value === v); }"
        given = case.get("query", {}).get(case["field"])
        if given is not None and not page.evaluate(offered, [control, given]):  # never a silent default
            text = error.inner_text()
            assert given in text and "computed with" in text, (case, text)
    for query, key in (("?sequence=8192", "sequence"), ("?task=serve&zero_stage=2&foo=1", "foo")):
        page.evaluate("q => InfraLabFit.load(q)", query)
        notice = page.locator("#fit-ignored")
        assert notice.is_visible() and key in notice.inner_text() and "zero_stage" not in notice.inner_text(), query
    page.evaluate("q => InfraLabFit.load(q)", "?seq=8192")
    assert not page.locator("#fit-ignored").is_visible()
    ctx.close()
    # a first visit with a bad address: the field is marked, the defaults' result is shown, never a blank
    ctx, page, watch = open_fit(browser, server, "?kv_heads=5")
    assert page.locator("#fit-err-kv_heads").is_visible()
    assert page.get_attribute("#fit-total", "data-bytes").isdigit()
    assert not watch.errors and not watch.outside
    ctx.close()
