"""One contract for every command line: bad input is one line on stderr, exit code 2, no traceback,
nothing written, and the run never starts.

The command lines are found, not listed: every lab file and benchmark that defines a ``Config``
and hands it to ``cli.main``. The bad values are generated from each ``Config``'s fields, by type
and bound, so a new flag is covered the day it is added.

Issue 31's classes are generated the same way (:func:`hostile_values`): for every ``Path`` field a
name too long for the file system, and by the field's role a FIFO, ``/dev/zero``, ``/dev/urandom``,
a folder or ``/proc`` where a file is read or written; for every whole number the values near 2**63
that torch overflows on; for every number Unicode digits; for every float the subnormal ones; for
every ``--model`` each zoo name, hostile ``config.json`` contents and the same special files. They
run in a loop inside one test per command line (the cases are cheap: each is refused by the
``Config``, in this process); each test says how many it ran.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import io
import json
import os
import sys
import typing
from contextlib import redirect_stderr
from pathlib import Path

import pytest
from conftest import ROOT

from labkit import cli, labs, zoo
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
            if hi is not None:  # a step that is still a step at float32's largest (hi + 1 == hi there)
                out.append((name, str(hi + max(1, abs(hi) * 1e-6) if meta.get("max") is not None else hi)))
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
#: (the widest a flag takes, labkit.config.MAX_WIDTH: terabytes for any of the toy models)
TOO_BIG = {2: ["--width=131072"], 3: ["--width=131072"], 4: ["--width=131072"], 5: ["--seq-lens=4000000"],
           6: ["--width=131072"], 7: ["--width=131072"], 8: ["--width=131072"], 9: ["--width=131072"],
           10: ["--width=131072"], 11: ["--width=131072"], 12: ["--width=131072"]}


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


# ---------------------------------------------------------------------- issue 31: the classes a Config alone does not reach
LONG_NAME = "n" * 300  # one part over the 255 bytes a file name may have
LONG_PATH = "/".join(["d" * 200] * 25)  # short parts, 5,024 bytes in all: over the 4,095 a path may have


def _numeric(kind) -> bool:
    return kind in (int, float) or (typing.get_origin(kind) is tuple and typing.get_args(kind)[0] in (int, float))


def hostile_values(config_cls) -> list[tuple[str, str]]:
    """(flag, text) for every field, the classes of issue 31; ``{tmp}`` is a folder holding ``fifo``
    (a named pipe), ``file`` (a regular file) and ``dir`` (a folder)."""
    out = []
    for f, kind in fields_of(config_cls):
        base, _ = split_optional(kind)
        meta, name = f.metadata, flag(f.name)
        if meta.get("positional") or choices_of(base) is not None:
            continue
        if _numeric(base) and meta.get("parse") is None:
            out += [(name, "\u0663"), (name, "\uff11\uff12"), (name, "1\u0660")]  # Arabic-Indic 3, fullwidth 12, 1 and a 0
        if base is int or (typing.get_origin(base) is tuple and typing.get_args(base)[0] is int):
            out += [(name, str(2**62)), (name, str(2**63 - 1)), (name, str(2**63 - 2**10))]
        if base is float:
            out += [(name, "1e-320"), (name, "5e-324"), (name, "1e300")]
        if base is Path:
            out += [(name, "{tmp}/" + LONG_NAME), (name, "{tmp}/" + LONG_NAME + "/x"), (name, "/" + LONG_PATH),
                    (name, "{tmp}/a\nb/" + LONG_NAME)]  # a newline in a name: the line must stay one line
            role = meta.get("path")
            if role == "read":
                out += [(name, "{tmp}/fifo"), (name, "/dev/zero"), (name, "/dev/urandom"), (name, "{tmp}/dir"),
                        (name, "{tmp}/missing")]
            elif role == "write":
                out += [(name, "/"), (name, "{tmp}/dir"), (name, "/proc/x/plan.md"), (name, "{tmp}/fifo"),
                        (name, "{tmp}/file/x.json"), (name, "/dev/zero")]
            elif role == "folder":
                out += [(name, "{tmp}/file"), (name, "/proc/x"), (name, "{tmp}/file/sub")]
        if f.name == "model" and base is str:
            out += [(name, "{tmp}/" + LONG_NAME), (name, "{tmp}/fifo"), (name, "/dev/zero"), (name, "/dev/urandom"),
                    (name, "{tmp}/dir"), (name, "{tmp}/missing/config.json"), (name, "/" + LONG_PATH)]
            out += [(name, "{tmp}/configs/" + c) for c in HOSTILE_CONFIGS]
    return out


_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
_MOE = _LLAMA | {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
#: config.json contents a --model PATH reader meets: the issue's, and their neighbours
HOSTILE_CONFIGS = {
    "type-list.json": _LLAMA | {"model_type": ["llama"]},
    "type-number.json": _LLAMA | {"model_type": 7},
    "nested.json": "[" * 100_000 + "]" * 100_000,
    "nested-field.json": json.dumps(_LLAMA)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}",
    "digits.json": json.dumps(_LLAMA)[:-1] + ', "vocab_size": ' + "9" * 5000 + "}",
    "vocab-0.json": _LLAMA | {"vocab_size": 0},
    "experts-0.json": _MOE | {"num_local_experts": 0},
    "top-k-above-experts.json": _MOE | {"num_experts_per_tok": 8},
    "experts-1e6.json": _MOE | {"num_local_experts": 10**6},
    "layers-1e6.json": _LLAMA | {"num_hidden_layers": 10**6},
    "layers-2e63.json": _LLAMA | {"num_hidden_layers": 2**63 - 1},
    "width-text.json": _LLAMA | {"hidden_size": "64"},
    "width-float.json": _LLAMA | {"hidden_size": 64.5},
    "width-bool.json": _LLAMA | {"hidden_size": True},
    "width-negative.json": _LLAMA | {"hidden_size": -64},
    "width-list.json": _LLAMA | {"hidden_size": [64]},
    "heads-indivisible.json": _LLAMA | {"num_attention_heads": 3},
    "kv-above-heads.json": _LLAMA | {"num_key_value_heads": 8},
    "huge-model.json": _LLAMA | {"hidden_size": 131072, "intermediate_size": 131072, "num_hidden_layers": 1024,
                                 "num_attention_heads": 1024, "num_key_value_heads": 1024},
    "nan.json": json.dumps(_LLAMA)[:-1] + ', "rms_norm_eps": NaN}',
    "infinity.json": json.dumps(_LLAMA)[:-1] + ', "rms_norm_eps": 1e999}',
    "tied-text.json": _LLAMA | {"tie_word_embeddings": "yes"},
    "pad-outside-vocab.json": _LLAMA | {"pad_token_id": 999},  # transformers warns, then its embedding asserts
    "rope-type-unknown.json": _LLAMA | {"rope_scaling": {"rope_type": "nope"}},  # transformers warns, then fails
    "text-config-bad.json": {"model_type": "llava", "text_config": _LLAMA | {"vocab_size": 0}},
    "encoder.json": {"model_type": "bert", "hidden_size": 64},
    "unknown-type.json": _LLAMA | {"model_type": "no-such-model"},
    "no-type.json": {"hidden_size": 64},
    "array.json": [_LLAMA],
    "null.json": None,
    "empty.json": "",
    "not-utf8.json": b"\xff\xfe{\x00",
    "too-big.json": " " * (zoo.CONFIG_BYTES + 1) + json.dumps(_LLAMA),
}


def _hostile_folder(tmp: Path) -> Path:
    fixtures = tmp / "fixtures"
    (fixtures / "dir").mkdir(parents=True)
    (fixtures / "file").write_text("a file\n")
    os.mkfifo(fixtures / "fifo")
    (fixtures / "configs").mkdir()
    for name, content in HOSTILE_CONFIGS.items():
        data = content if isinstance(content, (str, bytes)) else json.dumps(content)
        (fixtures / "configs" / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return fixtures


class _Accepted(Exception):
    pass


def _accept(config):
    raise _Accepted


def _refused(config_cls, argv: list[str], prog: str, run=_never, caplog=None) -> str | None:
    """None when ``argv`` is refused as the contract says (exit 2, one line, no traceback, the run never
    started); "accepted" when ``run`` is ``_accept`` and was reached; else what happened instead.
    ``caplog``: pytest's log capture, for what a library logged at WARNING or above (transformers'
    handler prints it on the stderr it was imported with: lines before the refusal's); a Python
    warning counts too."""
    import logging
    import warnings

    err = io.StringIO()
    if caplog is not None:
        caplog.clear()
    try:
        with redirect_stderr(err), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            cli.main(config_cls, run, None, argv, prog=prog)
    except _Accepted:
        return "accepted"
    except SystemExit as exc:
        logged = [r.getMessage() for r in (caplog.records if caplog is not None else []) if r.levelno >= logging.WARNING]
        said = "\n".join([err.getvalue(), *logged, *(str(w.message) for w in warned)])
        lines = [line for line in said.splitlines() if line.strip()]
        if exc.code != 2 or len(lines) != 1 or "Traceback" in lines[0]:
            return f"exit {exc.code}, {len(lines)} line(s): {said[-300:]!r}"
        return None
    except BaseException as exc:  # noqa: BLE001 - any other way out is what the contract forbids
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return "accepted"


HOSTILE = [pytest.param(path, id=f"{path.parent.name}/{path.stem}") for path in command_lines()]


@pytest.mark.parametrize("path", HOSTILE)
def test_hostile_values_are_one_line_exit_2_and_nothing_runs(path, tmp_path, monkeypatch, caplog):
    """Every case of :func:`hostile_values` for this command line, in a loop: refused in one line,
    exit 2, before the run, nothing written (the working folder stays empty, the fixtures as they
    were, the FIFO never opened: a read would block, and this test would hang instead of failing)."""
    fixtures = _hostile_folder(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    config_cls = load(path).Config
    before = sorted(p.name for p in fixtures.rglob("*"))
    cases = hostile_values(config_cls)
    wrong = [(name, text[:60], why) for name, text in cases
             if (why := _refused(config_cls, [name, text.replace("{tmp}", str(fixtures))], path.name, caplog=caplog))]
    assert not wrong, f"{len(wrong)} of {len(cases)} cases not refused: {wrong[:5]}"
    assert not os.listdir(work) and sorted(p.name for p in fixtures.rglob("*")) == before
    print(f"{path.parent.name}/{path.name}: {len(cases)} hostile cases refused")


def test_the_hostile_generator_reaches_every_class():
    """The counts the generator reaches over every command line (said in the report of issue 31)."""
    counts: dict[str, int] = {}
    for path in command_lines():
        for _name, text in hostile_values(load(path).Config):
            kind = ("unicode digits" if not text.isascii() else "near 2**63" if text.isdigit() and len(text) >= 18
                    else "subnormal or huge float" if text in ("1e-320", "5e-324", "1e300")
                    else "hostile config.json" if "/configs/" in text else "path or special file")
            counts[kind] = counts.get(kind, 0) + 1
    assert all(counts.get(k, 0) >= 20 for k in ("unicode digits", "near 2**63", "subnormal or huge float",
                                                   "hostile config.json", "path or special file")), counts
    print(counts, sum(counts.values()))


def test_every_size_has_a_ceiling_and_every_path_a_role():
    """A number with no upper bound lets 2**63 - 1 reach torch (an overflow, or a loop that never
    ends); a path without a role is checked for its name only. Both are refused here, for every flag
    of every command line."""
    missing = []
    for path in command_lines():
        for f, kind in fields_of(load(path).Config):
            base, _ = split_optional(kind)
            m = f.metadata
            if _numeric(base) and m.get("max") is None and m.get("below") is None:
                missing.append(f"{path.name}: {flag(f.name)} has no max")
            if base is Path and m.get("path") not in ("read", "write", "folder"):
                missing.append(f"{path.name}: {flag(f.name)} does not say whether it is read or written")
    assert not missing, missing


MODEL_LABS = [path for path in command_lines() if "model" in {f.name for f, _ in fields_of(load(path).Config)}]


@pytest.mark.parametrize("path", [pytest.param(p, id=f"{p.parent.name}/{p.stem}") for p in MODEL_LABS])
def test_every_zoo_name_is_run_or_refused_in_one_line(path, capsys, monkeypatch):
    """``--model NAME`` for every zoo name: the Config accepts it (the lab runs that family: see
    test_hostile.py for the runs) or refuses it in one line naming the names it takes."""
    from labkit.dist import world_of_one

    for key, value in world_of_one().items():  # the torchrun labs check their flags as a rank would
        monkeypatch.setenv(key, value)
    config_cls, accepted = load(path).Config, []
    for name in zoo.names():
        why = _refused(config_cls, ["--model", name], path.name, run=_accept)
        if why == "accepted":
            accepted.append(name)
        else:
            assert why is None, (name, why)
    assert accepted, f"{path.name} runs no zoo model at all"
