"""Execute the notebooks: notebooks/src/NAME.py (jupytext percent format) -> notebooks/NAME.ipynb.

Notebooks are never edited by hand. Their source is a plain Python file in ``notebooks/src/``;
this script turns it into a notebook, executes every cell in order with a fresh kernel, and writes
the executed notebook next to the others. What the notebook measured, with its provenance, it
publishes itself into ``results/<lab>/summary.json`` (``labkit.notebook.publish``): the site's
"measured on" badge reads it there.

    python scripts/run_notebooks.py                       # all notebooks, device auto
    python scripts/run_notebooks.py --device cuda lab-02-single-gpu-training
    python scripts/run_notebooks.py --output-dir /tmp/nb --results-dir /tmp/results   # dry run

The notebook code reads ``INFRALAB_DEVICE`` (cpu|cuda|auto) and ``INFRALAB_RESULTS_DIR`` from the
environment this script sets. The kernel imports labkit and the labs from this checkout's
``code/`` (PYTHONPATH), whatever labkit the environment has installed.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from labkit import cli
from labkit.config import MAX_SECONDS, UsageError, check_fields, option
from labkit.files import atomic, check_writable
from labkit.provenance import code_hash

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "notebooks" / "src"


def build(src: Path):
    import jupytext
    import nbformat

    nb = jupytext.read(src, fmt="py:percent")
    nb.metadata.pop("jupytext", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    return nb


def execute(src: Path, out_dir: Path, results_dir: Path | None, device: str, timeout: int) -> Path:
    import nbformat
    from nbclient import NotebookClient

    nb = build(src)
    env = dict(os.environ)
    env["INFRALAB_DEVICE"] = device
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "code"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    if results_dir is not None:
        env["INFRALAB_RESULTS_DIR"] = str(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    running = {}  # the cell being executed, for a failure's one line
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(out_dir)}},
        allow_errors=False,
        on_cell_execute=lambda cell, cell_index: running.update(index=cell_index),
    )
    executed = code_hash(src)  # before the run: what it is about to execute
    # nbclient hands ``env`` to the kernel manager, which starts the kernel with it
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+", encoding="utf-8") as kernel_log:  # the kernel's own stderr: its log lines
        try:
            client.execute(env=env, stderr=kernel_log)
        except Exception as err:  # a cell's error, a time-out, a dead kernel: one line, not nbclient's page
            raise NotebookFailed(src.stem, running.get("index"), err, timeout) from None
    wall = time.perf_counter() - t0
    # A cell can fail after it ran (labkit.notebook refuses a figure shown without alt text): nbclient
    # records that as an error output of a cell that succeeded; it fails the notebook all the same.
    for number, cell in enumerate(nb.cells, 1):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                raise RuntimeError(f"{src.relative_to(ROOT)}: cell {number}: {out.ename}: {out.evalue}")
    nb.metadata["infralab"] = {
        "lab": src.stem,
        "source": src.relative_to(ROOT).as_posix(),
        "executed_by": "scripts/run_notebooks.py",
        "device": device,
        "execution_wall_time_s": round(wall, 2),
        # what it executed: tests/test_notebooks.py does not execute again a CPU notebook whose hash is today's
        "code_hash": executed,
    }
    target = out_dir / f"{src.stem}.ipynb"
    with atomic(target, "w") as f:
        nbformat.write(nb, f)
    return target


class NotebookFailed(Exception):
    """A notebook that did not run to its end: which cell, and why, in one line (exit code 1)."""

    def __init__(self, name: str, cell: int | None, err: Exception, timeout: int) -> None:
        from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

        if isinstance(err, CellTimeoutError):
            why = f"ran past --timeout {timeout} s"
        elif isinstance(err, CellExecutionError):  # the kernel's own error: its last line, not the traceback
            why = f"failed: {err.ename}: {' '.join(str(err.evalue).split())}"
        elif isinstance(err, DeadKernelError):
            why = "killed its kernel (out of memory?)"
        else:
            why = f"could not run: {type(err).__name__}: {' '.join(str(err).split())}"
        where = f"cell {cell + 1}" if cell is not None else "the kernel"
        super().__init__(f"{name}: {where} {why[:400]}")


@dataclass
class Config:
    """Execute the notebooks: notebooks/src/NAME.py (jupytext percent format) -> notebooks/NAME.ipynb."""

    names: tuple[str, ...] = option((), "notebook names (default: every notebooks/src/*.py)", positional=True)
    device: Literal["auto", "cpu", "cuda"] = option("auto", "where the notebooks measure")
    output_dir: Path = option(ROOT / "notebooks", "where the executed notebooks go (default: notebooks/)",
                              path="folder")
    results_dir: Path | None = option(None, "where the notebooks publish their results (default: results/)",
                                      path="folder")
    timeout: int = option(1200, "seconds a cell may run", min=1, max=MAX_SECONDS)

    def __post_init__(self) -> None:
        check_fields(self)
        missing = [n for n in self.names if not (SRC / f"{n.removesuffix('.py')}.py").is_file()]
        if missing:
            raise UsageError(f"no notebook source named {', '.join(missing)} in {SRC.relative_to(ROOT)}")


def run(config: Config) -> list[str]:
    for folder, flag in ((config.output_dir, "--output-dir"), (config.results_dir, "--results-dir")):
        if folder is not None:
            check_writable(Path(folder) / ".probe", flag)
    names = config.names or tuple(s.stem for s in sorted(SRC.glob("*.py")))
    done = []
    for name in names:
        src = SRC / f"{name.removesuffix('.py')}.py"
        t0 = time.perf_counter()
        try:
            target = execute(src, config.output_dir, config.results_dir, config.device, config.timeout)
        except NotebookFailed as failed:  # mid-run: exit 1, the notebook before it left as it was
            print(f"run_notebooks.py: error: {failed}", file=sys.stderr)
            raise SystemExit(1) from None
        print(f"executed {src.relative_to(ROOT)} -> {target} in {time.perf_counter() - t0:.1f} s")
        done.append(str(target))
    return done


if __name__ == "__main__":
    cli.main(Config, run, report=lambda done: None)
