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

import argparse
import os
import sys
import time
from pathlib import Path

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
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny CPU configurations: one thread is fastest
    if results_dir is not None:
        env["INFRALAB_RESULTS_DIR"] = str(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(out_dir)}},
        allow_errors=False,
    )
    # nbclient hands ``env`` to the kernel manager, which starts the kernel with it
    t0 = time.perf_counter()
    client.execute(env=env)
    wall = time.perf_counter() - t0
    nb.metadata["infralab"] = {
        "lab": src.stem,
        "source": src.relative_to(ROOT).as_posix(),
        "executed_by": "scripts/run_notebooks.py",
        "device": device,
        "execution_wall_time_s": round(wall, 2),
    }
    target = out_dir / f"{src.stem}.ipynb"
    nbformat.write(nb, target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="notebook names (default: every notebooks/src/*.py)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--output-dir", type=Path, default=ROOT / "notebooks")
    p.add_argument("--results-dir", type=Path, default=None, help="where notebooks write results (default: results/)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    args = p.parse_args(argv)
    sources = sorted(SRC.glob("*.py")) if not args.names else [SRC / f"{n.removesuffix('.py')}.py" for n in args.names]
    missing = [s.name for s in sources if not s.is_file()]
    if missing:
        print(f"run_notebooks.py: error: no notebook source named {', '.join(missing)} in {SRC}", file=sys.stderr)
        return 2
    for src in sources:
        t0 = time.perf_counter()
        target = execute(src, args.output_dir, args.results_dir, args.device, args.timeout)
        print(f"executed {src.relative_to(ROOT)} -> {target} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
