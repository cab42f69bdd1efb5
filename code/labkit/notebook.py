"""Helpers for the executed notebooks: where to write results, how to show provenance.

``scripts/run_notebooks.py`` executes the notebooks with ``INFRALAB_DEVICE``, ``INFRALAB_ROOT``
and ``INFRALAB_RESULTS_DIR`` set; a reader running a notebook by hand gets the defaults (device
auto, results under the repository's ``results/``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

from labkit.provenance import CODE_DIR, REPO_ROOT, describe

PROVENANCE_MIME = "application/vnd.infralab.provenance+json"


def device_name() -> str:
    """The device the notebook should use: ``INFRALAB_DEVICE`` or ``auto``."""
    return os.environ.get("INFRALAB_DEVICE", "auto")


def results_dir(lab: str) -> Path:
    base = Path(os.environ.get("INFRALAB_RESULTS_DIR") or REPO_ROOT / "results")
    out = base / lab
    out.mkdir(parents=True, exist_ok=True)
    return out


def load_lab(relative: str) -> ModuleType:
    """Import a lab's starter file, e.g. ``load_lab("lab-02-single-gpu-training/train_single_gpu.py")``."""
    path = CODE_DIR / relative
    name = "lab_" + path.parent.name.replace("-", "_") + "_" + path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def show_provenance(record: dict) -> None:
    """Display the provenance for readers and hand it to run_notebooks.py (a MIME bundle)."""
    from IPython.display import display

    text = "Measured on: " + describe(record)
    if record.get("device_type") != "cuda":
        text += "\n(CPU run: byte counts are exact; no GPU speed or transfer claim is made from it)"
    display(
        {PROVENANCE_MIME: json.dumps(record), "text/plain": text + "\n" + json.dumps(record, indent=1)},
        raw=True,
    )


def show_markdown(text: str) -> None:
    from IPython.display import Markdown, display

    display(Markdown(text))


def provenance_markdown(record: dict) -> str:
    """One line for a page: where and on which code a lab's figures were measured."""
    if record.get("device_type") == "cuda":
        where = "Measured on a CUDA GPU"
    else:
        where = "Measured on CPU (exact bytes; no GPU speed or allocator claim)"
    return f"{where}: {describe(record)}. Written by the lab's notebook, `scripts/run_notebooks.py`.\n"
