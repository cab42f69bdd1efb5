"""The handbook's mechanism figures, drawn by code: scripts/figures/*.py -> docs/assets/figures/*.svg.

    .venv/bin/python scripts/figures/make.py                 # every figure, into docs/assets/figures/
    .venv/bin/python scripts/figures/make.py zero-stages     # one figure
    .venv/bin/python scripts/figures/make.py --out-dir /tmp/fig   # elsewhere (the tests do this)

A chapter's or the primer's figure explains a mechanism (which tensors autocast keeps, what each
ZeRO rank holds, a paged block table), where a lab's notebook plots what a run measured. Each module
in this folder other than this one defines ``FIGURES``: a dict from the figure's name (the SVG's file
name) to a function that returns a matplotlib figure. A function draws from the numbers the labs
compute wherever there are numbers (it loads them with ``labkit.labs.load``, as a report does), and
only with the palette of ``labkit.plot``; ``labkit.plot.save`` writes the SVG, laid out for a phone
and following the site's light and dark palettes. Pages show a figure with its alt text and a
caption that says what to notice; ``tests/test_figures.py`` re-draws every figure and holds the
committed SVG to it, so a figure cannot drift from the code that draws it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from labkit import cli
from labkit.config import UsageError, check_fields, option
from labkit.files import check_writable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "docs" / "assets" / "figures"


def registry() -> dict[str, Callable]:
    """Every figure of every module in this folder, by name; a name defined twice is an error."""
    out: dict[str, Callable] = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name == "make.py" or path.name.startswith("_"):
            continue
        spec = importlib.util.spec_from_file_location(f"infralab_figures_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, draw in getattr(module, "FIGURES", {}).items():
            if name in out:
                raise ValueError(f"figure {name!r} is defined twice (second time in {path.name})")
            out[name] = draw
    return out


@dataclass
class Config:
    """Draw the handbook's mechanism figures into docs/assets/figures/ (or --out-dir)."""

    names: tuple[str, ...] = option((), "figure names (default: every figure)", positional=True)
    out_dir: Path = option(OUT, "where the SVGs go (default: docs/assets/figures/)", path="folder")

    def __post_init__(self) -> None:
        check_fields(self)
        known = registry()
        missing = [n for n in self.names if n not in known]
        if missing:
            raise UsageError(f"no figure named {', '.join(missing)} (known: {', '.join(sorted(known)) or 'none'})")


def draw(name: str, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.plot import save

    fig = registry()[name]()
    try:
        return save(fig, Path(out_dir) / f"{name}.svg")
    finally:
        plt.close(fig)


def run(config: Config) -> list[Path]:
    check_writable(Path(config.out_dir) / ".probe", "--out-dir")
    return [draw(name, config.out_dir) for name in (config.names or tuple(sorted(registry())))]


def report(paths: list[Path]) -> None:
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    cli.main(Config, run, report)
