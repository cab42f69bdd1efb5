"""Notebooks: executed by scripts/run_notebooks.py from their source, in order, without errors or
stray outputs, with a figure; their results published with provenance; and they still run on CPU
today.

"Still runs today" is proven by an execution on today's code: a notebook that run_notebooks.py
executed on a CPU records the hash of everything it executed (every file under code/, the pinned
requirements, its own source: ``labkit.provenance.code_hash``). When that hash is today's, its
committed execution is a run of today's code, and executing it again would repeat it byte for byte;
otherwise (the code changed since, or it was measured on a GPU) it is executed again on CPU, in a
temporary copy."""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import sys
from html import unescape
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py"))

sys.path.insert(0, str(ROOT / "scripts"))
import run_notebooks  # noqa: E402

from labkit import notebook, plot  # noqa: E402

pytestmark = pytest.mark.notebook


def test_every_source_has_an_executed_notebook_and_back():
    assert {s.stem for s in SOURCES} == {n.stem for n in NOTEBOOKS}
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_hygiene(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "run top to bottom, once"
    for cell in code:
        for out in cell.outputs:
            assert out.output_type != "error", f"error output in {path.name}: {out.get('ename')}"
            if out.output_type == "stream" and out.name == "stderr":
                assert "Traceback" not in out.text and "Warning" not in out.text, out.text[:300]
    assert not [o for c in code for o in c.outputs if set(o.get("data", {})) & {"image/png", "image/jpeg"}], \
        "a raster figure: every figure goes through labkit.notebook.show (SVG in the site's palette, with alt text)"
    figures = [figure for c in code for o in c.outputs for figure in shown_figures(o)]
    assert figures, "at least one figure"
    for alt, svg in figures:
        assert len(alt.split()) >= notebook.ALT_MIN_WORDS and notebook.NO_ALT not in alt, alt
        assert '<style id="il-palette">' in svg and "prefers-color-scheme:dark" in svg, "follows the page's palette"
        width_pt = float(re.search(r'<svg[^>]*\swidth="([\d.]+)pt"', svg).group(1))
        assert width_pt <= plot.PHONE.width_in * 72 + 0.5, "one column, legible when a phone scales it"
    h1 = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()
          if line.startswith("# ")]
    assert len(h1) == 1, h1
    assert path.stat().st_size < 3_000_000, "keep notebooks small"
    shown = json.dumps([o for c in code for o in c.outputs if not shown_figures(o)])  # base64 may spell "/tmp/"
    for leak in ("PosixPath(", "/work/", "/tmp/", "/home/", "/root/"):
        assert leak not in shown, f"{path.name} shows {leak!r}: a repr or a machine path leaked into an output"
    assert meta_of(path)["executed_by"] == "scripts/run_notebooks.py"


FIGURE = re.compile(r'<figure class="il-figure"><img alt="([^"]*)" src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)">')


def shown_figures(output) -> list[tuple[str, str]]:
    """The figures an output shows through labkit.notebook.show: (alt text, SVG)."""
    html = output.get("data", {}).get("text/html", "")
    html = "".join(html) if isinstance(html, list) else html
    return [(unescape(alt), base64.b64decode(svg).decode()) for alt, svg in FIGURE.findall(html)]


def meta_of(path):
    return nbformat.read(path, as_version=4).metadata["infralab"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_published_its_results_with_provenance(path):
    """One route for provenance: the notebook's publish() writes it beside its numbers, and the
    page's badge reads it from there."""
    summary = json.loads((ROOT / "results" / path.stem / "summary.json").read_text())
    prov = summary["provenance"]
    for key in ("device_type", "device_name", "torch_version", "python_version", "git_commit",
                "source_hash", "labkit_hash", "date_utc", "lab"):
        assert prov.get(key), key
    assert prov["lab"] == path.stem and prov["wall_time_s"] > 0
    assert prov["device_type"] == meta_of(path)["device"] or meta_of(path)["device"] == "auto"
    assert summary["tables"] or summary["numbers"]
    for name in summary["figures"]:
        assert (ROOT / "results" / path.stem / name).is_file()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_cells_are_exactly_its_source(path):
    """Never edited by hand: the committed cells are the cells of notebooks/src/NAME.py."""
    built = run_notebooks.build(ROOT / "notebooks" / "src" / f"{path.stem}.py")
    nb = nbformat.read(path, as_version=4)
    assert [(c.cell_type, c.source) for c in nb.cells] == [(c.cell_type, c.source) for c in built.cells]


def executed_on_todays_code(path) -> bool:
    """Executed by run_notebooks.py, on a CPU, on exactly the code, pins and source of today."""
    from labkit.provenance import code_hash

    meta = meta_of(path)
    device = json.loads((ROOT / "results" / path.stem / "summary.json").read_text())["provenance"]["device_type"]
    return device == "cpu" and meta.get("code_hash") == code_hash(ROOT / meta["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_still_runs_on_cpu(path, tmp_path):
    from nbclient import NotebookClient

    if executed_on_todays_code(path):
        print(f"{path.stem}: executed on today's code ({meta_of(path)['code_hash']}): its execution is the run")
        return
    nb = nbformat.read(path, as_version=4)
    fresh = copy.deepcopy(nb)
    for cell in fresh.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env = dict(os.environ, INFRALAB_DEVICE="cpu", INFRALAB_RESULTS_DIR=str(tmp_path / "results"))
    (tmp_path / path.name).write_text(json.dumps(fresh))
    client = NotebookClient(fresh, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}, allow_errors=False)
    client.execute(env=env)
    errors = [o for c in fresh.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert (tmp_path / "results" / path.stem / "summary.json").is_file(), "the notebook published its results"
    assert not any((ROOT / "results").rglob("*.tmp"))


@pytest.mark.parametrize("argv, fragment", [(["nope"], "no notebook source named nope"),
                                            (["--timeout", "0"], "--timeout must be in [1, 86,400], got 0"),
                                            (["--output-dir", "/proc/x"], "--output-dir")])
def test_run_notebooks_refuses_bad_input_in_one_line_before_any_work(argv, fragment, capsys, monkeypatch):
    from labkit import cli

    monkeypatch.setattr(run_notebooks, "execute", lambda *a: pytest.fail("a notebook ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(run_notebooks.Config, run_notebooks.run, None, argv, prog="run_notebooks.py")
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and fragment in err[0]


def test_a_figure_is_shown_as_svg_with_alt_text_or_its_cell_fails(tmp_path):
    """In a kernel: notebook.show draws SVG in the site's palette with the alt text and caption given;
    a figure left for pyplot to show (an inline PNG, no alt text) fails its cell; alt text that says
    nothing is refused."""
    from nbclient import NotebookClient

    cells = ["import matplotlib.pyplot as plt\nfrom labkit import notebook, plot\nnotebook._check_figures_after_each_cell()",
             "fig, ax = plt.subplots()\nax.plot([0, 1], [2, 3], color=plot.SERIES[0])\n"
             "notebook.show(fig, alt='a line rising from two to three over one step', caption='what to notice')",
             "fig, ax = plt.subplots()\nax.plot([0, 1])",
             "fig, ax = plt.subplots()\nnotebook.show(fig, alt='a figure')"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline",
               PYTHONPATH=os.pathsep.join([str(ROOT / "code"), os.environ.get("PYTHONPATH", "")]))
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
    shown, unshown, terse = (nb.cells[i].outputs for i in (1, 2, 3))
    ((alt, svg),) = [f for o in shown for f in shown_figures(o)]
    assert alt == "a line rising from two to three over one step" and "var(--il-blue)" in svg
    assert "<figcaption>what to notice</figcaption>" in shown[0]["data"]["text/html"]
    errors = [o for o in unshown if o.output_type == "error"]
    assert errors and "without alt text" in errors[0].evalue, unshown
    assert not [o for o in unshown if "image/png" in o.get("data", {})]
    refused = [o for o in terse if o.output_type == "error"]
    assert refused and refused[0].ename == "ValueError" and "words or more" in refused[0].evalue


def test_the_code_hash_changes_with_any_lab_labkit_the_pins_or_the_source(tmp_path, monkeypatch):
    from labkit import provenance

    for name in ("code/labkit/ledger.py", "code/lab-01-x/lab.py", "code/lab-13-y/examples/m.json",
                 "requirements.txt", "notebooks/src/nb.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("v1\n")
    monkeypatch.setattr(provenance, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(provenance, "CODE_DIR", tmp_path / "code")
    src = tmp_path / "notebooks/src/nb.py"
    seen = {provenance.code_hash(src)}
    for name in ("code/labkit/ledger.py", "code/lab-01-x/lab.py", "code/lab-13-y/examples/m.json",
                 "requirements.txt", "notebooks/src/nb.py"):
        (tmp_path / name).write_text("v2\n")
        seen.add(provenance.code_hash(src))
    (tmp_path / "code/lab-01-x/new.py").write_text("")  # a new file counts too
    seen.add(provenance.code_hash(src))
    assert len(seen) == 7
