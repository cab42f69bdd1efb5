"""The "Run it" commands work as written: each lab page's CPU command, run verbatim by bash from the
repository root with a clean PATH (no virtual environment activated), exits 0, within 10 s of CPU time.

The wall time of each is printed (``pytest -s`` shows it); CPU time (the child's user + system) is
what the bound holds, so that a busy machine does not fail the test.
"""

from __future__ import annotations

import resource
import subprocess
import time

import pytest
import yaml
from conftest import ROOT, load_lab

from labkit import dist

LAB_PAGES = sorted((ROOT / "docs" / "labs").glob("lab-*.md"))
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
CPU_SECONDS = 10.0


def front_matter(page) -> dict:
    return yaml.safe_load(page.read_text(encoding="utf-8").split("---", 2)[1])


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: p.stem)
def test_the_pages_cpu_command_runs_verbatim_in_a_fresh_shell(page, tmp_path):
    command = front_matter(page)["run_cpu"]
    env = {"PATH": CLEAN_PATH, "HOME": str(tmp_path), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"{page.stem}: {wall:.1f} s wall, {cpu:.1f} s CPU: {command}")
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    starts_ranks = issubclass(load_lab(int(page.stem[4:6])).Config, dist.Ranks)  # Labs 10, 11: a process per rank
    budget = CPU_SECONDS * (dist.DEFAULT_RANKS if starts_ranks else 1)
    assert cpu <= budget, f"{command}: {cpu:.1f} s of CPU, more than {budget:.0f}"
