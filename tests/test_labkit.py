"""labkit's bench beside the ledger: the typed Config and the command line built from it, how labs
load each other, provenance, the one table renderer, plots, the toy models."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
from conftest import ROOT, load_bench

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, cli, labs, marks
from labkit import provenance as prov
from labkit.cli import pick_device, progress
from labkit.config import LabConfig, UsageError, option
from labkit.models import gpt_param_count
from labkit.plot import decimate, plot_timeline, save
from labkit.table import Table, by_category, escape, format_bytes


# ---------------------------------------------------------------- device and CLI
def test_auto_and_cpu_devices():
    assert pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_usage_error():
    with pytest.raises(UsageError, match="no CUDA GPU"):
        pick_device("cuda")


def test_unknown_device_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown device"):
        pick_device("tpu")


THREADS_PROBE = """
import json, torch
from labkit import cli
start = torch.get_num_threads()
cli.pick_device("cpu"); first = torch.get_num_threads()
torch.set_num_threads(2); cli.pick_device("cpu"); later = torch.get_num_threads()
print(json.dumps({"start": start, "first": first, "later": later, "asked_0": cli.cpu_threads(0),
                  "asked_3": cli.cpu_threads(3)}))
"""


def fresh_python(code: str, **env: str) -> dict:
    """``code`` in a new interpreter whose environment has no thread variable but ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in cli.THREAD_VARIABLES}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "2"}], ids=["no variable", "OMP_NUM_THREADS=2"])
def test_a_cpu_run_chooses_one_thread_once_unless_the_reader_asked(env):
    """The first CPU device a process resolves sets one intra-op thread, unless OMP_NUM_THREADS
    chose (PyTorch read it at start, at most one per core); later the count is the reader's
    (torch.set_num_threads holds); a lab's explicit option wins, and 0 asks for PyTorch's own count,
    the one the process started with."""
    seen = fresh_python(THREADS_PROBE, **env)
    assert seen["first"] == (seen["start"] if env else 1)
    assert seen["later"] == 2 and seen["asked_0"] == seen["start"] and seen["asked_3"] == 3
    with pytest.raises(UsageError, match="threads must be 0"):
        cli.cpu_threads(-1)


def test_every_test_process_runs_on_the_labs_rule():
    """The suite's own processes (each pytest-xdist worker) are CPU runs of the labs: one thread
    each, unless OMP_NUM_THREADS says more, so two workers on two cores do not oversubscribe them."""
    if any(os.environ.get(name) for name in cli.THREAD_VARIABLES):
        pytest.skip("the environment sets the thread count")
    assert torch.get_num_threads() == 1


LAB07_SMALL = ["--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--vocab", "64",
               "--batch-size", "4", "--steps", "2", "--json"]


@pytest.mark.parametrize("flags", [["--device", "cpu"], ["--model", "small-llama", "--fake"]], ids=["real", "fake"])
def test_a_labs_command_line_runs_on_one_thread_in_a_plain_shell(flags):
    """A lab's command line with no OMP_NUM_THREADS runs on one thread (its provenance records the
    count), whichever path its run takes: ``cli.main`` resolves the device before the lab runs, so
    a trace on fake tensors, whose run never resolves one, has chosen too. OMP_NUM_THREADS wins."""
    code = (f"import sys; sys.argv = ['lab', *{LAB07_SMALL + flags!r}]; from labkit import cli, labs; "
            "lab = labs.load(7); cli.main(lab.Config, lab.run, lab.report)")
    assert fresh_python(code)["provenance"]["cpu_threads"] == 1
    asked = fresh_python(THREADS_PROBE, OMP_NUM_THREADS="2")["start"]  # 2, or 1 on a one-core machine
    assert fresh_python(code, OMP_NUM_THREADS="2")["provenance"]["cpu_threads"] == asked


@dataclass
class Demo(LabConfig):
    """A demo lab."""

    steps: int = option(3, "steps", min=1)
    rate: float = option(1.0, "a rate", above=0)
    mode: Literal["a", "b"] = option("a", "a mode")
    sizes: tuple[int, ...] = option((1, 2), "sizes", min=1)
    out: Path | None = option(None, "where to write")
    fast: bool = option(False, "a switch")


def test_config_fields_are_checked_and_converted():
    d = Demo(out="x.json", rate=2)
    assert d.out == Path("x.json") and d.rate == 2.0 and isinstance(d.rate, float)
    for fields, fragment in [({"steps": 0}, "--steps must be 1 or more, got 0"), ({"steps": 1.5}, "whole number"),
                             ({"steps": True}, "whole number"), ({"steps": 10**30}, "does not fit a 64-bit"),
                             ({"rate": float("nan")}, "finite"), ({"rate": 0}, "--rate must be above 0"),
                             ({"mode": "c"}, "--mode must be one of a, b"), ({"sizes": ()}, "at least one"),
                             ({"sizes": (1, 0)}, "--sizes must be 1 or more"), ({"seed": -1}, "--seed must be in"),
                             ({"device": "tpu"}, "--device must be one of"), ({"fast": 1}, "switch")]:
        with pytest.raises(UsageError, match=fragment.replace("(", r"\(")):
            Demo(**fields)


def test_the_command_line_is_built_from_the_config(capsys):
    seen = []

    def run(config):
        seen.append(config)
        return config

    cli.main(Demo, run, lambda config: print("report", config.steps), ["--steps", "5", "--mode", "b",
                                                                      "--sizes", "3,4", "--fast"])
    assert seen[0] == Demo(steps=5, mode="b", sizes=(3, 4), fast=True)
    assert capsys.readouterr().out == "report 5\n"
    cli.main(Demo, lambda config: {"steps": config.steps}, None, ["--json"])
    assert json.loads(capsys.readouterr().out) == {"steps": 3}
    made = Demo(steps=7, rate=0.5, mode="b", sizes=(5,), out=Path("o.json"), fast=True, seed=3)
    assert cli.parse(Demo, cli.argv(made))[0] == made  # the command line a config comes from, and back
    help_text = cli.parser(Demo, "demo.py").format_help()
    assert "A demo lab." in help_text and "--sizes A,B,..." in help_text and "(default: 1,2)" in help_text


@pytest.mark.parametrize("argv, fragment", [
    (["--device", "tpu"], "argument --device: invalid choice"),
    (["--steps", "0"], "--steps must be 1 or more, got 0"),
    (["--rate", "inf"], "--rate must be a finite number, got inf"),
    (["--steps", "many"], "argument --steps: expected a whole number, got 'many'"),
    (["--out", ""], "argument --out: expected a path"),
])
def test_bad_input_is_one_line_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(Demo, lambda c: pytest.fail("ran"), None, argv, prog="demo.py")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("demo.py: error:") and fragment in err


def test_a_usage_error_raised_by_the_run_is_one_line(capsys):
    def run(config):
        raise UsageError("the checkpoint does not fit")

    with pytest.raises(SystemExit) as exc:
        cli.main(Demo, run, None, [], prog="demo.py")
    assert exc.value.code == 2 and capsys.readouterr().err == "demo.py: error: the checkpoint does not fit\n"


def test_out_of_memory_is_one_line(capsys):
    def cpu_oom(config):
        torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: the CPU allocator refuses

    with pytest.raises(SystemExit) as exc:
        cli.main(Demo, cpu_oom, None, [], prog="lab.py")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("lab.py: error: out of memory (") and err.rstrip().endswith("ask for smaller sizes")

    def other(config):
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):  # anything else is not swallowed
        cli.main(Demo, other, None, [], prog="lab.py")


def test_progress_bar_is_silent_under_json(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_quiet", True)
    assert list(progress(range(3), total=3)) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_choosing_a_device_launches_nothing(monkeypatch):
    """Parsing a lab's arguments must not touch a GPU: the ledger warms it up when it starts."""
    from labkit import cuda

    monkeypatch.setattr(cuda, "warm_up", lambda device: pytest.fail("warmed up while choosing a device"))
    assert pick_device("auto").type in ("cpu", "cuda")


# ---------------------------------------------------------------- labs load each other one way
def test_labs_are_found_by_number_and_slug():
    assert labs.slug(8) == labs.slug("08") == labs.slug("lab-08") == "lab-08-offload-memory-saving"
    assert labs.slug(labs.starter(8)) == "lab-08-offload-memory-saving"
    assert set(labs.STARTERS) == set(labs.folders())  # every lab names its starter, every starter a lab
    for n in labs.folders():
        assert labs.starter(n).is_file()
    with pytest.raises(LookupError):
        labs.folder(99)
    with pytest.raises(LookupError):
        labs.folder("lab-08-not-this-one")


def test_load_returns_the_module_a_sibling_import_would():
    lab02 = labs.load(2)
    assert lab02 is labs.load("lab-02-single-gpu-training") and lab02.__name__ == "train_single_gpu"
    import train_single_gpu  # what a file next to it writes

    assert train_single_gpu is lab02


def test_every_lab_file_has_a_unique_importable_name():
    """A lab file is imported by its stem: no two may share one, and none may shadow a package."""
    import importlib.util

    for stem, path in labs.modules().items():
        spec = importlib.util.find_spec(stem)
        assert spec is not None and Path(spec.origin).resolve() == path.resolve(), (stem, spec)


@pytest.mark.parametrize("n", sorted(labs.STARTERS))
def test_the_files_a_lab_is_hashed_over_are_the_files_it_imports(n, prewarmed, tmp_path):
    """The provenance hash reads a lab's imports from its source (ast); loading the starter in a
    fresh interpreter must import exactly those lab files, no more and no fewer, but for a file
    imported only inside a function (when the run needs it: a cycle, or a slow import), and what such a
    file imports in turn, which the hash covers all the same. (The prewarmed interpreter has imported
    torch alone, no lab file.)"""
    script = tmp_path / "imports.py"
    script.write_text(f"import sys\nfrom labkit import labs\nlabs.load({n})\n"
                      "print('\\n'.join(sorted(m.__file__ for m in list(sys.modules.values()) "
                      "if getattr(m, '__file__', None) and '/code/lab-' in m.__file__)))\n", encoding="utf-8")
    out = subprocess.run([prewarmed, str(script)], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=load_bench("lab_runs_bench").fresh_shell(tmp_path))
    loaded = {Path(line).resolve() for line in out.stdout.split()}
    hashed = set(labs.closure([labs.starter(n)]))
    assert loaded <= hashed, loaded - hashed
    assert hashed - loaded <= set(labs.closure(_imported_inside_functions(hashed))), hashed - loaded


def _imported_inside_functions(files) -> set[Path]:
    """The lab files that an ``import`` inside a function of ``files`` names."""
    names, out = labs.modules(), set()
    for f in files:
        for fn in ast.walk(ast.parse(Path(f).read_text(encoding="utf-8"))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    stems = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module] if isinstance(node, ast.ImportFrom) else []
                    out |= {names[s].resolve() for s in stems if s in names}
    return out





# ---------------------------------------------------------------- provenance
def test_provenance_record_has_every_field():
    record = prov.collect("lab-02-single-gpu-training", "cpu", wall_time_s=1.23456)
    for key in ("device_type", "device_name", "driver_version", "cuda_version", "torch_version",
                "python_version", "git_commit", "source_hash", "labkit_hash", "date_utc", "wall_time_s"):
        assert key in record, key
    assert record["device_type"] == "cpu"
    assert record["torch_version"] == torch.__version__
    assert record["lab"] == "lab-02-single-gpu-training"
    assert len(record["source_hash"]) == 16
    assert record["wall_time_s"] == 1.235
    json.dumps(record)


def test_provenance_takes_the_commit_from_the_environment_without_git(monkeypatch):
    """A tree copied to a GPU machine has no .git: scripts/gpu_kit passes the commit along."""
    monkeypatch.setattr(prov, "_git", lambda *args: None)
    monkeypatch.delenv("INFRALAB_GIT_COMMIT", raising=False)
    assert prov.collect(None, "cpu")["git_commit"] is None
    monkeypatch.setenv("INFRALAB_GIT_COMMIT", "0123456789abcdef")
    monkeypatch.setenv("INFRALAB_GIT_DIRTY", "1")
    record = prov.collect(None, "cpu")
    assert record["git_commit"] == "0123456789abcdef" and record["git_dirty"] is True
    monkeypatch.setattr(prov, "_git", lambda *args: "fedcba" if args[0] == "rev-parse" else "")
    assert prov.collect(None, "cpu")["git_commit"] == "fedcba"  # git, where there is one, wins


def test_source_hash_follows_the_source_and_the_labs_it_imports(tmp_path, monkeypatch):
    code = tmp_path / "code"
    for name, text in [("lab-97-base/base_lab.py", "X = 1\n"),
                       ("lab-98-user/user_lab.py", "from labkit import labs\nbase = labs.load(97)\n"),
                       ("lab-99-alone/alone_lab.py", "Y = 2\n")]:
        (code / name).parent.mkdir(parents=True)
        (code / name).write_text(text)
    monkeypatch.setattr(labs, "CODE_DIR", code)
    monkeypatch.setattr(prov, "CODE_DIR", code)
    monkeypatch.setitem(labs.STARTERS, 97, "base_lab.py")
    labs.modules.cache_clear()
    try:
        assert labs.sources(98) == [code / "lab-97-base/base_lab.py", code / "lab-98-user/user_lab.py"]
        before = {n: prov.source_hash(n) for n in (98, 99)}
        (code / "lab-97-base/base_lab.py").write_text("X = 2\n")
        assert prov.source_hash(98) != before[98] and prov.source_hash(99) == before[99]
    finally:
        labs.modules.cache_clear()


def test_write_results_is_json_with_provenance(tmp_path):
    record = prov.collect(None, "cpu")
    path = prov.write_results(tmp_path / "deep" / "r.json", {"value": 3}, record)
    data = json.loads(path.read_text())
    assert data["value"] == 3 and data["provenance"]["device_type"] == "cpu"
    assert not list(tmp_path.rglob("*.tmp"))


# ---------------------------------------------------------------- plots
def _small_timeline():
    ledger = Ledger("cpu")
    w = torch.ones(1000)
    ledger.track(w, "parameters")
    with ledger:
        for step in range(2):
            with marks.phase("forward", step):
                a = w * 2
                b = a + 1
            with marks.phase("backward", step):
                del a, b
    return ledger


def test_timeline_plot_writes_png_and_svg(tmp_path):
    ledger = _small_timeline()
    tl = ledger.timeline()
    fig = plot_timeline(tl, title="t", overlay={"prediction": [4000] * len(tl)})
    png = save(fig, tmp_path / "t.png")
    svg = save(fig, tmp_path / "t.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and "prediction" in text


def test_peak_table_has_a_row_per_phase_and_a_total():
    ledger = _small_timeline()
    table = by_category(ledger.peaks_by_phase())
    lines = table.markdown().splitlines()
    assert lines[0].startswith("| phase | total | parameters |")  # the total first: on screen on a phone
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["forward", "backward"]
    assert "**11.72 KiB**" in lines[2]  # 1000 params + two 1000-float temporaries, 4 B each
    console = table.text().splitlines()
    assert console[0].split()[0] == "phase" and console[2].split()[0] == "forward" and "11.72 KiB" in console[2]


def test_one_table_renders_the_same_numbers_everywhere_and_escapes_text():
    t = Table(["what", ("bytes", "B"), ("share", "pct:1"), ("speed", "x:2"), ("ok", "yes")],
              [["<script>alert(1)</script> | x", 3149824, 0.614, 2.849, True], ["plain", None, 0.0, 1, False]])
    md = t.markdown()
    assert "<script>" not in md and "&lt;script&gt;" in md and "\\| x" in md
    assert "3,149,824 B | 61.4 % | 2.85x | yes" in md and "| plain | - | 0.0 % | 1.00x | no |" in md
    back = Table.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.markdown() == md and back.text() == t.text()
    assert "3,149,824 B" in t.text().splitlines()[2]


def test_a_table_with_no_rows_renders_its_header_and_says_so_everywhere():
    t = Table(["where", ("bytes", "B"), ("share", "pct:1")], empty="nothing grew | at all")
    console = t.text().splitlines()  # was a TypeError: max(len(name), *()) on no rows
    assert console == ["where  bytes  share", "-----  -----  -----", "nothing grew | at all"]
    md = t.markdown().splitlines()
    assert md[:2] == ["| where | bytes | share |", "|---|---:|---:|"] and md[2] == "| *nothing grew \\| at all* |  |  |"
    back = Table.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.markdown() == t.markdown() and back.text() == t.text()
    assert Table(["a"]).text().splitlines()[-1] == "(no rows)" and "empty" not in Table(["a"], [[1]]).to_dict()
    assert Table(["a", "b"]).add("x", "y").text().splitlines()[-1] == "x  y"  # a row replaces the note


# ---------------------------------------------------------------------- a table in a terminal
URLS = ["https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#lazy-loading",
        "https://github.com/pytorch/pytorch/issues/34323", "https://en.wikipedia.org/wiki/Bit_(unit)",
        "https://docs.pytorch.org/docs/2.13/notes/cuda.html#cublas-workspaces"]
KINDS = ["text", "code", "bytes", "size", "B", "+B", "int", "float:3", "pct:1", "x:2", "sci:2", "yes"]
WORDS = ["the", "allocator", "keeps", "freed", "blocks", "F.scaled_dot_product_attention(q,", "k,", "v)",
         "reshard_after_forward=True", "naïve", "·", "×", "东京", "e\u0301", "—", "blocks.0.attn.qkv.bias", "x" * 45]


def _value(kind: str, rng):
    name = kind.partition(":")[0]
    if name in ("text", "code"):
        words = rng.choices(WORDS, k=rng.choice([0, 1, 3, 12, 40]))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), rng.choice(["(", "see "]) + rng.choice(URLS) + rng.choice(
                [")", ".", ";", ""]))
        return " ".join(words)
    if name == "yes":
        return rng.random() < 0.5
    if rng.random() < 0.1:
        return None
    big = rng.choice([0, 7, 10**3, 10**6, 10**9, 10**12])
    return rng.uniform(-1, 1) * big if name in ("float", "x", "sci", "+B") else int(rng.uniform(0, 1) * big)


def _tables(n: int):
    import random

    rng = random.Random(1234)
    for _ in range(n):
        columns = [(rng.choice(["phase", "what it holds and why", "peak with those kept", "東京 bytes",
                                "x" * rng.randint(1, 30)]) + f" {i}", rng.choice(KINDS))
                   for i in range(rng.choice([1, 2, 3, 5, 8, 14]))]
        rows = [[_value(k, rng) for _, k in columns] for _ in range(rng.choice([0, 1, 2, 5]))]
        yield Table(columns, rows, empty=rng.choice(["(no rows)", "nothing grew: " + "a long reason " * 12]))


def test_a_table_fits_the_terminal_keeps_numbers_whole_and_moves_urls_into_notes():
    from labkit.table import width_of

    for table in _tables(150):
        numbers = [table.cell(v, k, markdown=False) for row in table.rows for v, (_, k) in zip(row, table.columns)
                   if k.partition(":")[0] not in ("text", "code", "yes")]
        text = [str(v) for row in table.rows for v, (_, k) in zip(row, table.columns) if k in ("text", "code")]
        shown = [u for u in URLS if any(u in t for t in text)]
        natural = table.text(width=10**6)
        for width in (40, 64, 100, 120):
            out = table.text(width=width)
            lines = out.splitlines()
            notes = [line for line in lines if line.startswith("[") and "] https://" in line]
            for line in lines:  # no line wider than the terminal: a note whose URL alone is wider is the exception
                assert width_of(line) <= width or (line in notes and len(line.split()[1]) > width - 4), (width, line)
            for number in numbers:  # a number is never split across lines
                assert any(number in line for line in lines), (number, out)
            if natural == out:  # it fits: printed as it is, each URL in its cell
                assert max(map(width_of, lines)) <= width
                continue
            assert sorted(line.split(" ", 1)[1] for line in notes) == sorted(shown)  # every URL whole, once
            for line in notes:
                marker = line.split(" ", 1)[0]  # "[1]": in the cell the URL left
                assert marker in out[:out.index(line)], (marker, out)
            assert not any("https://" in line for line in lines if line not in notes)


def test_a_table_that_fits_prints_as_it_did_and_one_that_does_not_wraps_turns_or_lists():
    t = Table(["what", ("bytes", "B"), "source"],
              [["the driver's total", 85520809984, f"assumed: NVML's total ({URLS[1]}); a lent card replaces it"],
               ["context", 1 << 30, "cited"]])
    assert t.text(width=200).splitlines()[:3] == [
        "what                           bytes  source",
        "------------------  ----------------  " + "-" * len(t.rows[0][2]),
        f"the driver's total  85,520,809,984 B  assumed: NVML's total ({URLS[1]}); a lent card replaces it"]
    assert t.text(width=60).splitlines() == [  # text wraps in its column, the URL is a note
        "what                           bytes  source",
        "------------------  ----------------  ----------------------",
        "the driver's total  85,520,809,984 B  assumed: NVML's total",
        "                                      ([1]); a lent card",
        "                                      replaces it",
        "context              1,073,741,824 B  cited",
        f"[1] {URLS[1]}"]
    assert t.text(width=56).splitlines()[:4] == [  # too narrow for that: a column per row
        "what    the driver's total               context",
        "------  -------------------------------  ---------------",
        "bytes                  85,520,809,984 B  1,073,741,824 B",
        "source  assumed: NVML's total ([1]); a   cited"]
    one = Table(["model", "stage", *((f"category {i}", "size") for i in range(8))],
                [["llama-3-8b", "1 · DDP + ZeroRedundancyOptimizer", *(2**30 * i for i in range(8))]])
    assert one.text(width=100).splitlines()[:5] == [  # a column no wider than its widest cell
        "model       llama-3-8b", "----------  ---------------------------------",
        "stage       1 · DDP + ZeroRedundancyOptimizer", "category 0                                  0",
        "category 1                           1.00 GiB"]
    many = Table(["mode", *((f"column {i}", "B") for i in range(8))], [[f"m{j}", *range(8)] for j in range(9)])
    assert many.text(width=40).splitlines()[:3] == ["mode      m0", "column 0  0 B", "column 1  1 B"]  # a record a row
    assert many.text(width=40).splitlines()[9:11] == ["", "mode      m1"]


def test_markdown_and_json_do_not_change_with_the_terminal(monkeypatch):
    """Pages and results keep their exact text: the URL stays in its cell, whatever the width."""
    t = Table(["what", ("bytes", "B"), ("share", "pct:1")], [[f"naïve × 东京 ({URLS[0]}) | pipe", 3149824, 0.614]])
    md = ("| what | bytes | share |\n|---|---:|---:|\n"
          f"| {escape(f'naïve × 东京 ({URLS[0]}) | pipe')} | 3,149,824 B | 61.4 % |")
    d = {"columns": [["what", "text"], ["bytes", "B"], ["share", "pct:1"]],
         "rows": [[f"naïve × 东京 ({URLS[0]}) | pipe", 3149824, 0.614]], "unit": None, "strong": []}
    for columns in ("40", "100", "300"):
        monkeypatch.setenv("COLUMNS", columns)
        assert t.markdown() == md and t.to_dict() == d and json.dumps(t.to_dict()) == json.dumps(d)
        assert ("[1] " + URLS[0] in t.text()) == (columns != "300")  # a terminal's text moves it when too wide


def test_the_terminal_width_is_columns_capped_and_100_off_a_terminal(monkeypatch):
    from labkit import table

    monkeypatch.setenv("COLUMNS", "80")
    assert table.terminal_width() == 80
    monkeypatch.setenv("COLUMNS", "400")
    assert table.terminal_width() == table.MAX_WIDTH == 120
    monkeypatch.setenv("COLUMNS", "12")
    assert table.terminal_width() == table.MIN_WIDTH
    monkeypatch.delenv("COLUMNS")

    def no_terminal(*args):
        raise OSError("not a terminal")
    monkeypatch.setattr(os, "get_terminal_size", no_terminal)  # a pipe, a file, a test
    assert table.terminal_width() == table.FALLBACK_WIDTH == 100


def test_prose_wraps_at_spaces_keeps_urls_and_words_whole_and_leaves_notes():
    from labkit.table import wrap

    line = "  h100-80gb's driver total: our assumption, " + " ".join(["words"] * 30) + f" ({URLS[0]}); the rest"
    out = wrap(line, 60).splitlines()
    assert all(len(x) <= 60 or len(x.split()) == 1 for x in out)  # a word longer than a line: alone, whole
    assert out[0].startswith("  h100") and all(x.startswith("    ") for x in out[1:])
    assert " ".join(x.strip() for x in out) == line.strip() and any(f"({URLS[0]});" in x for x in out)
    note = f"[12] {URLS[0]}"
    assert wrap(note, 40) == note and wrap("short  spaced", 40) == "short  spaced"
    assert wrap("14.43 MiB  23.47 MiB  32.51 MiB", 20).splitlines() == ["14.43 MiB  23.47 MiB", "  32.51 MiB"]


def test_a_command_line_fits_its_report_to_the_terminal_and_keeps_json_whole(capsys, monkeypatch):
    @dataclass
    class Config(LabConfig):
        words: int = option(60, "words of prose")

    class Result(dict):
        def summary(self):
            return dict(self)

    def report(result):
        print("prose: " + " ".join(["word"] * result["words"]))
        print(Table(["what", "why"], [["x", f"see {URLS[1]} " + "and more " * 20]]).text())
    run = lambda config: Result(words=config.words, why="because " * 40)  # noqa: E731
    monkeypatch.setenv("COLUMNS", "60")
    cli.main(Config, run, report, [], prog="t")
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 60 and lines[0].startswith("prose: word") and lines[-1] == f"[1] {URLS[1]}"
    cli.main(Config, run, report, ["--json"], prog="t")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out)["why"] == "because " * 40


def test_decimate_keeps_every_local_peak():
    values = [0] * 10_000
    values[4321] = 7
    kept = decimate(values, 100)
    assert 4321 in kept and len(kept) <= 102
    assert decimate([1, 2, 3], 100) == [0, 1, 2]


def test_format_bytes():
    assert format_bytes(0) == "0"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(3 * 2**20, unit="KiB") == "3072.00 KiB"


# ---------------------------------------------------------------- toy models
@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(width=48, layers=3, heads=6, vocab=97, seq_len=20)])
def test_gpt_parameter_count_matches_its_formula(cfg):
    assert sum(p.numel() for p in TinyGPT(cfg).parameters()) == gpt_param_count(cfg)


def test_gpt_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(width=10, heads=3)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)


def test_math_and_sdpa_attention_agree():
    torch.manual_seed(0)
    a = TinyGPT(GPTConfig(attention="sdpa")).eval()
    b = TinyGPT(GPTConfig(attention="math")).eval()
    b.load_state_dict(a.state_dict())
    x, y = SyntheticTokens(256, 64).batch(0, 2)
    torch.testing.assert_close(a(x, y)[0], b(x, y)[0], rtol=1e-5, atol=1e-5)


def test_synthetic_tokens_are_deterministic_and_shifted():
    data = SyntheticTokens(vocab=50, seq_len=12, seed=3)
    x1, y1 = data.batch(7, 4)
    x2, y2 = SyntheticTokens(vocab=50, seq_len=12, seed=3).batch(7, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, data.batch(8, 4)[0])
    follows_rule = (data.perm[x1] == y1).float().mean().item()
    assert follows_rule > 0.75  # 10 % of positions restart at a random token


def test_the_synthetic_task_is_learnable():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=32, seq_len=16, width=32, layers=1, heads=2)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = SyntheticTokens(cfg.vocab, cfg.seq_len)
    losses = []
    for step in range(40):
        x, y = data.batch(step, 16)
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ---------------------------------------------------------------- files: all or nothing
def test_a_write_is_all_or_nothing_and_leaves_no_temporary(tmp_path):
    from labkit import files

    target = files.write_text(tmp_path / "r.json", "first\n")
    with pytest.raises(RuntimeError, match="midway"), files.atomic(target, "w") as f:
        f.write("half of a second version")
        raise RuntimeError("killed midway")
    assert target.read_text() == "first\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_write_never_replaces_a_device_a_pipe_or_a_folder(tmp_path):
    import os

    from labkit import files

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (fifo, tmp_path, Path("/dev/null")):
        with pytest.raises(UsageError, match="not a regular file"):
            files.write_text(target, "x")
    assert fifo.is_fifo() and Path("/dev/null").is_char_device()


def test_a_temporary_left_by_a_dead_writer_is_removed_at_the_next_write(tmp_path, capsys):
    from labkit import files

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".ckpt.pt.{dead.stdout.strip()}.abcd1234.tmp"
    stale.write_bytes(b"x" * 100)
    mine = tmp_path / f".ckpt.pt.{__import__('os').getpid()}.live0000.tmp"  # a live writer's: kept
    mine.write_bytes(b"y")
    files.write_bytes(tmp_path / "ckpt.pt", b"data")
    assert not stale.exists() and mine.exists() and "left by an interrupted write" in capsys.readouterr().err


def _full_filesystem(tmp_path):
    """A 64 KiB tmpfs where the machine allows mounting one, else None."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    return mount if proc.returncode == 0 else None


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno
    import os

    from labkit import files

    mount = _full_filesystem(tmp_path)
    try:
        if mount is None:  # no mount here: the same error, injected where the data reaches the disk
            mount = tmp_path
            monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
        with pytest.raises(UsageError, match="the disk is full"):
            files.write_bytes(mount / "big.bin", b"\0" * (1 << 20))
        if mount != tmp_path:  # torch.save hides the OSError ("enforce fail at inline_container.cc")
            with pytest.raises(UsageError, match="the disk is full"):
                files.save_checked({"w": torch.zeros(1 << 20)}, mount / "c.pt")
        assert not [p for p in mount.iterdir() if p.name != "lost+found"]
    finally:
        if mount != tmp_path:
            subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("target, fragment", [
    (lambda tmp: tmp, "is a directory"), (lambda tmp: tmp / "a-file" / "x.json", "is a file, not a folder"),
    (lambda tmp: Path("/dev/null"), "not a regular file"), (lambda tmp: "", "empty"),
])
def test_unusable_output_paths_are_refused_before_the_work(tmp_path, target, fragment):
    from labkit import files

    (tmp_path / "a-file").write_text("a file")
    with pytest.raises(UsageError, match=fragment):
        files.check_writable(target(tmp_path), "--out")


# ---------------------------------------------------------------- distributed runs that end
FROZEN = """
import os, signal, time, torch, torch.distributed as tdist
from labkit import dist
with dist.joined("cpu", "gloo", timeout_s=2):
    if tdist.get_rank() == 1:
        time.sleep(600)  # a rank that hangs before the collective (a deadlock, a stuck loader)
    tdist.all_reduce(torch.ones(1))
"""

SLEEPER = """
import time
from labkit import dist
with dist.joined("cpu", "gloo"):
    print("joined", flush=True)
    time.sleep(120)
"""


def _torchrun(tmp_path, code: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(code)
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.Popen([str(torchrun), "--nproc_per_node=2", str(script)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _ranks_left(tmp_path) -> list[str]:
    out = subprocess.run(["pgrep", "-f", str(tmp_path / "rank.py")], capture_output=True, text=True).stdout
    return out.split()


def test_a_frozen_rank_ends_the_job_instead_of_hanging_for_30_minutes(tmp_path):
    proc = _torchrun(tmp_path, FROZEN)
    # rank 0's collective gives up after timeout_s=2 and torchrun stops the hung rank; gloo's default
    # would wait 30 minutes, and the wait below would raise TimeoutExpired (a rank stopped by SIGSTOP,
    # which ignores torchrun's SIGTERM, is labkit.dist's StoppedRankWatch's case: test_hostile.py)
    proc.wait(timeout=120)
    assert proc.returncode != 0 and not _ranks_left(tmp_path)


def test_killing_the_launcher_leaves_no_orphan_ranks(tmp_path):
    import signal
    import time

    proc = _torchrun(tmp_path, SLEEPER)
    while not proc.stdout.readline().startswith("joined"):  # torchrun's own warnings come first
        assert proc.poll() is None, "the ranks ended before they joined"
    os.killpg(proc.pid, 0)  # the launcher is alive; now kill it alone, as an OOM killer would
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.perf_counter() + 10
    while _ranks_left(tmp_path) and time.perf_counter() < deadline:
        time.sleep(0.2)
    assert not _ranks_left(tmp_path)


KILLED = """
import os, signal, time
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)  # a rank the OOM killer took
time.sleep(600)  # far past _start_ranks' 60 s: only a job that stops its other ranks ends in time
"""

REFUSED = """
import os, sys
if os.environ["RANK"] == "0":
    print("job: error: --steps must be 1 or more, got 0", file=sys.stderr)
sys.exit(2)
"""


def _start_ranks(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(code)
    start = "import sys; from labkit import dist; sys.exit(dist.start_ranks(sys.argv[1], [], 2, prog='job'))"
    return subprocess.run([sys.executable, "-c", start, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


def test_started_ranks_a_killed_rank_ends_the_job_in_one_line(tmp_path):
    """A plain ``python`` run that started its ranks (Labs 10, 11): a rank killed mid-run stops the
    others at once, and the job ends with one line naming it, exit 1, no launcher report."""
    proc = _start_ranks(tmp_path, KILLED)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["job: error: rank 1 was killed by SIGKILL; the other ranks were stopped"]
    assert not _ranks_left(tmp_path)


def test_started_ranks_bad_input_is_rank_0s_line_and_exit_2(tmp_path):
    proc = _start_ranks(tmp_path, REFUSED)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["job: error: --steps must be 1 or more, got 0"]


STOPS_READING = """
import os, sys
from dataclasses import dataclass
from labkit import cli
from labkit.config import LabConfig

@dataclass
class Job(LabConfig):
    \"\"\"A job whose summary is long.\"\"\"

if os.environ.get("RANK") == "0":  # a started rank 0 whose reader has already gone
    r, w = os.pipe()
    os.close(r)
    os.dup2(w, 1)
if os.environ.get("RANK", "0") == "0":
    cli.main(Job, lambda config: {"numbers": list(range(200_000))}, None, ["--json"], prog="job")
"""


def test_a_reader_that_stops_reading_is_no_error(tmp_path):
    """`lab --json | head -c 0`: the reader closes the pipe before the summary is written. The run
    was fine: no traceback, no line, exit 141 (a shell's SIGPIPE), in one process and when rank 0
    of started ranks meets it (the launcher stays silent too)."""
    script = tmp_path / "lab.py"
    script.write_text(STOPS_READING)
    one = subprocess.run(["bash", "-c", f'"{sys.executable}" {script} | head -c 0; exit ${{PIPESTATUS[0]}}'],
                         capture_output=True, text=True, timeout=60)
    assert (one.returncode, one.stderr) == (cli.STOPPED_READING, "")
    proc = _start_ranks(tmp_path, STOPS_READING)
    assert (proc.returncode, proc.stderr) == (cli.STOPPED_READING, "")


def test_progress_bar_is_silent_off_a_terminal(monkeypatch):
    """A notebook's or a log's stderr is no terminal: no bar in it, however long the loop; a
    terminal's gets one."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(cli, "_quiet", False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress(range(3), total=3).disable
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert not progress(range(3), total=3).disable
