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

import copy
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py"))

sys.path.insert(0, str(ROOT / "scripts"))
import run_notebooks  # noqa: E402

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
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "at least one figure"
    h1 = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()
          if line.startswith("# ")]
    assert len(h1) == 1, h1
    assert path.stat().st_size < 3_000_000, "keep notebooks small"
    shown = json.dumps([o for c in code for o in c.outputs if o.output_type != "display_data"
                        or "image/png" not in o.get("data", {})])
    for leak in ("PosixPath(", "/work/", "/tmp/", "/home/", "/root/"):
        assert leak not in shown, f"{path.name} shows {leak!r}: a repr or a machine path leaked into an output"
    assert meta_of(path)["executed_by"] == "scripts/run_notebooks.py"


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
    env = dict(os.environ, INFRALAB_DEVICE="cpu", OMP_NUM_THREADS="1", INFRALAB_RESULTS_DIR=str(tmp_path / "results"))
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
