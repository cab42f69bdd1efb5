"""The site in a real browser: Debian's headless Chromium, driven by Playwright.

Every page loads with no console error and no request outside loopback; search finds Lab 02;
the dark-mode toggle works; a phone-sized screen in dark mode does not scroll sideways. Skipped
where Chromium or Playwright is missing, except under CI=true, where that is a failure.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


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
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


class Watch:
    """Records console errors, page errors and every request that leaves loopback (and blocks it)."""

    def __init__(self, page):
        self.errors: list[str] = []
        self.outside: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.route("**/*", self._route)

    def _route(self, route):
        host = urlsplit(route.request.url).hostname
        if route.request.url.startswith(("data:", "blob:")) or host in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()


def site_pages(site_dir: Path) -> list[str]:
    pages = []
    for html in sorted(site_dir.rglob("index.html")):
        rel = html.parent.relative_to(site_dir).as_posix()
        pages.append("/" if rel == "." else f"/{rel}/")
    return pages


def test_every_page_loads_cleanly_and_stays_on_loopback(browser, server, built_site):
    pages = site_pages(built_site["dir"])
    assert "/labs/lab-02-single-gpu-training/" in pages and "/notebooks/lab-02-single-gpu-training/" in pages
    context = browser.new_context()
    problems = []
    for path in pages:
        page = context.new_page()
        watch = Watch(page)
        response = page.goto(server + path, wait_until="load")
        page.wait_for_timeout(150)
        if response is None or response.status != 200:
            problems.append(f"{path}: HTTP {response.status if response else 'no response'}")
        problems += [f"{path}: {e}" for e in watch.errors]
        problems += [f"{path}: request outside loopback: {u}" for u in watch.outside]
        page.close()
    context.close()
    assert not problems, "\n".join(problems)


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


FIGURE_FONTS = """async (img) => {
  // The smallest text of an SVG figure, in CSS pixels as this screen shows it: the font size in the
  // SVG's own units, times the rendered width over the viewBox width.
  const text = await (await fetch(img.currentSrc || img.src)).text();
  const doc = new DOMParser().parseFromString(text, "image/svg+xml");
  const box = doc.documentElement.getAttribute("viewBox").split(/[ ,]+/).map(Number);
  const sizes = [...text.matchAll(/font-size:\\s*([0-9.]+)px/g)].map(m => Number(m[1]));
  const scale = img.getBoundingClientRect().width / box[2];
  return {src: img.getAttribute("src"), min_px: Math.min(...sizes) * scale, width: img.getBoundingClientRect().width};
}"""


def test_figures_read_on_a_phone_in_dark_mode(browser, server, built_site):
    """At 390 px, every figure on every lab page shows its smallest text at 11 CSS px or more, fits
    the screen, and in dark mode is drawn inverted on a transparent background (no white box)."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="dark",
                                  device_scale_factor=2, is_mobile=True, has_touch=True)
    page = context.new_page()
    small, checked = [], 0
    for path in site_pages(built_site["dir"]):
        if not path.startswith("/labs/lab-"):
            continue
        page.goto(server + path, wait_until="load")
        for img in page.locator("article img[src$='.svg']").all():
            img.scroll_into_view_if_needed()
            info = img.evaluate(FIGURE_FONTS)
            checked += 1
            assert info["width"] <= 390, info
            if info["min_px"] < 11:
                small.append(f"{path} {info['src']}: {info['min_px']:.1f}px")
            assert img.evaluate("i => getComputedStyle(i).filter").startswith("invert(1)")
    context.close()
    assert checked >= 12, f"only {checked} figures found"
    assert not small, "text under 11 CSS px on a 390-px phone:\n" + "\n".join(small)


def test_tables_show_their_total_without_scrolling(browser, server, built_site):
    """At 1280 px every lab table fits its column, or scrolls by a few pixels at most, and a table's
    "total" column is on screen before any scrolling (it comes right after the row label)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    problems = []
    for path in site_pages(built_site["dir"]):
        if not path.startswith("/labs/lab-"):
            continue
        page.goto(server + path, wait_until="load")
        problems += page.evaluate("""(path) => [...document.querySelectorAll('article .md-typeset__scrollwrap')].flatMap(w => {
            const out = [], over = w.scrollWidth - w.clientWidth, head = w.querySelector('tr');
            if (over > 48) out.push(`${path}: a table scrolls by ${over}px: ${head.innerText.slice(0, 60)}`);
            for (const th of w.querySelectorAll('th')) {
              if (th.innerText.trim() === 'total' && th.getBoundingClientRect().right > w.getBoundingClientRect().right + 1)
                out.push(`${path}: "total" is off screen: ${head.innerText.slice(0, 60)}`);
            }
            return out; })""", path)
    context.close()
    assert not problems, "\n".join(problems)


PHONE_DARK = dict(viewport={"width": 390, "height": 844}, color_scheme="dark", device_scale_factor=2,
                  is_mobile=True, has_touch=True)


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
    summary = questions.nth(first).locator("summary").inner_text().strip()
    assert page.locator(".il-drill__question").inner_text().strip() == summary
    assert "Question 1 of" in page.locator(".il-drill__status").inner_text()
    page.keyboard.press(" ")
    shown = answer.inner_text().strip()
    expected = questions.nth(first).evaluate(
        "d => [...d.children].filter(c => c.tagName !== 'SUMMARY').map(c => c.textContent).join(' ')")
    assert shown and shown.split()[:8] == expected.split()[:8], (shown[:80], expected[:80])
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
