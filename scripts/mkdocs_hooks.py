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
  fails the build. A kind ending in ``~``
  (``bytes~``, ``GB~``, ``int~``, ``pct~``, ``x~``, ``float~``) is the number as a person says it:
  two significant figures ("about 150 GiB"), for the interview answers said out loud, whose exact
  figure follows in their collapsible follow-up. Every value is escaped (``labkit.table.escape``):
  nothing in a results file becomes HTML or Markdown (a link, an image, an attribute list): it shows
  as the text it is.
* A list of records (one dict per size, stage or mode a run covered) is looked up by a field, never
  by position: ``sets[params=12905472]``, ``stages[stage=3]``, ``modes[mode=layerwise]``. A re-run
  with other sizes then fails the build with the key it lacks and the keys it has, where a position
  would have quoted another size's number. A digit indexes only a list of plain numbers, whose
  positions are their meaning (a band's low and high end, step 0 and 1).
* A derived number is written as its formula, evaluated here: ``{{ 7e9 * cpu_adam_bench:PATH * 1e-9 |
  float:1 }}`` or ``{{ lab-06:A - lab-02:B | bytes }}`` (references, numbers, ``+ - * /`` and
  parentheses; an operator between two references needs spaces around it).
* ``on_config`` builds the nav from two orders, each written once: the Handbook's chapters part by
  part from ``extra.reading_order`` in mkdocs.yml (the order ideas build, which is not the labs'), then
  every lab's page (and its ``extra_pages``) and notebook in lab order, from the lab pages' front
  matter: adding a lab never edits the nav. A chapter missing from the reading order, a lab whose
  chapter is not in it, or a page listed twice fails the build.
* Index pages are generated, so they grow with the labs without anyone editing them: a page
  holding ``<!-- infralab:catalogue -->``, ``<!-- infralab:labs -->``,
  ``<!-- infralab:notebooks -->``, ``<!-- infralab:chapters -->`` (the handbook's map: each part's
  questions, the chapter that answers each, and its labs) or ``<!-- infralab:interview -->`` gets that
  table or section built from the lab pages' front matter, ``extra.catalogue`` and ``extra.reading_order``;
  ``<!-- infralab:fit_legend -->`` the legend of the calculator's formula code (``results/fit/calculator.json``);
  ``<!-- infralab:performance -->`` gets the benchmark tables from ``results/*.json``.

* A figure a page shows from ``results/`` or ``docs/assets/figures/`` (an ``<img>`` of an SVG that
  ``labkit.plot.save`` wrote) becomes a ``<picture>`` whose source for a phone is its ``phone/``
  layout; ``assets/palette.css`` holds the plotting palette's colours as CSS variables for both of
  the site's palettes (the calculator's bar draws with them).

Replacing mkdocs-jupyter later means changing this file and the plugin entry, nothing else.
"""

from __future__ import annotations

import ast
import json
import math
import operator
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
    if name == "chapters":  # the map: part by part, each question and the chapter (and labs) that answer it
        out = []
        for part in reading_order(config):
            out += [f"**{part['part']}**", ""]
            for entry in part["chapters"]:
                page = entry["page"]
                measured = [link(f"Lab {m['lab']}", src) for src, m in labs if m.get("chapter") == page]
                out.append(f"- *{escape(entry['question'])}* → {link(_front_matter(page).get('title', page), page)}"
                           + (f" · {', '.join(measured)}" if measured else ""))
            out.append("")
        return "\n".join(out).rstrip("\n")
    if name == "performance":
        return render_performance(page_src)
    if name == "fit_legend":  # every name in the formula code fit.md quotes, as scripts/fit_table.py explains it
        rows = [[r["name"], r["means"], r["value"]] for r in results("fit/calculator")["legend"]]
        return Table([("name", "code"), ("what it is", "text"), ("value", "text")], rows).markdown()
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


def reading_order(config) -> list[dict]:
    """``extra.reading_order``: the parts, each with its chapters ``{page, question}`` whose page exists
    (an entry marked ``planned`` waits for its page; any other must exist)."""
    parts = []
    for part in config["extra"].get("reading_order") or []:
        chapters = []
        for entry in part["chapters"]:
            if (ROOT / "docs" / entry["page"]).is_file():
                chapters.append(entry)
            elif not entry.get("planned"):
                raise PluginError(f"extra.reading_order in mkdocs.yml lists {entry['page']}, which does not exist")
        parts.append({"part": part["part"], "chapters": chapters})
    return parts


def nav_pages(nav) -> list[str]:
    """Every page a nav (or a section of it) lists, in order."""
    if isinstance(nav, str):
        return [nav]
    items = nav.values() if isinstance(nav, dict) else nav
    return [page for item in items for page in nav_pages(item)]


def on_config(config):
    """The nav: the Handbook's chapters in the reading order (``extra.reading_order``), then every lab's
    page (its extra pages after it) and every notebook in lab order; each page once."""
    results.cache_clear()  # `mkdocs serve` rebuilds after a notebook wrote new results
    nav = config["nav"]
    handbook, labs, notebooks = _section(nav, "Handbook"), _section(nav, "Labs"), _section(nav, "Notebooks")
    order = reading_order(config)
    for part in order:
        handbook.append({part["part"]: [{_front_matter(e["page"]).get("title", e["page"]): e["page"]}
                                        for e in part["chapters"]]})
    in_order = {e["page"] for part in order for e in part["chapters"]}
    for path in sorted((ROOT / "docs" / "handbook").glob("*.md")):
        page = f"handbook/{path.name}"
        if path.name != "index.md" and page not in in_order:
            raise PluginError(f"docs/{page} is in no part of extra.reading_order in mkdocs.yml: add "
                              f"{{page: {page}, question: ...}} to the part where it belongs")
    for src, meta in lab_pages():
        n, title = meta["lab"], _title(meta)
        if meta.get("chapter") and meta["chapter"] not in in_order:
            raise PluginError(f"{src}: its chapter {meta['chapter']} is not in extra.reading_order in mkdocs.yml")
        labs.append({f"Lab {n} · {title}": src})
        for extra in meta.get("extra_pages", []):
            labs.append({_front_matter(extra).get("title", extra): extra})
        notebooks.append({f"Lab {n} · measured": "notebooks/" + Path(meta["notebook"]).name})
    pages = nav_pages(nav)
    twice = sorted({p for p in pages if pages.count(p) > 1})
    if twice:
        raise PluginError(f"the nav lists {', '.join(twice)} more than once (mkdocs.yml's nav, extra.reading_order "
                          "and the lab pages' front matter each add pages)")
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
REF = r"[A-Za-z][\w-]*:(?:[\w.-]|\[[^\]\s]+\])+"  # file:path, a path step may select a record: key[field=value]
VALUE = re.compile(r"\{\{\s*(?P<expr>(?:[-+*/()\s]|\d[\d.eE+-]*)*" + REF + r"(?:[^{}|]*?))\s*"
                   r"(?:\|\s*(?P<kind>[\w:+~]+)\s*)?\}\}")
TOKEN = re.compile(r"\s*(?:(?P<ref>" + REF + r")|(?P<num>\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)|(?P<op>[-+*/()]))")
STEP = re.compile(r"^(?P<key>[\w-]+)(?:\[(?P<field>[\w-]+)=(?P<value>[^\]]+)\])?$")


def _steps(path: str) -> list[str]:
    """``a.b[f=1.5].c`` -> ``["a", "b[f=1.5]", "c"]``: a dot inside a selector is the value's."""
    return re.findall(r"[^.\[]+(?:\[[^\]]*\])?", path)


def _lookup(name: str, path: str, page_src: str):
    data = results(name)
    node = data.get("numbers", data) if name.startswith("lab-") else data
    where: list[str] = []

    def missing(what: str) -> PluginError:
        return PluginError(f"{page_src}: {name} has no number {path}: {what} (looked in results for {name})")

    for step in _steps(path):
        m = STEP.match(step)
        if not m:
            raise missing(f"{step!r} is not a key or key[field=value]")
        key, field, want = m.group("key"), m.group("field"), m.group("value")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and not field:
            if any(isinstance(item, (dict, list)) for item in node):
                raise PluginError(f"{page_src}: {name}:{path} indexes the list {'.'.join(where) or name} by position "
                                  f"({key}); a list of records is looked up by a field, e.g. [{_fields(node)}]")
            if int(key) >= len(node):
                raise missing(f"{'.'.join(where)} has {len(node)} values")
            node = node[int(key)]
        else:
            raise missing(f"no {key!r} in {'.'.join(where) or name}")
        where.append(key)
        if field:
            if not isinstance(node, list):
                raise missing(f"{'.'.join(where)} is not a list of records to select [{field}={want}] from")
            hits = [item for item in node if isinstance(item, dict) and field in item and str(item[field]) == want]
            if len(hits) != 1:
                has = ", ".join(f"{field}={item.get(field)}" for item in node if isinstance(item, dict)) or "nothing"
                why = "no entry" if not hits else f"{len(hits)} entries"
                raise PluginError(f"{page_src}: {name} has {why} {'.'.join(where)}[{field}={want}] (it has {has}): "
                                  f"re-run what writes results for {name} with that {field}, or change the page")
            node = hits[0]
            where[-1] += f"[{field}={want}]"
    return node


def _fields(records: list) -> str:
    first = next((r for r in records if isinstance(r, dict)), {})
    key = next((k for k, v in first.items() if isinstance(v, (str, int)) and not isinstance(v, bool)), "field")
    return f"{key}={first.get(key, '...')}"


def _evaluate(expr: str, page_src: str):
    """One reference: its value, whatever it is. A formula: references and numbers under + - * /,
    evaluated to a number (nothing else is allowed: a results file is data, never code)."""
    tokens, names, pos = [], {}, 0
    while pos < len(expr.rstrip()):
        m = TOKEN.match(expr, pos)
        if not m:
            raise PluginError(f"{page_src}: cannot read {{{{ {expr} }}}} at {expr[pos:]!r}")
        if m.group("ref"):
            file, _, path = m.group("ref").partition(":")
            value = _lookup(file, path, page_src)
            names[f"_v{len(names)}"] = value
            tokens.append(f"_v{len(names) - 1}")
        else:
            tokens.append(m.group("num") or m.group("op"))
        pos = m.end()
    if tokens == ["_v0"]:
        return names["_v0"]
    for value in names.values():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PluginError(f"{page_src}: {{{{ {expr} }}}} computes with a value that is not a number ({value!r})")
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
    not_a_formula = PluginError(f"{page_src}: {{{{ {expr} }}}} is not a formula of numbers and + - * /")
    try:
        tree = ast.parse(" ".join(tokens), mode="eval").body
    except SyntaxError:
        raise not_a_formula from None

    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        raise not_a_formula
    try:
        return ev(tree)
    except ZeroDivisionError:
        raise PluginError(f"{page_src}: {{{{ {expr} }}}} divides by zero with the published values") from None


SPOKEN_BYTES = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
SPOKEN = {"GB": (" GB", 10**9), "int": ("", 1), "float": ("", 1), "pct": (" %", 0.01), "x": (" times", 1)}


def spoken(value, kind: str) -> str:
    """A number as a person says it out loud: two significant figures (``bytes~1``: one; a whole
    number of KiB, MiB, ... below 1,000 as it is), with "about" when rounding changed it. ``bytes~``: the largest binary unit it reaches ("about 150 GiB");
    ``GB~``: decimal gigabytes; ``int~``, ``float~``: a plain number; ``pct~``: a fraction as a
    percentage; ``x~``: a ratio ("about 3 times")."""
    name, _, figures = kind.partition("~")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
        raise ValueError(f"a spoken kind ({kind}) needs a number other than 0, got {value!r}")
    if name == "bytes":
        unit, size = next(((f" {u}", s) for u, s in SPOKEN_BYTES if abs(value) >= s), (" bytes", 1))
    elif name in SPOKEN:
        unit, size = SPOKEN[name]
    else:
        raise ValueError(f"unknown spoken kind {kind!r} (bytes~, GB~, int~, float~, pct~, x~)")
    exact = value / size
    decimals = int(figures or 2) - 1 - math.floor(math.log10(abs(exact)))
    if name == "bytes" and exact == int(exact) and abs(exact) < 1000:
        decimals = 0  # a whole number of its unit is said as it is: "128 KiB", not "about 130 KiB"
    said = round(exact, decimals)
    text = f"{said:,.{max(decimals, 0)}f}"
    text = text.rstrip("0").rstrip(".") if "." in text else text
    return ("" if math.isclose(said, exact, rel_tol=1e-12) else "about ") + text + unit


def render_value(m: re.Match, page_src: str) -> str:
    value = _evaluate(m.group("expr").strip(), page_src)
    if isinstance(value, (dict, list)):
        raise PluginError(f"{page_src}: {m.group(0)} is not a single value")
    kind = m.group("kind") or "text"
    if "~" in kind:
        try:
            return spoken(value, kind)
        except ValueError as err:
            raise PluginError(f"{page_src}: {m.group(0)}: {err}") from None
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


TABLE = re.compile(r"<table\b.*?</table>", re.S)
MARKUP = re.compile(r"(<[^>]*>)")
BREAK_POINT = re.compile(r"(?<=\w_)(?=\w)|(?<=\w&#95;)(?=\w)|(?<=\w=)(?=\w)|(?<=[a-z])(?=[A-Z][a-z])")
URL = re.compile(r"https?(?::|&#58;)//\S+")  # as escaped in a cell, its colon an entity
URL_BREAK = re.compile(r"(?<=[/.-])(?=[^/.-])")  # a URL in a table's text breaks after a slash, a dot or a
HASH = re.compile(r"[0-9a-f]{16,}")  # hyphen, as a printed one does, and a commit hash every 12 characters


def table_break_points(html: str) -> str:
    """In a table's text, a line may break where a long name joins its words: after an underscore
    (``gradient_as_bucket_view``, written ``_`` or, escaped, ``&#95;``), after an ``=`` between words
    (``reshard_after_forward=False``) and before a capital that starts a word
    (``ZeroRedundancyOptimizer``); a URL after each slash. A browser breaks there only when it breaks inside words, which the
    site's tables never do, so such a name would widen its column to its length."""
    def text(part: str) -> str:
        pieces = URL.split(part)
        urls = [HASH.sub(lambda h: "<wbr>".join(h[0][i:i + 12] for i in range(0, len(h[0]), 12)), URL_BREAK.sub("<wbr>", u))
                for u in URL.findall(part)]
        return "".join(BREAK_POINT.sub("<wbr>", piece) + (urls[i] if i < len(urls) else "") for i, piece in enumerate(pieces))

    def cells(m: re.Match) -> str:
        parts = MARKUP.split(m.group(0))
        return "".join(part if k % 2 else text(part) for k, part in enumerate(parts))

    return TABLE.sub(cells, html)


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

    html = table_break_points(phone_pictures(html, page.url, files))
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
