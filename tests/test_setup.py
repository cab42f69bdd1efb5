"""The README's set-up works on the Pythons it promises: Debian 12's own ``python3`` (3.11.2), 3.12
and 3.13.

- ``requirements.txt`` resolves for each of them: a resolver dry run (``pip install --dry-run``),
  with Debian's own interpreter where the machine has it (``pip --python /usr/bin/python3``) and
  for 3.11.2, 3.12 and 3.13 by version (``--python-version``, wheels only, as a user's pip would
  pick them). A pin that needs a newer Python (pymdown-extensions 13 needs 3.11.5) fails here.
- ``scripts/_env.sh`` checks the Python first: too old, or no Python at all, is one line with the
  fix and exit 2; Debian's own passes.
- A failed install never leaves a ``.venv`` that the next run trusts: the next run makes it again.

The dry runs ask the package index; where it cannot be reached they are skipped, except under
``CI=true``, where that is a failure (CI installs from the same index).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

DEBIAN_PYTHON = Path("/usr/bin/python3")
PROMISED = ["3.11.2", "3.12", "3.13"]  # the README's set-up section names these


def _pip(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _unreachable(proc: subprocess.CompletedProcess) -> bool:
    text = proc.stdout + proc.stderr
    return any(s in text for s in ("Failed to establish a new connection", "Temporary failure in name resolution",
                                   "Network is unreachable", "Could not fetch URL"))


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0 and _unreachable(proc):
        if os.environ.get("CI"):
            pytest.fail(f"{what}: the package index cannot be reached in CI")
        pytest.skip(f"{what}: the package index cannot be reached from this machine")
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("ERROR")]
    assert proc.returncode == 0, f"{what}:\n" + "\n".join(errors or [proc.stderr[-2000:]])


@pytest.mark.parametrize("version", PROMISED)
def test_the_pinned_set_resolves_for_each_promised_python(version, tmp_path):
    proc = _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--only-binary=:all:",
                "--python-version", version, "--target", str(tmp_path / "target"), "-r", "requirements.txt")
    _check(proc, f"requirements.txt for Python {version}")


@pytest.mark.skipif(not DEBIAN_PYTHON.is_file(), reason="no /usr/bin/python3 on this machine")
def test_the_pinned_set_resolves_for_debians_own_python3(tmp_path):
    """Debian's interpreter itself runs the resolver (its version, its platform tags)."""
    version = subprocess.run([str(DEBIAN_PYTHON), "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    print(f"/usr/bin/python3 is Python {version}")
    report = tmp_path / "report.json"
    proc = _pip("--python", str(DEBIAN_PYTHON), "install", "--dry-run", "--ignore-installed", "--quiet",
                "--report", str(report), "-r", "requirements.txt")
    _check(proc, f"requirements.txt for {DEBIAN_PYTHON} (Python {version})")
    import json

    resolved = json.loads(report.read_text())
    assert resolved["environment"]["python_full_version"] == version
    pinned = {re.split(r"==", line)[0].lower().replace("_", "-") for line in
              (ROOT / "requirements.txt").read_text().splitlines() if "==" in line and not line.startswith("#")}
    got = {i["metadata"]["name"].lower().replace("_", "-") for i in resolved["install"]}
    assert pinned - {"pip"} <= got, f"pins left out: {sorted(pinned - got)}"


def _env_check(python: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """scripts/_env.sh's Python check alone, as ./scripts/test sources it."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": python,
           "INFRALAB_CHECK_PYTHON_ONLY": "1"}
    return subprocess.run(["bash", "-c", ". scripts/_env.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_setup_check_names_the_same_minimum_as_pyproject():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    script = (ROOT / "scripts" / "_env.sh").read_text()
    minimum = re.search(r'MIN_PYTHON="([\d.]+)"', script).group(1)
    assert requires == f">={minimum}"
    major, minor = minimum.split(".")
    assert f"sys.version_info >= ({major}, {minor})" in script
    readme = (ROOT / "README.md").read_text()
    assert all(v in readme for v in ("3.11.2", "3.12", "3.13")), "the README names the Pythons this file tests"


@pytest.mark.skipif(not DEBIAN_PYTHON.is_file(), reason="no /usr/bin/python3 on this machine")
def test_the_setup_check_accepts_debians_own_python3(tmp_path):
    proc = _env_check(str(DEBIAN_PYTHON), tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("python, found", [("old", "3.10.13"), ("/nonexistent/python3", "not a Python that runs here")])
def test_the_setup_check_refuses_a_python_too_old_in_one_line_with_the_fix(python, found, tmp_path):
    if python == "old":  # an interpreter that says it is 3.10.13 (the check asks it twice)
        fake = tmp_path / "python3.10"
        fake.write_text('#!/bin/sh\ncase "$*" in *sys.exit*) exit 1 ;; *) echo 3.10.13 ;; esac\n')
        fake.chmod(0o755)
        python = str(fake)
    proc = _env_check(python, tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"'{python}' is {found}" in lines[0] and "PYTHON=/path/to/python3.11" in lines[0], lines[0]


def test_a_failed_install_leaves_no_venv_the_next_run_trusts(tmp_path):
    """An install that fails half-way (a pin that does not exist) leaves no marker; the next run,
    with requirements that install, removes that .venv and makes it again."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "code" / "labkit").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "_env.sh", repo / "scripts" / "_env.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    (repo / "README.md").write_text("x\n")
    (repo / "code" / "labkit" / "__init__.py").write_text("")
    pip_pin = next(line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("pip=="))
    setuptools_pin = next(line for line in (ROOT / "requirements.txt").read_text().splitlines()
                          if line.startswith("setuptools=="))
    # the machine's pip settings (index, find-links, certificates) stay; no virtual environment is active
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", PYTHON=sys.executable)

    def setup(requirements: str) -> subprocess.CompletedProcess:
        (repo / "requirements.txt").write_text(requirements)
        return subprocess.run(["bash", "-c", ". scripts/_env.sh"], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)

    failed = setup(f"{pip_pin}\n{setuptools_pin}\ninfralab-no-such-package==0.0.1\n")
    if _unreachable(failed):
        _check(failed, "the first install")
    assert failed.returncode != 0, "a pin that does not exist must fail the install"
    assert (repo / ".venv").exists() and not (repo / ".venv" / ".requirements.sha256").exists()
    fixed = setup(f"{pip_pin}\n{setuptools_pin}\n")
    _check(fixed, "the second install")
    assert "making it again" in fixed.stderr
    assert (repo / ".venv" / ".requirements.sha256").is_file()
    again = setup(f"{pip_pin}\n{setuptools_pin}\n")  # trusted now: nothing is installed
    assert again.returncode == 0 and again.stderr == "", again.stderr
