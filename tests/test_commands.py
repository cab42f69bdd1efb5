"""Every command a reader is shown works as written.

Two tests. Each lab page's "Run it" CPU command (its front matter's ``run_cpu``) runs verbatim by
bash from the repository root with a clean PATH (no virtual environment activated) and exits 0.
How long it takes is a benchmark, not a test: ``bench/lab_runs_bench.py`` times every lab's
command, and the performance page shows it. And every command in a fenced code block of the pages
(``docs/**/*.md``), the README, the labs' READMEs and ``bench/README.md`` runs the same way: a
block that shows a command runs whole, every line of it in order in one bash (a ``printf`` that
writes the file the next command reads included), so that ``--checkpoint`` then ``--resume``, or a
file one command writes and the next reads, work as a reader would type them. A command exits 0, or
the code its comment states (``# exit 2``: a refusal the page shows on purpose).

A path under ``/tmp/`` in a command is a reader's scratch file: here it lands in the test's own
temporary directory, so that no run depends on a file an earlier one left behind.

Commands are deduplicated (the same command on a page and in a README runs once, and one equal to
a page's ``run_cpu`` is left to the first test). What does not run here is in ``SKIP`` with its
reason: ``--device cuda`` commands run only under ``pytest -m cuda`` on a GPU machine, commands that
rewrite committed results run with an output folder in a temporary directory where their command
line has one (``OUT_FLAGS``) and are skipped where it has none, and a command whose measured time is
over ``SLOW_S`` is skipped here with its time stated (``INFRALAB_ALL_COMMANDS=1`` runs those too).

A lab's command prints for a terminal: every line it prints (bar ``--json``'s one line) fits
``WIDTH`` columns, the width a pipe gets (``labkit.table.terminal_width``), checked on the output
of every command these tests run.

The wall time of each block is printed (``pytest -s`` shows it).

Start-up: a shown ``.venv/bin/python script.py ...`` line runs in a fork of one interpreter that has
already imported torch (``tests/prewarmed.py``: the same script as ``__main__``, argv, working
directory, environment, streams and exit code), which spares each of about 150 commands a second or
two of importing torch. The pages' own commands (the first test) run in a truly fresh interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, load_bench
from labkit.table import FALLBACK_WIDTH, width_of

LAB_RUNS = load_bench("lab_runs_bench")

LAB_PAGES = sorted((ROOT / "docs" / "labs").glob("lab-*.md"))
SHOWN_IN = ["docs/**/*.md", "README.md", "code/*/README.md", "bench/README.md"]
COMMAND = re.compile(r"^(?:\$ )?(?:\.venv/bin/(?:python|torchrun)|\./scripts/|scripts/gpu_campaign)\b")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}  # a block in one of these that shows a command runs whole
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
EXPECT = re.compile(r"#\s*exit (\d+)\s*$")
SLOW_S = 20.0  # a command measured slower than this is in SLOW below, its time stated
ALL = os.environ.get("INFRALAB_ALL_COMMANDS") == "1"
WIDTH = FALLBACK_WIDTH  # columns: what a lab prints through a pipe fits a 100-column terminal

# A command that writes committed results gets this flag (pointing into the test's temporary
# directory) when its command line has one; otherwise it is in SKIP.
OUT_FLAGS = {"bench/cpu_adam_bench.py": "--out {tmp}/cpu_adam_bench.json",
             "lab-08-offload-memory-saving/make_plan.py": "--out {tmp}/offload_plan.md",
             "scripts/run_notebooks.py": "--output-dir {tmp}/nb --results-dir {tmp}/results"}

# Skipped commands, each by a fragment of its text and the reason (checked: every entry matches).
SKIP = {
    "./scripts/serve": "serves the site until stopped (tests/test_site.py builds it)",
    "./scripts/test": "runs this whole suite (it would run itself)",
    "scripts/run_notebooks.py --device cpu": "executes all 16 notebooks, many minutes (tests/test_notebooks.py does)",
    "bench/offload_bench.py": "a GPU benchmark writing results/offload_bench.json, with no --out (gpu_campaign runs it)",
}
# Commands that need a CUDA GPU though their line names no --device: they run under `pytest -m cuda`.
CUDA_ONLY = {"cuda_scenarios.py --experiment": "caps CUDA's caching allocator (refuses a CPU: exit 2)"}

# Over SLOW_S: seconds of wall time, measured here (2 shared cores, other jobs running), each alone
# in a fresh shell; run them with INFRALAB_ALL_COMMANDS=1 (all passed when measured).
_PY = ".venv/bin/python code/"
SLOW: dict[str, float] = {
    _PY + "lab-04-activation-checkpointing/checkpointing.py --model llama-3-8b --fake --dtype bfloat16 "
          "--seq-len 8192 --batch-size 1": 65,
    _PY + "lab-04-activation-checkpointing/checkpointing.py --model llama-3-8b --fake --dtype bfloat16 "
          "--seq-len 32768 --batch-size 1": 80,
    _PY + "lab-04-activation-checkpointing/checkpointing.py --model llama-3-70b --fake --dtype bfloat16 "
          "--seq-len 8192 --batch-size 1": 55,
    _PY + "lab-06-gradient-accumulation/grad_accumulation.py --model llama-3-8b --fake --seq-len 4096 "
          "--micro-batch 1 --accum-steps 4 --steps 2": 20,
    _PY + "lab-07-optimizer-offload/optimizer_offload.py --model llama-3-8b --fake --precision bf16 --seq-len 4096 "
          "--batch-size 1 --steps 2": 22,
    _PY + "lab-08-offload-memory-saving/offload.py --model flux-dev --fake --dtype bfloat16 --latent-tokens 4096 "
          "--text-len 512 --steps 2": 38,
    _PY + "lab-08-offload-memory-saving/offload.py --model flux-dev --fake --dtype bfloat16 --latent-tokens 4096 "
          "--text-len 512 --steps 2 --mode layerwise": 27,
    _PY + "lab-11-zero-fsdp/zero_fsdp.py --device cpu --stage 3 --json": 30,
    _PY + "lab-11-zero-fsdp/fsdp_inference.py --device cpu": 27,
    _PY + "lab-11-zero-fsdp/zero_fsdp.py --model llama-3-8b --fake --world-size 8 --seq-len 4096 --batch-size 1 "
          "--steps 2": 102,
    _PY + "lab-11-zero-fsdp/zero_fsdp.py --model llama-3-70b --fake --world-size 64 --seq-len 4096 --batch-size 1 "
          "--steps 2 --stage 3": 36,
    _PY + "lab-13-will-it-fit/fit.py --model llama-3-70b --dp 8 --zero-stage 3 --json": 32,
    _PY + "lab-13-will-it-fit/fit.py --model llama-3-70b --dp 8 --zero-stage 3 --checkpointing full": 22,
    _PY + "lab-13-will-it-fit/fit.py --model llama-3-8b --method qlora --precision bf16 --seq 2048 "
          "--gpu rtx4090-24gb": 31,
}


@dataclass
class Command:
    text: str
    where: str  # file:line of its block
    expect: int = 0

    @property
    def cuda(self) -> bool:
        return "--device cuda" in self.text or any(fragment in self.text for fragment in CUDA_ONLY)


@dataclass
class Block:
    where: str
    commands: list[Command] = field(default_factory=list)


def front_matter(page) -> dict:
    return yaml.safe_load(page.read_text(encoding="utf-8").split("---", 2)[1])


def shown_files() -> list[Path]:
    return sorted({p for pattern in SHOWN_IN for p in ROOT.glob(pattern) if p.is_file()})


def blocks_in(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file that show commands, continuation lines joined."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.groups()
        lang = lines[i].strip()[len(fence):].strip().split(" ")[0].lower()
        j, body = i + 1, []
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        block = Block(f"{path.relative_to(ROOT)}:{i + 1}")
        joined = [line.strip() for line in re.sub(r"\s*\\\n\s*", " ", "\n".join(body)).splitlines()]
        if lang in SHELL_LANGS and any(COMMAND.match(line) for line in joined):
            for line in joined:
                if not line or line.startswith("#"):
                    continue
                expect = EXPECT.search(line)
                text = without_comment(line.removeprefix("$ "))
                block.commands.append(Command(text, block.where, int(expect.group(1)) if expect else 0))
        if block.commands:
            out.append(block)
        i = j + 1
    return out


def without_comment(line: str) -> str:
    """The line less a trailing ``# comment``: the first `` #`` outside quotes."""
    for m in re.finditer(r"\s+#", line):
        before = line[:m.start()]
        if before.count("'") % 2 == 0 and before.count('"') % 2 == 0:
            return before
    return line


def skipped(command: Command) -> str | None:
    for fragment, reason in SKIP.items():
        if fragment in command.text:
            return reason
    if command.text in SLOW and not ALL:
        return f"{SLOW[command.text]:.0f} s measured, over {SLOW_S:.0f} s (INFRALAB_ALL_COMMANDS=1 runs it)"
    return None


def collect(cuda: bool) -> list[Block]:
    """Every block, its commands deduplicated across the site (first shown wins) and against the
    pages' run_cpu commands, skipped ones left out; only the ``--device cuda`` ones if ``cuda``."""
    seen = {front_matter(p)["run_cpu"] for p in LAB_PAGES}
    out = []
    for path in shown_files():
        for block in blocks_in(path):
            keep = Block(block.where)
            for c in block.commands:
                if c.text in seen or skipped(c) or c.cuda != cuda:
                    continue
                seen.add(c.text)
                keep.commands.append(c)
            out += split(keep)
    return out


SCRATCH = re.compile(r"(?<![\w./])/tmp/[^\s'\"]+")


def split(block: Block) -> list[Block]:
    """A block's commands as the runs that can go apart: commands that share a ``/tmp/`` file (one
    writes it, a later one reads it) stay together, in order; every other command is a run of its
    own, so that the suite's two processes share a long block and no test runs many commands."""
    groups: list[tuple[set[str], list[Command]]] = []
    for c in block.commands:
        files = set(SCRATCH.findall(c.text))
        joined = [g for g in groups if g[0] & files]
        if joined:
            first = joined[0]
            for g in joined[1:]:  # a command that reads two earlier groups' files joins them
                first[0].update(g[0])
                first[1].extend(g[1])
                groups.remove(g)
            first[0].update(files)
            first[1].append(c)
        else:
            groups.append((files, [c]))
    if len(groups) == 1:
        return [Block(block.where, groups[0][1])]
    return [Block(f"{block.where}#{i + 1}", commands) for i, (_, commands) in enumerate(groups)]


def clean_env(tmp_path: Path) -> dict:
    """A fresh shell, the one ``bench/lab_runs_bench.py`` times the pages' commands in: no virtual
    environment active, no ``OMP_NUM_THREADS`` (each lab chooses its own thread count)."""
    return LAB_RUNS.fresh_shell(tmp_path)


def with_out_flag(text: str, tmp_path: Path) -> str:
    """The command as run here: its ``/tmp/`` scratch paths in the test's own directory, and the
    output flag of a command that would rewrite committed results."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    text = re.sub(r"(?<![\w./])/tmp/", f"{scratch}/", text)
    for script, flag in OUT_FLAGS.items():
        if script in text:
            return f"{text} {flag.format(tmp=tmp_path)}"
    return text


def script(block: Block, tmp_path: Path, python: str | None = None) -> str:
    """One bash script: each command in order, its stdout in ``tmp_path/stdout/N``, stopped at the
    first one that exits otherwise than shown. ``python``: what runs a ``.venv/bin/python script.py``
    line (``prewarmed``'s client; None: the venv's python itself)."""
    (tmp_path / "stdout").mkdir(exist_ok=True)
    lines = []
    for i, c in enumerate(block.commands):
        shown = c.text.replace("'", "'\\''")
        text = with_out_flag(c.text, tmp_path)
        if python:
            text = re.sub(r"^\.venv/bin/python (?=\S+\.py(\s|$))", f"'{python}' ", text)
        lines.append(f"{{ {text}\n}} >'{tmp_path}/stdout/{i}'\n"
                     f"rc=$?; if [ $rc -ne {c.expect} ]; then echo 'exit '$rc', not {c.expect}: {shown}' >&2; exit 1; fi")
    return "\n".join(lines)


def too_wide(stdout: str) -> list[str]:
    """The lines of a lab's report wider than ``WIDTH`` columns. A table's note whose URL alone is
    wider is not one: a URL is never cut."""
    return [line for line in stdout.splitlines() if width_of(line) > WIDTH
            and not (re.fullmatch(r"\[\d+\] https?://\S+", line) and width_of(line.split()[1]) > WIDTH - 4)]


def run_block(block: Block, tmp_path: Path, python: str | None = None) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "-c", script(block, tmp_path, python)], cwd=ROOT, env=clean_env(tmp_path),
                          capture_output=True, text=True, timeout=900)
    print(f"{block.where}: {time.perf_counter() - t0:.1f} s wall, {len(block.commands)} commands")
    assert proc.returncode == 0, f"{block.where}\n{proc.stderr[-3000:]}"
    for i, c in enumerate(block.commands):
        if "code/lab-" in c.text and "--json" not in c.text:
            out = (tmp_path / "stdout" / str(i)).read_text(encoding="utf-8")
            wide = too_wide(out.replace(f"{tmp_path / 'scratch'}/", "/tmp/"))  # as the reader's /tmp/ path prints
            assert not wide, f"{c.text}: {len(wide)} lines over {WIDTH} columns, the first: {wide[0]}"


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_the_pages_cpu_command_runs_verbatim_in_a_fresh_shell(page, tmp_path):
    command = front_matter(page)["run_cpu"]
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "-c", with_out_flag(command, tmp_path)], cwd=ROOT, env=clean_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    print(f"{page.stem}: {time.perf_counter() - t0:.1f} s wall: {command}")
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), f"{command} printed nothing"
    wide = too_wide(proc.stdout)  # through a pipe, as in a 100-column terminal
    assert not wide, f"{len(wide)} lines over {WIDTH} columns, the first: {wide[0]}"


@pytest.mark.parametrize("ending, code", [("sys.exit(3)", 3), ("raise ValueError('no')", 1), ("", 0)])
def test_a_prewarmed_command_is_what_a_fresh_interpreter_runs(prewarmed, tmp_path, ending, code):
    """The same script through the prewarmed client and through the venv's python, in one shell: the
    same lines printed (argv, __name__, its folder first on sys.path, the working directory, HOME,
    stdin, an atexit handler's line), the same exit code, the exception on stderr; and the first had torch
    imported before it began."""
    (tmp_path / "s.py").write_text(
        "import atexit, os, sys\natexit.register(lambda: print('atexit'))\n"
        "print(sys.argv, __name__, sys.path[0], os.getcwd(), os.environ['HOME'], sys.stdin.read().strip())\n"
        "print('warm', 'torch' in sys.modules, file=sys.stderr)\n"
        f"sys.stdout.flush()\n{ending}\n", encoding="utf-8")
    shell = f"cd '{tmp_path}' && printf 'in\\n' | {{}} s.py a 'b c'"
    runs = [subprocess.run(["bash", "-c", shell.format(python)], env=clean_env(tmp_path), capture_output=True,
                           text=True, timeout=60) for python in (f"'{prewarmed}'", f"'{ROOT / '.venv/bin/python'}'")]
    assert [r.returncode for r in runs] == [code, code]
    assert runs[0].stdout == runs[1].stdout and f"['s.py', 'a', 'b c'] __main__ {tmp_path}" in runs[0].stdout
    assert runs[0].stdout.endswith("atexit\n") and ("ValueError: no" in runs[0].stderr) == (code == 1)
    assert "warm True" in runs[0].stderr and "warm False" in runs[1].stderr, runs  # torch imported before the fork


@pytest.mark.parametrize("block", collect(cuda=False), ids=lambda b: b.where)
def test_every_command_shown_runs_verbatim(block, tmp_path, prewarmed):
    run_block(block, tmp_path, prewarmed)


@pytest.mark.cuda
@pytest.mark.parametrize("block", collect(cuda=True), ids=lambda b: b.where)
def test_every_cuda_command_shown_runs_verbatim_on_a_gpu(block, tmp_path):
    run_block(block, tmp_path)


def test_the_collector_finds_the_commands_and_every_skip_is_used():
    """The collector sees what a reader sees (joined continuation lines, a block's order, a stated
    exit code), and no SKIP or SLOW entry outlives the command it was written for."""
    every = [c for p in shown_files() for b in blocks_in(p) for c in b.commands]
    texts = [c.text for c in every]
    assert len(every) > 80
    lab02 = [c.text for b in blocks_in(ROOT / "code/lab-02-single-gpu-training/README.md") for c in b.commands]
    assert lab02.index(next(t for t in lab02 if t.endswith("--checkpoint /tmp/c.pt"))) < lab02.index(
        next(t for t in lab02 if t.endswith("--checkpoint /tmp/c.pt --resume")))
    assert not any(t.endswith("\\") or " \\ " in t or "  " in t for t in texts)  # continuation lines joined
    printf = next(c for c in every if c.text.startswith("printf ") and "/tmp/trace.jsonl" in c.text)
    assert printf.where.startswith("code/lab-14-serving-memory/README.md")  # a block's every line runs
    assert any(c.expect == 2 and "--budget 8MiB" in c.text for c in every)
    for fragment in [*SKIP, *CUDA_ONLY, *OUT_FLAGS]:
        assert any(fragment in t for t in texts), f"entry {fragment!r} matches no command shown"
    for text in SLOW:
        assert text in texts, f"SLOW entry {text!r} is no command shown"
