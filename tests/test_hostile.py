"""Hostile input, round three (issue 31): the classes a test generated from each ``Config`` cannot reach.

``test_cli_contract.py`` generates the flag values (long paths, special files, values near 2**63,
Unicode digits, subnormal floats, zoo names, hostile ``config.json`` contents). This module runs
what needs more than a ``Config``: every zoo model a lab accepts, run; hostile trace files; every
field of a Lab 02 checkpoint edited; Ctrl-C inside a save; a full disk (a small tmpfs, when this
process may mount one); a stopped rank; Markdown in results, in a browser. Each case must end in one
line and the right exit code, inside its time limit, with nothing half-written.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from conftest import CODE, ROOT, load_lab
from test_cli_contract import MODEL_LABS, load

from labkit import cli, files, zoo
from labkit.config import UsageError


def _main(module, argv: list[str], prog: str = "lab") -> tuple[int, list[str], str]:
    """``cli.main`` of ``module`` in this process: (exit code, stderr lines, stdout)."""
    err, out = io.StringIO(), io.StringIO()
    code = 0
    try:
        with redirect_stderr(err), redirect_stdout(out):
            cli.main(module.Config, module.run, getattr(module, "report", None), argv, prog=prog)
    except SystemExit as exc:
        code = exc.code
    return code, [line for line in err.getvalue().splitlines() if line.strip()], out.getvalue()


def _one_line(code: int, lines: list[str], expected_code: int = 2) -> None:
    assert code == expected_code and len(lines) == 1 and "Traceback" not in lines[0], (code, lines)


# ---------------------------------------------------------------------- every zoo model a lab accepts, run
#: the shortest run of each lab with a --model flag
QUICK = {
    "train_single_gpu": ["--steps", "1", "--batch-size", "1", "--seq-len", "16"],
    "mixed_precision": ["--steps", "1", "--ledger-steps", "1", "--batch-size", "1", "--seq-len", "16", "--recipe", "bf16"],
    "checkpointing": ["--steps", "1", "--batch-size", "1", "--seq-len", "16", "--strategy", "full"],
    "attention": ["--seq-lens", "16", "--impl", "sdpa"],
    "grad_accumulation": ["--steps", "1", "--batch", "2", "--micro-batch", "1", "--seq-len", "16"],
    "optimizer_offload": ["--steps", "1", "--batch-size", "1", "--seq-len", "16", "--offload", "optimizer"],
    "offload": ["--steps", "1", "--repeats", "1", "--mode", "layerwise"],
    "activation_offload": ["--steps", "1", "--batch-size", "1", "--seq-len", "16", "--mode", "streamed"],
    "train_ddp": ["--world-size", "2", "--steps", "2", "--batch-size", "1", "--seq-len", "16"],
    "zero_fsdp": ["--world-size", "2", "--steps", "1", "--batch-size", "1", "--seq-len", "16", "--stage", "3"],
    "memory_debugging": ["--steps", "2", "--batch-size", "1", "--seq-len", "16", "--scenario", "fixed"],
    "fit": ["--seq", "16", "--batch", "1"],
    "serve_memory": ["--requests", "2"],
    "caching_allocator": ["--workload", "step", "--seq", "16", "--batch", "1"],
}


@pytest.mark.parametrize("path", [pytest.param(p, id=f"{p.parent.name}/{p.stem}") for p in MODEL_LABS])
def test_every_small_zoo_model_a_lab_accepts_runs(path, one_rank):
    """Each toy-size zoo model (one per family) the lab's Config accepts runs to the end, real and
    traced (``--fake``), or is refused in one line: none crashes inside the step (issue 31: small-flux
    crashed nine labs). Real-size names are the same code at another size (their Config is held by
    test_cli_contract's zoo test)."""
    module = load(path)
    fakes = ([], ["--fake"]) if "fake" in module.Config.__dataclass_fields__ else ([],)
    ran = 0
    for name in [n for n in zoo.names() if n.startswith("small-")]:
        for fake in fakes:
            code, lines, _ = _main(module, ["--device", "cpu", "--model", name, *QUICK[path.stem], *fake], path.name)
            assert code == 0 or (code == 2 and len(lines) == 1), (name, fake, code, lines[-3:])
            ran += code == 0
    assert ran, f"{path.name} ran no zoo model"


def test_lab_13_answers_a_million_micro_batches_at_once():
    """The trace runs two micro-batches (the second is the steady state), whatever --accumulation says:
    the calculator's answer, not a loop of a million traced steps."""
    fit = load_lab(13)
    one, _, out = _main(fit, ["--model", "small-llama", "--seq", "16", "--accumulation", "2", "--json"])
    many, _, out_many = _main(fit, ["--model", "small-llama", "--seq", "16", "--accumulation", "1000000", "--json"])
    assert one == many == 0
    for key in ("per_rank_peak_bytes", "by_category"):
        assert json.loads(out)[key] == json.loads(out_many)[key]


# ---------------------------------------------------------------------- Lab 14's trace files
def _trace_line(**entry) -> str:
    return json.dumps({"arrival": 0, "prompt_len": 8, "output_len": 4} | entry, ensure_ascii=False)


HOSTILE_TRACES = {
    "nested.jsonl": "[" * 100_000 + "]" * 100_000 + "\n",
    "nested-field.jsonl": _trace_line()[:-1] + ', "prefix": ' + "[" * 50 + "]" * 50 + "}\n",
    "digits.jsonl": '{"arrival": 0, "prompt_len": ' + "9" * 5000 + ', "output_len": 4}\n',
    "huge-float.jsonl": '{"arrival": 1e999, "prompt_len": 8, "output_len": 4}\n',
    "nan.jsonl": '{"arrival": NaN, "prompt_len": 8, "output_len": 4}\n',
    "bool-length.jsonl": _trace_line(prompt_len=True) + "\n",
    "float-length.jsonl": _trace_line(output_len=4.5) + "\n",
    "negative.jsonl": _trace_line(arrival=-1) + "\n",
    "not-an-object.jsonl": "[1, 2, 3]\n",
    "unknown-field.jsonl": _trace_line(priority=1) + "\n",
    "long-prefix.jsonl": _trace_line(prefix="p" * 10_000, prefix_len=2) + "\n",
    "not-utf8.jsonl": b"\xff\xfe\x00{",
    "empty.jsonl": "",
    "no-json.jsonl": "arrival=0\n",
}


def test_hostile_trace_files_are_one_line(tmp_path):
    """Every hostile trace content, and the special files (a FIFO would block the read, /dev/zero never
    ends), and a file past the size cap (sparse: nothing is written), refused in one line; a read
    that hung would stop this test, so the FIFO case also runs in a subprocess with a time limit."""
    serve = load_lab(14)
    for name, content in HOSTILE_TRACES.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(serve.serving_trace.TRACE_BYTES + 1)
    os.mkfifo(tmp_path / "fifo")
    cases = [*(tmp_path / n for n in HOSTILE_TRACES), big, tmp_path / "fifo", Path("/dev/zero"), Path("/dev/urandom")]
    for trace in cases:
        code, lines, _ = _main(serve, ["--trace", str(trace)])
        _one_line(code, lines)
        assert "--trace" in lines[0], lines
    proc = subprocess.run([sys.executable, str(CODE / "lab-14-serving-memory" / "serve_memory.py"), "--trace",
                           str(tmp_path / "fifo")], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(CODE)))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_trace_line_with_u2028_inside_a_string_is_one_request(tmp_path):
    """U+2028 (LINE SEPARATOR) is text inside a JSON string; ``str.splitlines`` would break the line
    there and refuse a valid trace. Split on newlines alone."""
    serve = load_lab(14)
    trace = tmp_path / "t.jsonl"
    trace.write_text(_trace_line(prefix="system\u2028prompt", prefix_len=2) + "\n" + _trace_line(arrival=1) + "\n",
                     encoding="utf-8")
    requests = serve.serving_trace.read(trace)
    assert [r.prefix for r in requests] == ["system\u2028prompt", None]
    code, lines, _ = _main(serve, ["--trace", str(trace), "--json"])
    assert code == 0, lines


# ---------------------------------------------------------------------- Lab 02's checkpoint, field by field
SIZE = ["--device", "cpu", "--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--vocab", "64",
        "--batch-size", "4"]


def _nodes(obj, path=()):
    """Every (path, value) of a checkpoint's state, containers and leaves."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _nodes(v, (*path, i))


def _mutations(value) -> list[tuple[str, object]]:
    """What a tool that writes a wrong checkpoint could put in place of ``value``: another type, a
    value out of range, another shape or dtype, a key less or more. Tensor values are not changed:
    a checkpoint of other weights is a valid checkpoint (the hash is for damage, not for intent)."""
    if isinstance(value, torch.Tensor):
        return [("a string", "x"), ("another dtype", value.to(torch.float64 if value.is_floating_point() else
                                                              torch.int64)),
                ("another shape", torch.zeros(*value.shape, 2)), ("None", None)]
    if isinstance(value, bool):
        return [("flipped", not value), ("a string", str(value).lower())]
    if isinstance(value, int):
        return [("+1", value + 1), ("-1", -1), ("2**63", 2**63), ("a float", float(value)), ("a string", str(value))]
    if isinstance(value, float):
        return [("0.5", 0.5 if value != 0.5 else 0.25), ("nan", math.nan), ("inf", math.inf), ("negative", -value - 1),
                ("a string", str(value))]
    if isinstance(value, str):
        return [("other text", value + "x"), ("a number", 3)]
    if value is None:
        return [("a number", 0), ("a string", "none")]
    if isinstance(value, dict):
        return [("empty", {}), ("a string", "x"), ("an extra key", {**value, "extra": 1})]
    if isinstance(value, (list, tuple)):
        return [("empty", type(value)()), ("a string", "x"), ("another container", list(value) if isinstance(value, tuple)
                                                               else tuple(value)), ("one more", [*value, 0])]
    return [("a string", "x")]


def _edit(state: dict, path: tuple, new) -> dict:
    import copy

    out = copy.deepcopy(state)
    if not path:
        return new
    holder = out
    for key in path[:-1]:
        holder = holder[key]
    if isinstance(holder, tuple):  # betas: rebuild the tuple in its parent
        parent = out
        for key in path[:-2]:
            parent = parent[key]
        items = list(holder)
        items[path[-1]] = new
        parent[path[-2]] = tuple(items)
    else:
        holder[path[-1]] = new
    return out


#: every (field, mutation) of a checkpoint runs, but those repeated once per parameter (its weights, its
#: AdamW state, its id in a group: about 700 of 840) are drawn by this seed: the same checks meet each one
SEED, SAMPLED = 31, 40


def test_every_field_of_a_checkpoint_is_checked(lab02, tmp_path):
    """Each field of a real Lab 02 checkpoint, replaced (and the content hashes made anew, as a tool
    that writes a wrong checkpoint would): the resume refuses it in one line, exit 2, before training,
    or (a change that changes nothing) resumes to the same losses. Issue 31's cases are among them:
    amsgrad switched on, the optimizer entry a string, an lr of 0.5 under settings of 0.003, step 999."""
    ckpt = tmp_path / "c.pt"
    code, lines, _ = _main(lab02, [*SIZE, "--steps", "2", "--checkpoint", str(ckpt)])
    assert code == 0, lines
    state = files.load_checked(ckpt)
    code, _, out = _main(lab02, [*SIZE, "--steps", "1", "--checkpoint", str(ckpt), "--resume", "--json"])
    expected = json.loads(out)["losses"]
    cases = [(path, label, new) for path, value in _nodes(state) for label, new in _mutations(value)]
    repeated = [c for c in cases if c[0][:1] == ("model",) or c[0][:2] == ("optimizer", "state") or "params" in c[0]]
    chosen = [c for c in cases if c not in repeated] + random.Random(SEED).sample(repeated, SAMPLED)
    edited = tmp_path / "edited.pt"
    wrong, refused = [], 0
    for path, label, new in chosen:
        files.save_checked(_edit(state, path, new), edited)
        code, lines, out = _main(lab02, [*SIZE, "--steps", "1", "--checkpoint", str(edited), "--resume", "--json"])
        if code == 2 and len(lines) == 1 and "Traceback" not in lines[0]:
            refused += 1
        elif not (code == 0 and json.loads(out)["losses"] == expected):
            wrong.append(("/".join(map(str, path)), label, code, lines[-2:]))
    assert not wrong, f"{len(wrong)} of {len(chosen)} edits neither refused nor harmless: {wrong[:4]}"
    assert refused >= 0.9 * len(chosen), (refused, len(chosen))
    print(f"checkpoint: {len(chosen)} of {len(cases)} edits run (seed {SEED}), {refused} refused")


def _value(state, path):
    for key in path:
        state = state[key]
    return state


# ---------------------------------------------------------------------- Ctrl-C inside a save
class _InterruptedWriter:
    """A file whose ``k``-th write delivers SIGINT to this process first: Ctrl-C arriving while
    torch.save writes, as a user's would."""

    def __init__(self, f, k: int) -> None:
        self.f, self.k, self.writes = f, k, 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == self.k:
            signal.raise_signal(signal.SIGINT)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def test_ctrl_c_inside_the_write_leaves_the_checkpoint_of_that_step(lab02, tmp_path, monkeypatch):
    """Ctrl-C lands inside torch.save's write of step 2's checkpoint (``--save-every 1``): the write
    finishes, the file is in place, then the run stops: exit 130, the line that says which step was
    written, no temporary left, and a resume continues exactly (was: two tracebacks, exit 1, no file)."""
    full = json.loads(_main(lab02, [*SIZE, "--steps", "4", "--json"])[2])["losses"]
    ckpt, real_save, saves = tmp_path / "c.pt", torch.save, []

    def save(obj, f, *args, **kwargs):
        saves.append(1)
        target = _InterruptedWriter(f, 3) if len(saves) == 2 else f
        return real_save(obj, target, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code, lines, _ = _main(lab02, [*SIZE, "--steps", "4", "--save-every", "1", "--checkpoint", str(ckpt)])
    monkeypatch.setattr(torch, "save", real_save)
    assert code == 130 and "Traceback" not in "\n".join(lines), lines
    assert any("checkpoint written at step 2" in line for line in lines), lines
    assert files.load_checked(ckpt)["step"] == 2 and [p.name for p in tmp_path.iterdir()] == ["c.pt"]
    code, _, out = _main(lab02, [*SIZE, "--steps", "2", "--checkpoint", str(ckpt), "--resume", "--json"])
    assert code == 0 and json.loads(out)["losses"] == full[2:]


def test_an_interrupt_is_held_until_an_atomic_write_is_whole(tmp_path):
    target = files.write_text(tmp_path / "f.txt", "old\n")
    with pytest.raises(KeyboardInterrupt), files.atomic(target, "w") as f:
        f.write("new, ")
        signal.raise_signal(signal.SIGINT)
        f.write("and whole\n")
    assert target.read_text() == "new, and whole\n" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


# ---------------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path):
    """A mount of a small tmpfs (size given by the test: ``small_disk(bytes)``); skipped where this
    process may not mount (not root). Unmounted at the end."""
    mounts = []

    def make(size: int) -> Path:
        mount = tmp_path / f"disk{len(mounts)}"
        mount.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()[:80]})")
        mounts.append(mount)
        return mount

    yield make
    for mount in mounts:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_checkpoint_larger_than_the_disk_is_one_line_before_training_and_after(lab02, small_disk, monkeypatch):
    """A disk smaller than the checkpoint's floor (weights and two moments): refused before the first
    step. A disk above that floor but below the file: the write fails mid-run, and says the disk, the
    bytes free and the bytes needed; no partial file either way (was: two tracebacks, exit 1)."""
    trained = []
    real_step = lab02.train_step
    monkeypatch.setattr(lab02, "train_step", lambda *a, **k: trained.append(1) or real_step(*a, **k))
    tiny = small_disk(64 << 10)
    code, lines, _ = _main(lab02, [*SIZE, "--steps", "1", "--checkpoint", str(tiny / "c.pt")])
    _one_line(code, lines)
    assert "the disk is full" in lines[0] and str(tiny) in lines[0] and "needs" in lines[0] and not trained
    assert not list(tiny.iterdir())
    params = sum(p.nbytes for p in lab02.TinyGPT(lab02.Config(
        **{"width": 32, "layers": 2, "heads": 2, "seq_len": 16, "vocab": 64}).model_config()).parameters())
    floor = 3 * params
    near = small_disk((floor // 4096 + 1) * 4096)  # the floor fits, the whole file (RNG state, archive) does not
    code, lines, _ = _main(lab02, [*SIZE, "--steps", "1", "--checkpoint", str(near / "c.pt")])
    _one_line(code, lines)
    assert "the disk is full" in lines[0] and str(near) in lines[0] and "needs" in lines[0] and trained
    assert not list(near.iterdir())


def test_a_full_disk_under_a_rank_is_one_line_for_the_job(small_disk, tmp_path):
    """Lab 10, ranks started by the lab: room for one rank's ledger on --ledger-dir. The rank that
    cannot write says so, through the launcher: one line with the disk, exit 2, no gloo traceback
    from the rank that lost it, no temporary left (was: rank 0's traceback, rank 1's line hidden)."""
    disk = small_disk(192 << 10)  # one ledger is about 130 KB
    proc = subprocess.run([sys.executable, str(CODE / "lab-10-ddp" / "train_ddp.py"), "--device", "cpu",
                           "--no-reference", "--ledger-dir", str(disk)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(CODE)))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "the disk is full" in lines[0] and str(disk) in lines[0], \
        proc.stderr[-2000:]
    assert all(p.name.startswith("rank") and not p.name.endswith(".tmp") for p in disk.iterdir())


NOTEBOOK = """# %%
{body}
"""


@pytest.mark.parametrize(("body", "timeout", "fragment"), [
    ("from labkit import files\nfiles.write_bytes({disk!r} + '/big.bin', b'x' * (1 << 20))", 120, "the disk is full"),
    ("import time\ntime.sleep(60)", 3, "ran past --timeout 3 s"),
])
def test_a_notebook_that_fails_is_one_line_exit_1(body, timeout, fragment, small_disk, tmp_path, monkeypatch):
    """scripts/run_notebooks.py on a full disk (the notebook's write), and a cell past --timeout: one
    line naming the notebook, the cell and why, exit 1, no executed notebook written (was: a 77-line
    CellExecutionError, a 76-line traceback)."""
    import importlib.util

    if "run_notebooks_hostile" not in sys.modules:
        spec = importlib.util.spec_from_file_location("run_notebooks_hostile", ROOT / "scripts" / "run_notebooks.py")
        sys.modules["run_notebooks_hostile"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["run_notebooks_hostile"])
    runner = sys.modules["run_notebooks_hostile"]
    src = tmp_path / "src"
    src.mkdir()
    disk = small_disk(64 << 10)
    (src / "demo.py").write_text(NOTEBOOK.format(body=body.format(disk=str(disk))))
    monkeypatch.setattr(runner, "SRC", src)
    monkeypatch.setattr(runner, "code_hash", lambda path: "demo")  # a source outside the repository
    out = tmp_path / "out"
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exc:
        cli.main(runner.Config, runner.run, lambda done: None, ["--device", "cpu", "--timeout", str(timeout),
                                                                "--output-dir", str(out), "demo"], prog="run_notebooks.py")
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert exc.value.code == 1 and len(lines) == 1 and fragment in lines[0] and "demo: cell 1" in lines[0], lines
    assert not list(out.glob("*.ipynb")) and not list(disk.iterdir())


# ---------------------------------------------------------------------- a stopped rank
def _children_of(pid: int) -> dict[int, str]:
    """pid -> RANK of the processes whose parent is ``pid``."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            if stat[1] == str(pid):
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
                out[int(name)] = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), "?")
        except (OSError, IndexError):
            continue
    return out


@pytest.mark.parametrize("script, argv", [
    ("lab-10-ddp/train_ddp.py", ["--steps", "2000", "--no-reference"]),
    ("lab-11-zero-fsdp/zero_fsdp.py", ["--steps", "2000", "--stage", "3"]),
    ("lab-11-zero-fsdp/fsdp_inference.py", ["--steps", "2000"]),
])
def test_a_stopped_rank_ends_the_job_in_seconds_in_one_line(script, argv, tmp_path):
    """SIGSTOP to rank 1 of a job the lab started itself: the others would wait a minute for it in a
    collective, then 30 s more for it to stop (92 s, 22-101 lines). The launcher sees it stopped and
    ends the job within 15 s of the stop, one line naming rank 1, exit 1, no rank left behind."""
    proc = subprocess.Popen([sys.executable, str(CODE / script), "--device", "cpu", *argv], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(CODE)))
    ranks: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while "1" not in _children_of(proc.pid).values():
            assert proc.poll() is None and time.monotonic() < deadline, "rank 1 never started"
            time.sleep(0.1)
        time.sleep(1.0)
        ranks = _children_of(proc.pid)
        os.kill(next(pid for pid, rank in ranks.items() if rank == "1"), signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:  # the job hung: leave nothing behind (a stopped rank ignores SIGTERM)
            for pid in [*ranks, proc.pid]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "rank 1 was stopped" in lines[0], stderr[-2000:]
    assert took < 15, took
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)  # a rank the launcher killed may take a moment to be reaped
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]


# ---------------------------------------------------------------------- Markdown in results
HOSTILE_MARKDOWN = [
    "[x](javascript:alert(3))", "![p](http://evil.example/y.png)", "<http://evil.example/>",
    "[ref][1]\n\n[1]: http://evil.example/", "x{: onclick=\"alert(4)\" }", "*em* __strong__ `code`",
    "==mark== ++ctrl+alt++", ":smile:", "[^note]", "&lt;b&gt; &amp;", "a | b", "\\[escaped\\](x)",
    "<img src=http://evil.example/z.png>", "![](//evil.example/w.png)",
]


def _hostile_page(tmp_path) -> str:
    """A lab page whose results carry Markdown in every place a value reaches: a table cell, a column
    name, a number's name, the provenance (the badge's device name); rendered by the site's hooks."""
    from test_site import hooks_on

    hooks = hooks_on(tmp_path)
    hooks.ROOT = tmp_path
    hooks.results.cache_clear()
    folder = tmp_path / "results" / "lab-02-single-gpu-training"
    folder.mkdir(parents=True)
    prov = {"device_type": "cpu", "device_name": HOSTILE_MARKDOWN[1], "torch_version": HOSTILE_MARKDOWN[0],
            "python_version": "3.11", "git_commit": HOSTILE_MARKDOWN[4], "source_hash": "x", "labkit_hash": "y",
            "date_utc": "2026-11-24"}
    table = {"columns": [[HOSTILE_MARKDOWN[0], "text"], ["bytes", "B"]], "unit": None, "strong": [],
             "rows": [[m, i] for i, m in enumerate(HOSTILE_MARKDOWN)]}
    numbers = {f"n{i}": m for i, m in enumerate(HOSTILE_MARKDOWN)}
    (folder / "summary.json").write_text(json.dumps({"provenance": prov, "numbers": numbers, "tables": {"t": table},
                                                     "figures": []}))
    page = " ".join(f"{{{{ lab-02:n{i} }}}}." for i in range(len(HOSTILE_MARKDOWN)))
    page += "\n\n<!-- infralab:provenance lab-02 -->\n\n<!-- infralab:table lab-02 t -->\n"

    class Page:
        meta = {}
        file = type("F", (), {"src_uri": "labs/demo.md"})()

    markdown = hooks.on_page_markdown(page, Page(), {"extra": {}}, None)
    hooks.results.cache_clear()
    return markdown


def _site_markdown():
    """Python-Markdown with the site's extensions and their settings (mkdocs.yml)."""
    import markdown
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    return markdown.Markdown(extensions=config["markdown_extensions"], extension_configs=config["mdx_configs"])


def test_markdown_in_results_is_text_on_the_page(tmp_path):
    """Each hostile value reaches the built HTML as the text it is: no link, no image, no attribute, no
    emphasis, no emoji; the page's text holds every value verbatim."""
    import html as html_lib
    import re

    body = _site_markdown().convert(_hostile_page(tmp_path))
    markup = " ".join(re.findall(r"<[^>]+>", body))
    assert not re.search(r"<(img|script|svg|iframe)\b", markup), markup
    assert not re.search(r"\son\w+\s*=|javascript:|evil\.example", markup), markup  # in no tag, no attribute
    text = html_lib.unescape(re.sub(r"<[^>]+>", "", body))
    for value in HOSTILE_MARKDOWN:
        shown = value.replace("\n", " ")
        assert shown in text, shown


@pytest.mark.browser
def test_markdown_in_results_makes_no_request_and_no_link_in_a_browser(tmp_path):
    """The same page in Chromium: loading it requests nothing outside loopback, it holds no link and no
    image, and each value reads as the text it was published as."""
    import functools
    import threading
    from http.server import ThreadingHTTPServer

    from test_browser import ARGS, CHROMIUM, QuietHandler, Watch, _missing

    if not CHROMIUM:
        _missing("Debian's chromium is not installed")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed")
    site = tmp_path / "site"
    site.mkdir()
    body = _site_markdown().convert(_hostile_page(tmp_path))
    (site / "index.html").write_text(f"<!doctype html><meta charset=utf-8><title>t</title><body>{body}</body>",
                                     encoding="utf-8")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            page = browser.new_page()
            watch = Watch(page)
            page.goto(f"http://127.0.0.1:{httpd.server_address[1]}/", wait_until="load")
            page.wait_for_timeout(200)
            links = page.locator("a[href^='javascript'], a[href*='evil.example']").count()
            images = page.locator("img, svg").count()
            text = page.inner_text("body")
            browser.close()
    finally:
        httpd.shutdown()
    assert not watch.outside and not watch.errors and links == 0 and images == 0, (watch.outside, watch.errors)
    for value in HOSTILE_MARKDOWN:
        assert value.replace("\n", " ") in text.replace("\n", " ").replace("\t", " ") or value.split()[0] in text, value


# ---------------------------------------------------------------------- what every writer shares
def test_a_full_disk_message_names_the_mount_and_the_bytes(small_disk):
    disk = small_disk(64 << 10)
    with pytest.raises(UsageError) as info:
        files.save_checked({"w": torch.zeros(1 << 16)}, disk / "c.pt")
    assert f"the file system at {disk}" in str(info.value) and "needs 256.00 KiB" in str(info.value)
    with pytest.raises(UsageError) as info, files.atomic(disk / "x.bin") as f:  # no size known: what it wrote
        for _ in range(32):
            f.write(b"\0" * 4096)
    assert f"the file system at {disk}" in str(info.value) and "needs more than" in str(info.value)
    assert not list(disk.iterdir())
