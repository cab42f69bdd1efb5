"""MkDocs hooks: the one seam between the repository layout and the site.

* Notebooks live in ``notebooks/`` at the repository root, lab code in ``code/`` and measured
  artefacts in ``results/``. ``on_files`` adds them to the site: notebooks as pages (rendered by
  mkdocs-jupyter), lab sources and results as plain files a page can link to or embed.
* ``on_page_markdown`` checks a lab page's front matter (the starter and notebook it names must
  exist, or the build fails) and attaches what the template needs: the "measured on" badge, read
  from the provenance in the lab's ``results/<lab>/summary.json`` and compared with the current lab
  source hash. Notebook pages get the same badge through ``on_page_context``.
* Numbers become text here, and only here. A notebook publishes numbers and tables into
  ``results/<lab>/summary.json`` (``labkit.notebook.publish``); a page shows them with
  ``<!-- infralab:table lab-NN NAME -->`` (a table, rendered by ``labkit.table``),
  ``<!-- infralab:provenance lab-NN -->`` (where they were measured) and, inside a sentence,
  ``{{ lab-NN:NAME | KIND }}`` (one number, formatted as a table cell of that kind: ``bytes``,
  ``B``, ``int``, ``pct:1``, ``x:2``, ...; ``NAME`` may be a dotted path). A name that is not there
  fails the build. Every value is escaped: nothing in a results file becomes HTML.
* ``on_config`` adds every lab's page (and its ``extra_pages``), handbook chapter and notebook to
  the nav, in lab order, from the lab pages' front matter: adding a lab never edits the nav.
* Index pages are generated, so they grow with the labs without anyone editing them: a page
  holding ``<!-- infralab:catalogue -->``, ``<!-- infralab:labs -->``,
  ``<!-- infralab:notebooks -->``, ``<!-- infralab:chapters -->`` or ``<!-- infralab:interview -->``
  gets that table or section built from the lab pages' front matter and ``extra.catalogue``;
  ``<!-- infralab:performance -->`` gets the benchmark tables from ``results/*.json``.

* A figure a page shows from ``results/`` or ``docs/assets/figures/`` (an ``<img>`` of an SVG that
  ``labkit.plot.save`` wrote) becomes a ``<picture>`` whose source for a phone is its ``phone/``
  layout; ``assets/palette.css`` holds the plotting palette's colours as CSS variables for both of
  the site's palettes (the calculator's bar draws with them).

Replacing mkdocs-jupyter later means changing this file and the plugin entry, nothing else.
"""

from __future__ import annotations

import json
import posixpath
import re
from functools import cache
from pathlib import Path

import yaml
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

from labkit import labs
from labkit.notebook import provenance_table
from labkit.provenance import check_results, labkit_hash, source_hash
from labkit.table import Table, escape

ROOT = Path(__file__).resolve().parents[1]

STATIC_FROM_ROOT = {
    "code": ("*.py",),
    "results": ("*.svg", "*.png", "*.json", "*.pickle"),
}


def _add(files: Files, config, rel: str) -> None:
    if files.get_file_from_path(rel) is None:
        files.append(File(rel, src_dir=str(ROOT), dest_dir=config["site_dir"], use_directory_urls=config["use_directory_urls"]))


@event_priority(100)  # before mkdocs-jupyter wraps the .ipynb files
def on_files(files: Files, config) -> Files:
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        _add(files, config, nb.relative_to(ROOT).as_posix())
    from labkit.plot import site_css

    files.append(File.generated(config, "assets/palette.css", content=(
        "/* labkit.plot's palette, written by scripts/mkdocs_hooks.py: the colours figures draw with, "
        "as CSS variables for the default and the slate palette. */\n" + site_css() + "\n")))
    for folder, patterns in STATIC_FROM_ROOT.items():
        for pattern in patterns:
            for f in sorted((ROOT / folder).rglob(pattern)):
                if "__pycache__" not in f.parts:
                    _add(files, config, f.relative_to(ROOT).as_posix())
    return files


@cache
def results(name: str) -> dict:
    """A results file: ``lab-NN`` (or a lab's slug) -> ``results/<slug>/summary.json``; any other
    name -> ``results/<name>.json`` (a benchmark's)."""
    if re.match(r"^lab-\d\d", name):
        path = ROOT / "results" / labs.slug(name[:6]) / "summary.json"
    else:
        path = ROOT / "results" / f"{name}.json"
    if not path.is_file():
        raise PluginError(f"no results file {path.relative_to(ROOT)} (run the notebook or benchmark that writes it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        check_results(data)
    except ValueError as err:
        raise PluginError(f"{path.relative_to(ROOT)} is not a valid results file: {err}") from None
    return data


def lab_provenance(notebook: str) -> dict | None:
    """The provenance of a lab's published results; its notebook is ``notebooks/<slug>.ipynb``."""
    try:
        return results(Path(notebook).stem).get("provenance")
    except PluginError:
        return None


CPU_RUN_NOTE = "labs/index.md#what-a-cpu-run-shows"  # what a CPU run shows and cannot, stated once


def measured_badge(notebook: str) -> dict:
    """What the "measured on" badge says for a lab's notebook and page (see overrides/main.html)."""
    prov = lab_provenance(notebook)
    if not prov:
        return {"state": "missing", "text": "not measured yet"}
    current = source_hash(prov["lab"]) if prov.get("lab") else None
    stale = bool(current and prov.get("source_hash") and prov["source_hash"] != current)
    labkit_now = labkit_hash()
    bench_changed = bool(prov.get("labkit_hash") and prov["labkit_hash"] != labkit_now)
    on_gpu = prov.get("device_type") == "cuda"
    text = f"{escape(prov.get('device_name'))} · {str(prov.get('date_utc', ''))[:10]}" if on_gpu else "CPU only so far"
    return {
        "state": "stale" if stale else ("gpu" if on_gpu else "cpu"),
        "text": text,
        "device": prov.get("device_name"),
        "date": str(prov.get("date_utc", ""))[:10],
        "torch": prov.get("torch_version"),
        "source_hash": prov.get("source_hash"),
        "current_hash": current,
        "stale": stale,
        "bench_changed": bench_changed,
        "cpu_note": CPU_RUN_NOTE.replace("index.md", ""),  # the template's url filter takes the built path
        "title": (
            f"Figures measured on {prov.get('device_name')} ({prov.get('device_type')}), torch "
            f"{prov.get('torch_version')}, {str(prov.get('date_utc', ''))[:10]}, lab source "
            f"{prov.get('source_hash')}" + (f"; the lab code has changed since (now {current})" if stale else "")
            + ("; the instruments (labkit) have changed since" if bench_changed else "")
        ),
    }


def lab_pages() -> list[tuple[str, dict]]:
    """(src_uri, front matter) of every lab page, in lab order."""
    out = []
    for path in sorted((ROOT / "docs" / "labs").glob("lab-*.md")):
        text = path.read_text(encoding="utf-8")
        if text.startswith("---\n"):
            out.append((f"labs/{path.name}", yaml.safe_load(text.split("---\n", 2)[1]) or {}))
    return out


def _rel(page_src: str, target_src: str) -> str:
    return posixpath.relpath(target_src, posixpath.dirname(page_src) or ".")


_LINK = re.compile(r"(\]\()([^)\s]+)")


def _relink(markdown: str, from_src: str, to_src: str) -> str:
    """Markdown moved from page `from_src` to page `to_src`, its relative links still pointing where they did
    (the interview page inlines the labs' answers: "#measured-results" means the lab's section)."""
    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return m.group(0)
        path, _, anchor = target.partition("#")
        full = posixpath.normpath(posixpath.join(posixpath.dirname(from_src), path)) if path else from_src
        return m.group(1) + _rel(to_src, full) + (f"#{anchor}" if anchor else "")
    return _LINK.sub(fix, markdown)


def _measured_text(notebook: str) -> str:
    badge = measured_badge(notebook)
    if badge["state"] == "stale":
        return f"{badge['text']} (older lab code)"
    return badge["text"]


def _title(meta: dict) -> str:
    return str(meta.get("title", "")).split("·", 1)[-1].strip()


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def render_placeholder(name: str, page_src: str, config) -> str:
    labs = lab_pages()

    def link(text: str, target_src: str) -> str:
        return f"[{text}]({_rel(page_src, target_src)})"

    def notebook(m: dict) -> str:
        return "notebooks/" + Path(m["notebook"]).name

    if name == "catalogue":
        ready = {str(m["lab"]): (src, m) for src, m in labs}
        rows = []
        for entry in config["extra"]["catalogue"]:
            n = f"{int(entry['n']):02d}"
            if n in ready:
                src, m = ready[n]
                rows.append([n, link(entry["name"], src), entry["what"], f"**ready**: {_measured_text(m['notebook'])}"])
            else:
                rows.append([n, entry["name"], entry["what"], "planned"])
        return _table(["#", "lab", "what it makes measurable", "status"], rows)
    if name == "labs":
        rows = [[str(m["lab"]), link(_title(m), src), f"`{m['starter']}`", link("measured timeline", notebook(m)),
                 _measured_text(m["notebook"])] for src, m in labs]
        return _table(["#", "lab", "starter", "notebook", "measured on"], rows)
    if name == "notebooks":
        rows = [[link(str(m["lab"]), src), link(f"{_title(m)}, measured", notebook(m)), m.get("notebook_shows", ""),
                 _measured_text(m["notebook"])] for src, m in labs]
        return _table(["lab", "notebook", "what it shows", "measured on"], rows)
    if name == "chapters":
        rows = []
        for src, m in labs:
            if m.get("chapter"):
                text = (ROOT / "docs" / m["chapter"]).read_text(encoding="utf-8")
                title = yaml.safe_load(text.split("---\n", 2)[1]).get("title", m["chapter"])
                rows.append([link(title, m["chapter"]), link(f"Lab {m['lab']} · {_title(m)}", src)])
        return _table(["chapter", "lab"], rows)
    if name == "performance":
        return render_performance(page_src)
    if name == "interview":
        parts = []
        for src, m in labs:
            text = (ROOT / "docs" / src).read_text(encoding="utf-8")
            if "[start:interview]" not in text:
                continue
            link = _rel(page_src, src)
            section = text.split("[start:interview]", 1)[1].split("\n", 1)[1].split("<!-- --8<-- [end:interview]", 1)[0]
            section = _relink(section, src, page_src)
            parts += [f"## Lab {m['lab']} · {_title(m)}", "",
                      f"From [Lab {m['lab']}]({link}); the figures its answers point at are in its "
                      f"[Measured results]({link}#measured-results).", "",
                      section.strip("\n"), ""]  # inlined, so that its {{ numbers }} are filled in like the page's
        return "\n".join(parts)
    raise PluginError(f"{page_src}: unknown placeholder infralab:{name}")


def _front_matter(src: str) -> dict:
    text = (ROOT / "docs" / src).read_text(encoding="utf-8")
    return yaml.safe_load(text.split("---\n", 2)[1]) or {} if text.startswith("---\n") else {}


def _section(nav: list, title: str) -> list:
    for entry in nav:
        if isinstance(entry, dict) and title in entry:
            return entry[title]
    raise PluginError(f"mkdocs.yml nav needs a '{title}' section")


def on_config(config):
    """Add every lab's chapter, page (and its extra pages) and notebook to the nav, in lab order."""
    results.cache_clear()  # `mkdocs serve` rebuilds after a notebook wrote new results
    nav = config["nav"]
    chapters, labs, notebooks = _section(nav, "Handbook"), _section(nav, "Labs"), _section(nav, "Notebooks")
    listed = json.dumps(nav)
    for src, meta in lab_pages():
        n, title = meta["lab"], _title(meta)
        if meta.get("chapter") and meta["chapter"] not in listed:
            chapters.append({_front_matter(meta["chapter"]).get("title", meta["chapter"]): meta["chapter"]})
        if src not in listed:
            labs.append({f"Lab {n} · {title}": src})
            for extra in meta.get("extra_pages", []):
                labs.append({_front_matter(extra).get("title", extra): extra})
        notebook = "notebooks/" + Path(meta["notebook"]).name
        if notebook not in listed:
            notebooks.append({f"Lab {n} · measured": notebook})
    return config


def _bench_scripts() -> list[dict]:
    """Every bench/*.py with the BENCH name and RESULT_FILE it declares."""
    out = []
    for script in sorted((ROOT / "bench").glob("*.py")):
        text = script.read_text(encoding="utf-8")
        bench = re.search(r'^BENCH = "([^"]+)"', text, re.M)
        result = re.search(r'^RESULT_FILE = "([^"]+)"', text, re.M)
        lab = re.search(r'^LAB = "([^"]+)"', text, re.M)
        if bench and result:
            out.append({"script": f"bench/{script.name}", "bench": bench.group(1), "result": result.group(1),
                        "lab": lab.group(1) if lab else None,
                        "cpu_only": bool(re.search(r"^CPU_ONLY = True", text, re.M))})
    return out


def _format_value(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "fraction":
        return f"{100 * value:.1f} %"
    return f"{value:,.1f} {unit}"


def _code_state(data: dict, lab: str | None) -> str:
    """'current', or which older lab code a row was measured on. A benchmark that runs several labs
    records each one's source hash (``source_hashes``); otherwise the provenance's lab is the one."""
    prov = data["provenance"]
    lab = lab or prov.get("lab")
    recorded = (data.get("source_hashes") or {}).get(lab) or (prov.get("source_hash") if lab == prov.get("lab") else None)
    if not lab or not recorded or source_hash(lab) == recorded:
        return "current"
    return f"older ({recorded[:8]})"  # short: the column stays narrow; the page says what it means


TARGET = re.compile(r"^\s*(>=|<=|>|<|≥|≤)\s*([0-9.]+)")


def target_met(value, target: str | None, gpu_target: bool, on_gpu: bool) -> str:
    """'✓ met', '✗ not met', 'not comparable' (a GPU target read off a CPU run) or '-' (no target)."""
    m = TARGET.match(target or "")
    if not m or not isinstance(value, (int, float)):
        return "-"
    if gpu_target and not on_gpu:
        return "not comparable (CPU run)"
    op, bound = m.group(1), float(m.group(2))
    ok = {">=": value >= bound, "≥": value >= bound, ">": value > bound,
          "<=": value <= bound, "≤": value <= bound, "<": value < bound}[op]
    return "✓ met" if ok else "✗ not met"


def render_performance(page_src: str) -> str:
    """What has and has not been measured on a GPU first; then one table per results file, ratios
    first, each row with its target and whether it is met, the state of the lab code it was
    measured on, its device, date and commit, and a note where a CPU figure differs for a reason."""
    tables, measured_on_gpu = [], set()
    for path in sorted((ROOT / "results").glob("*.json")):
        data = results(path.stem)
        prov, rows = data.get("provenance"), data.get("summary_rows")
        if not prov or not rows:
            continue
        on_gpu = prov.get("device_type") == "cuda"
        if on_gpu:
            measured_on_gpu.add(data.get("bench"))
        where = f"{escape(prov.get('device_name'))} ({'GPU' if on_gpu else 'CPU'})"
        commit = escape((prov.get("git_commit") or "?")[:10])
        rows = sorted(rows, key=lambda r: (r["unit"] != "x", r["unit"] != "fraction"))
        table = [[escape(r["metric"]), escape(_format_value(r["value"], r["unit"])), escape(r.get("target") or "-"),
                  target_met(r["value"], r.get("target"), bool(r.get("gpu_target")), on_gpu),
                  _code_state(data, r.get("lab")), escape(r.get("note") or ""), where,
                  str(prov.get("date_utc", ""))[:10], f"`{commit}`"] for r in rows]
        tables += [f"## {escape(data.get('bench', path.stem))}", "",
                   f"From `results/{path.name}`, written by the benchmark's own run "
                   f"<span class=\"il-tag il-tag--measured\">measured</span>.", "",
                   '<div class="il-perf" markdown="1">', "",
                   _table(["metric", "value", "target", "met?", "lab code", "note", "measured on", "date", "commit"],
                          table), "", "</div>", ""]
    scripts = _bench_scripts()
    pending = [b for b in scripts if b["bench"] not in measured_on_gpu and not b["cpu_only"]]
    done = [b["bench"] for b in scripts if b["bench"] in measured_on_gpu]
    head = ["## On a GPU: measured and not yet", "",
            f"Measured on a GPU: {', '.join(done) if done else 'nothing yet'}. "
            f"Not yet measured on a GPU: {', '.join(b['bench'] for b in pending) if pending else 'nothing'}. "
            "Until a GPU run lands, a benchmark's CPU rows prove that the script runs and what a CPU "
            "does; a GPU target read off a CPU run says \"not comparable\".", ""]
    if pending:
        head += [_table(["benchmark", "script", "writes"],
                        [[b["bench"], f"`{b['script']}`", f"`{b['result']}`"] for b in pending]), ""]
    return "\n".join(head + tables)


PLACEHOLDER = re.compile(r"^(?P<indent>[ \t]*)<!-- infralab:(?P<name>\w+)(?: (?P<args>[^>]*?))? -->[ \t]*$", re.M)
VALUE = re.compile(r"\{\{\s*(?P<file>[\w-]+):(?P<path>[\w.-]+)\s*(?:\|\s*(?P<kind>[\w:+]+)\s*)?\}\}")


def _lookup(name: str, path: str, page_src: str):
    data = results(name)
    node = data.get("numbers", data) if name.startswith("lab-") else data
    for key in path.split("."):
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise PluginError(f"{page_src}: {name} has no number {path} (looked in results for {name})")
    return node


def render_value(m: re.Match, page_src: str) -> str:
    value = _lookup(m.group("file"), m.group("path"), page_src)
    if isinstance(value, (dict, list)):
        raise PluginError(f"{page_src}: {m.group(0)} is not a single value")
    kind = m.group("kind") or "text"
    return Table([("", kind)], [[value]]).cell(value, kind)  # a table of one: bytes in the value's own unit


def render_results_placeholder(name: str, args: str, page_src: str) -> str:
    parts = args.split()
    if name == "table" and len(parts) == 2:
        tables = results(parts[0]).get("tables", {})
        if parts[1] not in tables:
            raise PluginError(f"{page_src}: {parts[0]} published no table {parts[1]!r} (has: {', '.join(tables)})")
        return Table.from_dict(tables[parts[1]]).markdown()
    if name == "provenance" and len(parts) == 1:
        prov = results(parts[0]).get("provenance")
        if not prov:
            raise PluginError(f"{page_src}: results of {parts[0]} carry no provenance")
        lab = parts[0].startswith("lab-")
        how = "`scripts/run_notebooks.py`" if lab else "its benchmark"
        text = provenance_table(prov).markdown() + f"\n\nWritten by {how}; the \"measured on\" badge under the lab's title says whether the code has changed since."
        if lab and prov.get("device_type") != "cuda":  # said once, on the labs index; gone when a GPU run lands
            text += (" A CPU run: the bytes are exact; GPU speed and the CUDA allocator are not measured here"
                     f" ([what a CPU run shows]({_rel(page_src, CPU_RUN_NOTE)})).")
        return text
    raise PluginError(f"{page_src}: bad placeholder infralab:{name} {args}")


def _placeholder(m: re.Match, page_src: str, config) -> str:
    name, args = m.group("name"), m.group("args")
    text = render_results_placeholder(name, args, page_src) if args else render_placeholder(name, page_src, config)
    return "\n".join(m.group("indent") + line if line else line for line in text.split("\n"))


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    src = page.file.src_uri
    markdown = PLACEHOLDER.sub(lambda m: _placeholder(m, src, config), markdown)
    markdown = VALUE.sub(lambda m: render_value(m, src), markdown)
    meta = page.meta
    if "lab" not in meta:
        return markdown
    for key in ("starter", "notebook", "run_cpu"):
        if not meta.get(key):
            raise PluginError(f"{page.file.src_uri}: lab page front matter needs '{key}'")
    for key in ("starter", "notebook"):
        if not (ROOT / meta[key]).is_file():
            raise PluginError(f"{page.file.src_uri}: {key} {meta[key]} does not exist")
    nb = Path(meta["notebook"])
    meta["notebook_page"] = f"notebooks/{nb.stem}/"
    meta["notebook_download"] = f"notebooks/{nb.stem}/{nb.name}"
    meta["measured"] = measured_badge(meta["notebook"])
    return markdown


def on_page_context(context, page, config, nav):
    src = page.file.src_uri
    if src.startswith("notebooks/") and src.endswith(".ipynb"):
        page.meta["measured"] = measured_badge(src)
        page.meta["notebook_download"] = f"{src[:-len('.ipynb')]}/{Path(src).name}"
    return context


LONG_CODE = re.compile(r'<div class="(?:language-\w+ )?highlight"')


FIGURE = re.compile(r'<img\b[^>]*?\ssrc="([^"]+\.svg)"[^>]*>')


def phone_pictures(html: str, page_url: str, files: Files) -> str:
    """Each ``<img>`` of a figure that has a ``phone/`` layout beside it, as a ``<picture>`` that
    shows that layout on a phone (``labkit.plot.PHONE_MEDIA``) and the wide one elsewhere."""
    from labkit.plot import PHONE_MEDIA

    def picture(m: re.Match) -> str:
        src = m.group(1)
        folder, _, name = src.rpartition("/")
        phone = f"{folder}/phone/{name}" if folder else f"phone/{name}"
        target = posixpath.normpath(posixpath.join(page_url if page_url.endswith("/") or not page_url
                                                   else posixpath.dirname(page_url), phone))
        if files.get_file_from_path(target) is None:
            return m.group(0)
        return f'<picture><source media="{PHONE_MEDIA}" srcset="{phone}">{m.group(0)}</picture>'

    return FIGURE.sub(picture, html)


def on_page_content(html: str, page, config, files: Files) -> str:
    """Keep the search index light (it is loaded by every page): a notebook page is not indexed (its
    lab page says the same in prose, and its outputs are numbers); on every other page a code
    listing of more than three lines, its annotations, the tables (columns of numbers, which
    nobody searches for), a lab's exercises and its further reading are left out; prose, headings and short commands stay."""
    src = page.file.src_uri
    if src.endswith(".ipynb"):
        page.meta["search"] = {"exclude": True}
        return html

    def mark(m: re.Match) -> str:
        block = html[m.start(): html.find("</pre>", m.start())]
        return m.group(0) + " data-search-exclude" if block.count("\n") > 3 else m.group(0)

    html = phone_pictures(html, page.url, files)
    html = LONG_CODE.sub(mark, html).replace("<table>", "<table data-search-exclude>")
    # A lab's exercises are prompts to try, not answers to find: their section stays out of the index.
    html = html.replace('<h2 id="exercises">', '<h2 id="exercises" data-search-exclude>')
    # Further reading is a list of titles and links, each cited where the page uses it.
    html = html.replace('<h2 id="further-reading">', '<h2 id="further-reading" data-search-exclude>')
    # A code listing's annotations become tooltips on the page: a search hit there points at nothing
    # the reader can see, and the prose around each listing says what it does.
    return ANNOTATIONS.sub(r"\1<ol data-search-exclude>", html)


ANNOTATIONS = re.compile(r"(</code></pre></div>\s*)<ol>")


SEARCH_MARKUP = re.compile(r"</?(?:p|ol|ul|li|em|strong|span|a|div|br|sup|sub)\b[^>]*>")


def on_post_build(config) -> None:
    """The search index, lighter: markup that only shapes paragraphs and lists goes (inline code,
    which the results show as code, stays), and runs of spaces become one. Runs after the search
    plugin has written the index (hooks follow the configured plugins)."""
    path = Path(config["site_dir"]) / "search" / "search_index.json"
    if not path.is_file():
        return
    index = json.loads(path.read_text(encoding="utf-8"))
    for doc in index.get("docs", []):
        doc["text"] = re.sub(r"\s+", " ", SEARCH_MARKUP.sub(" ", doc["text"])).strip()
    path.write_text(json.dumps(index, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")


NOTEBOOK_STYLES = re.compile(r"<style[^>]*>.*?</style>", re.S)
NOTEBOOK_CSS = "assets/notebook.css"


def on_post_page(output: str, page, config) -> str:
    """A notebook page inlines the same 600 KB of Jupyter styles that every other notebook page
    does: they go into one stylesheet, fetched once and cached, linked where the styles stood."""
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    styles = NOTEBOOK_STYLES.findall(output)
    if not styles:
        return output
    css = "\n".join(re.sub(r"^<style[^>]*>|</style>$", "", s) for s in styles)
    target = Path(config["site_dir"]) / NOTEBOOK_CSS
    if not target.is_file() or target.read_text(encoding="utf-8") != css:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(css, encoding="utf-8")
    href = posixpath.relpath(NOTEBOOK_CSS, posixpath.dirname(page.url.rstrip("/") + "/index.html"))
    first = output.index(styles[0])
    for s in styles:
        output = output.replace(s, "", 1)
    return output[:first] + f'<link rel="stylesheet" href="{href}">' + output[first:]
