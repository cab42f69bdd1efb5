"""How long a reader waits for each lab's CPU command: every page's "Run it" line, run verbatim.

    .venv/bin/python bench/lab_runs_bench.py                      # writes results/lab_runs_bench.json
    .venv/bin/python bench/lab_runs_bench.py --labs 5 --rounds 1 --busy 1 --out /tmp/runs.json

Each lab page names its CPU command in its front matter (``run_cpu``). Here each one runs as a
reader would type it in a fresh terminal: ``bash -c`` from the repository root, with a bare
environment (``PATH``, a new ``HOME``, ``LANG``; no virtual environment activated, no
``OMP_NUM_THREADS``), once on the machine as it is and once while ``--busy`` other processes keep
the cores busy (a test suite, a browser, a second lab). Each setting runs ``--rounds`` times,
interleaved; the slowest run of each is held to its target: 10 s with the cores free, 20 s with
every core busy, on a 2-core machine. Beside the wall time, the CPU seconds the command's
processes used (user and system), which other processes' load does not inflate, and the machine's
1-minute load average while it ran: a shared machine is never idle, and the file says how busy it
was. A floor row times ``python -c "import torch"``, which every command pays first.

A CPU figure by nature: the commands are the pages' CPU commands.
"""

from __future__ import annotations

import os
import resource
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from labkit import cli, files, labs, provenance
from labkit.busy import cores as busy_cores
from labkit.config import LabConfig, UsageError, option

ROOT = Path(__file__).resolve().parents[1]
BENCH = "lab runs"
RESULT_FILE = "results/lab_runs_bench.json"
CPU_ONLY = True  # the pages' CPU commands, on this machine's cores: no GPU run is pending for it
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
#: setting -> the slowest run's target, seconds (issue: a new user's first hour)
TARGET_S = {"idle": 10.0, "busy": 20.0}
FLOOR = ".venv/bin/python -c 'import torch'"


@dataclass
class Config(LabConfig):
    """Time every lab page's CPU command in a fresh shell, with the cores free and kept busy."""

    labs: tuple[int, ...] | None = option(None, "lab numbers to time, comma separated (default: every lab page)",
                                           min=1, max=99)
    rounds: int = option(2, "fresh runs of each command per setting, interleaved; the slowest is reported",
                         min=1, max=20)
    busy: int | None = option(None, "processes that keep the cores busy in the busy setting (default: one per "
                              "core; 0: time the idle setting only)", min=0, max=256)
    timeout: int = option(600, "seconds a command may take before the benchmark stops it and fails", min=1,
                          max=3600)
    out: Path | None = option(None, "where to write the results (default: results/lab_runs_bench.json)",
                               path="write")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device == "cuda":
            raise UsageError("--device cuda: this benchmark times the pages' CPU commands; use --device cpu or auto")
        unknown = sorted(set(self.labs or ()) - set(page_commands()))
        if unknown:
            raise UsageError(f"--labs {','.join(map(str, unknown))}: no such lab page "
                             f"(choose from {','.join(map(str, page_commands()))})")


def page_commands() -> dict[int, str]:
    """Each lab page's CPU command (front matter ``run_cpu``), by lab number."""
    out = {}
    for page in sorted((ROOT / "docs" / "labs").glob("lab-*.md")):
        meta = yaml.safe_load(page.read_text(encoding="utf-8").split("---", 2)[1])
        out[labs.number(page.stem)] = meta["run_cpu"]
    return out


def fresh_shell(home: Path) -> dict[str, str]:
    """The environment of a reader's new terminal: no virtual environment active, no thread variable.
    ``PYTHONPATH`` names this checkout's code/, which a reader's venv already imports (editable
    install); it matters only in a git worktree sharing another checkout's venv."""
    return {"PATH": CLEAN_PATH, "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT / "code")}


def time_command(command: str, timeout: int) -> dict:
    """One run of ``command`` in a fresh shell: wall seconds, CPU seconds of its processes, load."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as home:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=fresh_shell(Path(home)),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"over --timeout {timeout} s: {command}") from None
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"
        raise RuntimeError(f"exit {proc.returncode}: {command}: {last}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_1min": round(max(load, os.getloadavg()[0]), 1)}


def timed_rounds(commands: dict, rounds: int, timeout: int) -> dict[str, list[dict]]:
    """Every command ``rounds`` times, interleaved (one pass over them all, then the next)."""
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    for _ in cli.progress(range(rounds), total=rounds, desc="rounds"):
        for name, command in commands.items():
            runs[name].append(time_command(command, timeout))
    return runs


def run(config: Config) -> dict:
    out = config.out or ROOT / RESULT_FILE
    files.check_writable(out, "--out")
    chosen = {n: c for n, c in page_commands().items() if not config.labs or n in config.labs}
    commands = {"floor": FLOOR, **{labs.slug(n): c for n, c in chosen.items()}}
    busy = os.cpu_count() if config.busy is None else config.busy
    t0 = time.perf_counter()
    settings = {"idle": timed_rounds(commands, config.rounds, config.timeout)}
    if busy:
        with busy_cores(busy):
            settings["busy"] = timed_rounds(commands, config.rounds, config.timeout)
    rows, slowest = [], {}
    for setting, runs in settings.items():
        spinning = f"{busy} busy process(es)" if setting == "busy" else "no busy process of ours"
        for name, rs in runs.items():
            worst = max(rs, key=lambda r: r["wall_s"])
            slowest[f"{name}/{setting}"] = worst["wall_s"]
            note = (f"best {min(r['wall_s'] for r in rs):.1f} s; CPU {worst['cpu_s']:.1f} s; load "
                    f"{min(r['load_1min'] for r in rs):.0f}-{max(r['load_1min'] for r in rs):.0f} on "
                    f"{os.cpu_count()} cores, {spinning}; {len(rs)} run(s)")
            if name == "floor":
                rows.append({"metric": f"floor, {setting}: python -c 'import torch'", "value": worst["wall_s"],
                             "unit": "s", "note": note})
            else:
                rows.append({"metric": f"Lab {labs.number(name):02d} page command, {setting}", "value": worst["wall_s"],
                             "unit": "s", "target": f"<= {TARGET_S[setting]:g}", "lab": name, "note": note})
    result = {"bench": BENCH, "device": "cpu", "cores": os.cpu_count(), "busy": busy, "rounds": config.rounds,
              "commands": commands, "runs": settings, "slowest_s": slowest, "targets_s": TARGET_S,
              "summary_rows": rows, "source_hashes": {name: provenance.source_hash(name) for name in commands
                                                      if name != "floor"},
              "note": "wall seconds of each page's CPU command in a fresh shell; the machine's load is in each row"}
    record = provenance.collect(None, cli.pick_device("cpu"), time.perf_counter() - t0)
    provenance.write_results(out, result, record)
    return {"provenance": record, "out": str(out), **result}


def report(result: dict) -> None:
    print(f"Lab page commands on {result['provenance']['cpu']} ({result['cores']} cores; busy setting: "
          f"{result['busy']} busy process(es)), {result['provenance']['wall_time_s'] / 60:.1f} min in all "
          f"-> {result['out']}")
    for setting, runs in result["runs"].items():
        target = result["targets_s"][setting]
        for name, rs in runs.items():
            walls = ", ".join(f"{r['wall_s']:.1f}" for r in rs)
            cpus = ", ".join(f"{r['cpu_s']:.1f}" for r in rs)
            verdict = "" if name == "floor" else ("  ok" if max(r["wall_s"] for r in rs) <= target else
                                                  f"  over {target:g} s")
            print(f"  {setting:<5} {name:<34} wall s: {walls}  (CPU s: {cpus}; load {rs[-1]['load_1min']:.0f})"
                  f"{verdict}")


if __name__ == "__main__":
    cli.main(Config, run, report)
