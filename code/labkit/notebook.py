"""The first and the last cell of every notebook: :func:`setup` and :func:`publish`.

A notebook is thin. It calls its lab's ``run(Config(...))``, draws what the ledger recorded, and
publishes numbers, tables and figures; the lab holds the formulas, the tests hold the asserts, and
the site's build hook turns the published numbers into a page's tables and sentences. ::

    nb = notebook.setup(2)                       # the lab, the device, where results go
    result = nb.lab.run(nb.lab.Config(device=nb.device.type, steps=3))
    notebook.publish(nb, tables={"peaks": ...}, figures={"timeline": fig}, growth=...)

``scripts/run_notebooks.py`` executes the notebooks with ``INFRALAB_DEVICE`` and
``INFRALAB_RESULTS_DIR`` set; a reader running one by hand gets the defaults (device auto, results
under the repository's ``results/``).

Provenance has one route: :func:`publish` writes it into ``results/<lab>/summary.json``, and the
page's "measured on" badge and the notebook page read it from there.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from labkit import labs
from labkit.provenance import REPO_ROOT, collect
from labkit.table import Table

#: Pixels per inch of the figures a notebook shows inline (its page embeds them as PNG).
INLINE_DPI = 72


@dataclass
class Notebook:
    """What a notebook works with: its lab's starter module, the device, its results folder."""

    lab: ModuleType
    slug: str
    device: Any  # torch.device
    results: Path
    provenance: dict
    started: float

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def setup(lab: int | str) -> Notebook:
    """Load lab ``lab``'s starter, choose the device (``INFRALAB_DEVICE``, default auto), and show
    where and on which code this notebook measures, as a small table."""
    from labkit.cli import pick_device

    module = labs.load(lab)
    slug = labs.slug(lab)
    device = pick_device(os.environ.get("INFRALAB_DEVICE", "auto"))
    base = Path(os.environ.get("INFRALAB_RESULTS_DIR") or REPO_ROOT / "results")
    out = base / slug
    out.mkdir(parents=True, exist_ok=True)
    record = collect(lab, device)
    _display_markdown(provenance_table(record).markdown())
    _page_layout_inline_figures()
    return Notebook(module, slug, device, out, record, time.perf_counter())


def _page_layout_inline_figures() -> None:
    """Figures a cell shows are laid out as the pages show them (:func:`labkit.plot.page_layout`:
    one column, phone-sized, readable text), just before the inline backend draws them."""
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import flush_figures
    except ImportError:  # not in a kernel: nothing is drawn inline
        return
    shell = get_ipython()
    if shell is None:
        return

    def page_layout_open_figures() -> None:
        import matplotlib.pyplot as plt

        from labkit.plot import page_layout

        for number in plt.get_fignums():
            figure = plt.figure(number)
            page_layout(figure)
            figure.set_dpi(INLINE_DPI)  # a notebook page stays light: what it shows is the page's figure

    for callback in (page_layout_open_figures, flush_figures):  # ours first, then the drawing
        try:
            shell.events.unregister("post_execute", callback)
        except ValueError:
            pass
    shell.events.register("post_execute", page_layout_open_figures)
    shell.events.register("post_execute", flush_figures)


def provenance_table(record: dict) -> Table:
    """Where a measurement was made, as rows a reader scans (the badge's long form)."""
    gpu = record.get("device_type") == "cuda"
    rows = [
        ["measured on", record.get("device_name") or "?"],
        ["kind", "CUDA GPU" if gpu else "CPU only: exact bytes, no GPU speed or allocator claim"],
    ]
    if gpu:
        rows.append(["driver, CUDA", f"{record.get('driver_version')}, {record.get('cuda_version')}"])
    rows += [
        ["torch, Python", f"{record.get('torch_version')}, {record.get('python_version')}"],
        ["commit", (record.get("git_commit") or "?")[:10] + (" (with local changes)" if record.get("git_dirty") else "")],
        ["lab source", record.get("source_hash") or "-"],
        ["labkit", record.get("labkit_hash") or "-"],
        ["date (UTC)", str(record.get("date_utc", "?"))[:10]],
    ]
    if record.get("wall_time_s") is not None:
        rows.append(["wall time", f"{record['wall_time_s']:.1f} s"])
    return Table(["", "value"], rows)


def publish(nb: Notebook, tables: dict[str, Table] | None = None, figures: dict[str, Any] | None = None,
            **numbers: Any) -> None:
    """Write what the notebook measured into ``results/<lab>/``.

    ``tables``: name -> :class:`Table` (a page shows one with ``<!-- infralab:table lab-NN name -->``);
    ``figures``: name -> matplotlib figure, saved as ``name.svg``; ``numbers``: any JSON-ready
    values (a page quotes one with ``{{ lab-NN:name | kind }}``; a lab result's ``summary()`` is
    one, less its own provenance).
    """
    from labkit.plot import save
    from labkit.provenance import write_results

    record = dict(nb.provenance, wall_time_s=round(time.perf_counter() - nb.started, 3))
    # a lab's summary() carries its own provenance: the file's one record, at the top, is the one
    numbers = {k: {kk: vv for kk, vv in v.items() if kk != "provenance"} if isinstance(v, dict) else v
               for k, v in numbers.items()}
    written = []
    for name, fig in (figures or {}).items():
        written.append(save(fig, nb.results / f"{name}.svg").name)
    payload = {"numbers": numbers, "tables": {k: t.to_dict() for k, t in (tables or {}).items()},
               "figures": written}
    path = write_results(nb.results / "summary.json", payload, record)
    print(f"wrote {path.name} ({len(numbers)} numbers, {len(tables or {})} tables) and "
          f"{', '.join(written) or 'no figures'} to results/{nb.slug}/")


def _display_markdown(text: str) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:  # outside Jupyter: plain text
        print(text)
        return
    display(Markdown(text))
