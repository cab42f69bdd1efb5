"""Other programs keeping the cores busy, as on a shared machine: the load a CPU benchmark adds.

``with busy.cores(2):`` starts two processes that spin (``while True: pass``) and stops them when
the block ends, however it ends. ``bench/cpu_threads_bench.py`` times Lab 08's step under them and
``bench/lab_runs_bench.py`` every lab page's command: what a reader sees while a test suite, a
browser or a second lab runs.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

SPIN = "while True:\n    pass"


@contextlib.contextmanager
def cores(n: int):
    """``n`` spinning Python processes for the duration of the block (0: none)."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
