"""Labs reuse each other in one visible way: ``lab08 = labs.load(8)``.

A lab folder's name has dashes (``code/lab-08-offload-memory-saving``), so it is no Python package.
This module makes its files importable all the same, without touching ``sys.path``:

* :func:`load` returns a lab's starter (or another of its files) as a module. A lab that reuses
  another says so once, at the top: ``lab08 = labs.load(8)``.
* Inside a lab, a file imports the file next to it by its plain name
  (``from offload_engines import LayerwiseOffload``). Run as a script, Python finds it next to the
  script; loaded through :func:`load`, the finder below finds it. So a lab module has one name
  (its file's stem) however it was reached, and the stems of all lab files are unique.
* :func:`sources` lists the files a lab's code depends on, read from its ``import`` statements and
  ``labs.load`` calls (the ``ast``, not a regex), for the source hash provenance records.

``STARTERS`` is the one place that names each lab's starter file: its page quotes it, its
notebook runs it, ``load`` returns it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

CODE_DIR = Path(__file__).resolve().parents[1]

STARTERS = {
    1: "memory_accounting.py",
    2: "train_single_gpu.py",
    3: "mixed_precision.py",
    4: "checkpointing.py",
    5: "attention.py",
    6: "grad_accumulation.py",
    7: "optimizer_offload.py",
    8: "offload.py",
    9: "activation_offload.py",
    10: "train_ddp.py",
    11: "zero_fsdp.py",
    12: "memory_debugging.py",
    13: "fit.py",
    14: "serve_memory.py",
    15: "finetune.py",
    16: "caching_allocator.py",
}

_SLUG = re.compile(r"^lab-(\d\d)-[a-z0-9-]+$")


def folders() -> dict[int, Path]:
    """Every lab folder under code/, by number."""
    out = {}
    for p in sorted(CODE_DIR.glob("lab-*")):
        m = _SLUG.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


def folder(lab: int | str | Path) -> Path:
    """``8``, ``"08"``, ``"lab-08"``, ``"lab-08-offload-memory-saving"`` or a path inside it -> its folder."""
    if isinstance(lab, Path) or (isinstance(lab, str) and "/" in lab):
        p = Path(lab).resolve()
        for candidate in (p, *p.parents):
            if candidate.parent == CODE_DIR and _SLUG.match(candidate.name):
                return candidate
        raise LookupError(f"{lab} is not inside a lab folder under {CODE_DIR}")
    text = str(lab)
    m = re.match(r"^(?:lab-)?(\d{1,2})(?:-[a-z0-9-]+)?$", text)
    if not m:
        raise LookupError(f"no lab named {lab!r}: give its number, e.g. 8 or 'lab-08'")
    found = folders().get(int(m.group(1)))
    if found is None or (text.count("-") > 1 and found.name != text):
        raise LookupError(f"no lab folder for {lab!r} under {CODE_DIR}")
    return found


def slug(lab: int | str | Path) -> str:
    """``8`` -> ``"lab-08-offload-memory-saving"``."""
    return folder(lab).name


def number(lab: int | str | Path) -> int:
    return int(_SLUG.match(folder(lab).name).group(1))


def starter(lab: int | str | Path) -> Path:
    """The lab's starter file (``STARTERS``)."""
    return folder(lab) / STARTERS[number(lab)]


def load(lab: int | str | Path, module: str | None = None) -> ModuleType:
    """A lab's starter as a module, or its file ``module`` (e.g. ``load(11, "fsdp_inference")``)."""
    path = starter(lab) if module is None else folder(lab) / f"{module.removesuffix('.py')}.py"
    if not path.is_file():
        raise LookupError(f"{slug(lab)} has no file {path.name}")
    return importlib.import_module(path.stem)


@cache
def modules() -> dict[str, Path]:
    """Every lab file by its stem; a stem used twice is an error (it could not be imported by name)."""
    out: dict[str, Path] = {}
    for f in sorted(CODE_DIR.glob("lab-*/*.py")):
        if f.stem in out:
            raise ImportError(f"two lab files are named {f.name}: {out[f.stem]} and {f}; rename one")
        out[f.stem] = f
    return out


class _LabFinder(importlib.abc.MetaPathFinder):
    """Finds ``import offload_engines`` in the lab folder that holds ``offload_engines.py``.

    It comes last on ``sys.meta_path``, so it never hides an installed package."""

    def find_spec(self, name, path=None, target=None):
        if path is not None or "." in name:
            return None
        file = modules().get(name)
        return importlib.util.spec_from_file_location(name, file) if file else None


if not any(isinstance(f, _LabFinder) for f in sys.meta_path):
    sys.meta_path.append(_LabFinder())


# ---------------------------------------------------------------------- what a lab's code depends on
def imports_of(file: Path) -> set[Path]:
    """The lab files ``file`` imports directly: ``import x``/``from x import`` of a lab file's stem,
    and ``labs.load(N)``/``labs.load(N, "module")`` calls with literal arguments."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    names = modules()
    out: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {names[a.name] for a in node.names if a.name in names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in names:
            out.add(names[node.module])
        elif isinstance(node, ast.Call) and _is_labs_load(node.func):
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if args and len(args) == len(node.args):
                out.add(starter(args[0]) if len(args) == 1 else folder(args[0]) / f"{args[1]}.py")
    return out


def _is_labs_load(func) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == "load" and \
        isinstance(func.value, ast.Name) and func.value.id == "labs"


def closure(files) -> list[Path]:
    """``files`` and every lab file they import, directly or not, sorted."""
    seen: set[Path] = set()
    todo = [Path(f).resolve() for f in files]
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo += [g.resolve() for g in imports_of(f)]
    return sorted(seen)


def sources(lab: int | str | Path) -> list[Path]:
    """The files a lab's measurements depend on: every ``*.py`` of its folder and what they import."""
    return closure(sorted(folder(lab).glob("*.py")))
