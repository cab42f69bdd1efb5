"""One contract for every command line: bad input is one line on stderr, exit code 2, no traceback,
nothing written, and the run never starts.

The command lines are found, not listed: every lab file and benchmark that defines a ``Config``
and hands it to ``cli.main``. The bad values are generated from each ``Config``'s fields, by type
and bound, so a new flag is covered the day it is added.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import sys
import typing
from pathlib import Path

import pytest
from conftest import ROOT

from labkit import cli, labs
from labkit.config import INT64_MAX, choices_of, fields_of, flag, split_optional


def _has_cli(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    has_config = any(isinstance(n, ast.ClassDef) and n.name == "Config" for n in tree.body)
    calls_main = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "main"
                     and isinstance(n.func.value, ast.Name) and n.func.value.id == "cli" for n in ast.walk(tree))
    return has_config and calls_main


def command_lines() -> list[Path]:
    files = sorted(ROOT.glob("code/lab-*/*.py")) + sorted(ROOT.glob("bench/*.py")) + sorted(ROOT.glob("scripts/**/*.py"))
    return [f for f in files if _has_cli(f)]


def load(path: Path):
    if path.parent.parent.name == "code":
        return labs.load(path.parent.name, path.stem)
    name = f"{path.parent.name}_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def bad_values(config_cls) -> list[tuple[str, str]]:
    """(flag, bad text) for every field: wrong type, out of bounds, not finite, too large, no such choice."""
    out = []
    for f, kind in fields_of(config_cls):
        base, _ = split_optional(kind)
        meta, name = f.metadata, flag(f.name)
        if meta.get("positional"):
            continue  # a name, not a value: its refusals are the command's own tests
        lo = meta.get("min") if meta.get("min") is not None else meta.get("above")
        hi = meta.get("max") if meta.get("max") is not None else meta.get("below")
        if meta.get("parse") is not None:
            out += [(name, "not-a-value"), (name, "")]
        elif choices_of(base) is not None:
            out.append((name, "no-such-choice"))
        elif base is int:
            out += [(name, "many"), (name, "1.5"), (name, str(10**30)), (name, str(-INT64_MAX * 10))]
            if lo is not None:
                out.append((name, str(int(lo) - 1 if meta.get("min") is not None else int(lo))))
            if hi is not None:
                out.append((name, str(int(hi) + 1 if meta.get("max") is not None else int(hi))))
        elif base is float:
            out += [(name, "lots"), (name, "nan"), (name, "inf"), (name, "-inf")]
            if lo is not None:
                out.append((name, str(lo - 1 if meta.get("min") is not None else lo)))
            if hi is not None:
                out.append((name, str(hi + 1 if meta.get("max") is not None else hi)))
        elif base is Path:
            out.append((name, ""))
        elif typing.get_origin(base) is tuple:
            out += [(name, "a,b"), (name, ",")]
            if lo is not None:
                out.append((name, f"{int(lo) - 1}"))
    return out


def _asks_for_a_gpu_there_is_not(config_cls) -> list[tuple[str, str]]:
    """``--device cuda`` on a machine without a GPU, for every command line that offers it."""
    import torch

    field = {f.name: kind for f, kind in fields_of(config_cls)}.get("device")
    offers = field is not None and "cuda" in (choices_of(split_optional(field)[0]) or ())
    return [("--device", "cuda")] if offers and not torch.cuda.is_available() else []


CASES = [pytest.param(path, name, text, id=f"{path.parent.name}/{path.stem}:{name}={text[:12]}")
         for path in command_lines()
         for name, text in bad_values(load(path).Config) + _asks_for_a_gpu_there_is_not(load(path).Config)]


@pytest.mark.parametrize("n", sorted(labs.STARTERS))
def test_every_lab_has_a_command_line_under_the_contract(n):
    assert labs.starter(n) in command_lines()


def _never(config):
    raise AssertionError(f"the run started with bad input: {config}")


@pytest.mark.parametrize(("path", "name", "text"), CASES)
def test_bad_input_is_one_line_exit_2_and_nothing_runs(path, name, text, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config_cls = load(path).Config
    with pytest.raises(SystemExit) as exc:
        cli.main(config_cls, _never, None, [f"{name}={text}"], prog=path.name)
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert name in err[0] or name.lstrip("-") in err[0], (name, err[0])
    assert not os.listdir(tmp_path)  # nothing written


def test_the_configs_have_a_help_text_for_every_flag():
    for path in command_lines():
        for f in dataclasses.fields(load(path).Config):
            assert f.metadata.get("help"), f"{path.name}: {flag(f.name)} has no help text"


# A size that fits int64 but no machine: refused from the lab's own floor, before anything is allocated.
TOO_BIG = {2: ["--width=1000000"], 3: ["--width=1000000"], 4: ["--width=1000000"], 5: ["--seq-lens=4000000"],
           6: ["--width=1000000"], 7: ["--width=1000000"], 8: ["--width=1000000"], 9: ["--width=1000000"],
           10: ["--width=1000000"], 11: ["--width=1000000"], 12: ["--width=1000000"]}


@pytest.mark.parametrize("n", sorted(TOO_BIG))
def test_sizes_the_machine_cannot_hold_are_refused_before_anything_is_allocated(n, capsys, monkeypatch):
    import torch

    from labkit.dist import world_of_one

    for key, value in world_of_one().items():  # the torchrun labs refuse before joining a group
        monkeypatch.setenv(key, value)
    lab = labs.load(n)
    real_empty = torch.empty

    def small_only(*size, **kwargs):  # a floor that let the run start would allocate huge tensors
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        assert torch.Size(shape).numel() < 1 << 32, "allocated before refusing"
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", small_only)
    with pytest.raises(SystemExit) as exc:
        cli.main(lab.Config, lab.run, None, ["--device=cpu", *TOO_BIG[n]], prog="lab")
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "needs at least" in err[0] and "available RAM" in err[0], err
