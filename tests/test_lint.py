"""Lint: the labs are read by learners, so they stay clean."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_lab_files_stay_readable():
    """A lab file is the lesson: under ~300 lines."""
    for f in (ROOT / "code").glob("lab-*/*.py"):
        n = len(f.read_text(encoding="utf-8").splitlines())
        assert n <= 340, f"{f.relative_to(ROOT)} has {n} lines"
