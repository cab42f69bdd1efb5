"""The first and the last cell of every notebook, :func:`setup` and :func:`publish`, and :func:`show`.

A notebook is thin. It calls its lab's ``run(Config(...))``, draws what the ledger recorded, shows
each figure with its alt text, and publishes numbers, tables and figures; the lab holds the formulas,
the tests hold the asserts, and the site's build hook turns the published numbers into a page's
tables and sentences. ::

    nb = notebook.setup(2)                       # the lab, the device, where results go
    result = nb.lab.run(nb.lab.Config(device=nb.device.type, steps=3))
    notebook.show(fig, alt="Stacked memory timeline of three steps by category")  # SVG, the site's palette
    notebook.publish(nb, tables={"peaks": ...}, figures={"timeline": fig}, growth=...)

A figure reaches the page the way the lab pages' figures do (:func:`labkit.plot.page_svgs`): SVG,
laid out for the page, in the site's palette, with alt text; a cell that leaves a figure for pyplot
to show fails.

``scripts/run_notebooks.py`` executes the notebooks with ``INFRALAB_DEVICE`` and
``INFRALAB_RESULTS_DIR`` set; a reader running one by hand gets the defaults (device auto, results
under the repository's ``results/``).

Provenance has one route: :func:`publish` writes it into ``results/<lab>/summary.json``, and the
page's "measured on" badge and the notebook page read it from there.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from labkit import labs
from labkit.provenance import REPO_ROOT, collect
from labkit.table import Table

#: A figure's alt text says what it shows, for a reader who cannot see it: a sentence, not a label.
ALT_MIN_WORDS = 6
#: What nbconvert writes when an image has no alt text; never ours.
NO_ALT = "No description has been provided for this image"


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
    _check_figures_after_each_cell()
    return Notebook(module, slug, device, out, record, time.perf_counter())


def show(fig, alt: str, caption: str | None = None) -> None:
    """Show a figure in the notebook as a page shows it on a phone: SVG in one column of plots with
    their legends under them (:data:`labkit.plot.PHONE`: at its natural width, 499 CSS px, it fits a
    notebook page's column; scaled to a phone, its text stays legible), every colour in the site's
    palette, so that it follows the page's light or dark palette, with ``alt`` (what the figure
    shows, for a reader who cannot see it) and an optional ``caption`` (what to notice) under it.
    The lab page shows the same figure laid out for the content column as well (:func:`publish`).

    Every figure a cell draws must go through here: a cell that leaves a figure unshown fails
    (:func:`setup` makes it so), and ``alt`` must be a sentence of ``ALT_MIN_WORDS`` words or more.
    """
    import base64
    from html import escape

    from labkit import plot

    check_alt(alt)
    phone = plot.page_svgs(fig)[1]  # laid out once: publish() writes both from the same drawing
    uri = "data:image/svg+xml;base64," + base64.b64encode(phone.encode("utf-8")).decode("ascii")
    html = f'<figure class="il-figure"><img alt="{escape(alt)}" src="{uri}">'
    if caption:
        html += f"<figcaption>{escape(caption)}</figcaption>"
    _SHOWN.add(fig)
    _display({"text/html": html + "</figure>", "text/plain": f"[figure: {alt}]"})


def check_alt(alt: str) -> str:
    """``alt``, if it describes a figure (a sentence of ALT_MIN_WORDS words or more); else ValueError."""
    words = str(alt or "").split()
    if len(words) < ALT_MIN_WORDS or " ".join(words).rstrip(".") == NO_ALT:
        raise ValueError(f"a figure's alt text must say what it shows in {ALT_MIN_WORDS} words or more, got {alt!r}")
    return alt


_SHOWN: weakref.WeakSet = weakref.WeakSet()


def _figures_need_alt_text() -> None:
    """Every figure a cell drew went through :func:`show`, or the cell fails: pyplot's own display
    (an inline PNG) would carry no alt text and ignore the site's palette. Run after each cell."""
    import matplotlib.pyplot as plt

    try:  # pyplot's inline backend registers its own display when it loads: it draws nothing here
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import flush_figures

        get_ipython().events.unregister("post_execute", flush_figures)
    except (ImportError, AttributeError, ValueError):
        pass
    unshown = []
    for number in plt.get_fignums():
        figure = plt.figure(number)
        if figure not in _SHOWN:
            unshown.append(number)
        plt.close(figure)  # shown or refused: never drawn again by pyplot
    if unshown:
        raise ValueError(f"this cell drew {len(unshown)} figure(s) without alt text: show each with "
                         "notebook.show(fig, alt='what it shows', caption='what to notice')")


def _check_figures_after_each_cell() -> None:
    try:
        from IPython import get_ipython
    except ImportError:  # not in a kernel: nothing is drawn inline
        return
    shell = get_ipython()
    if shell is None:
        return
    try:
        shell.events.unregister("post_execute", _figures_need_alt_text)
    except ValueError:
        pass
    shell.events.register("post_execute", _figures_need_alt_text)


def _display(bundle: dict) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:  # outside Jupyter: plain text
        print(bundle["text/plain"])
        return
    display(bundle, raw=True)


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
    _display({"text/markdown": text, "text/plain": text})
