"""Shared fixtures: repository paths, lab loading, CLI runs, and the `cuda` marker's skip rule.

Labs are loaded the way they load each other (``labkit.labs.load``); labkit is the one installed in
the virtual environment (editable: ``scripts/_env.sh``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ROOT / "code"


def pytest_configure(config):
    """This process runs the labs on the CPU, so it resolves the CPU as every lab run does, before
    the first test: the labs' own rule (``labkit.cli.cpu_threads``) then sets its thread count, one
    thread unless ``OMP_NUM_THREADS`` says more. Each pytest-xdist worker is such a process, so two
    workers on two cores take one core each, however a test reaches its tensors.

    Reports are read as a 100-column terminal shows them (labkit.table.FALLBACK_WIDTH), whatever
    terminal, or none, runs the suite: ``$COLUMNS`` is what :func:`labkit.table.terminal_width`
    reads first, and every lab the tests start inherits it. Tests of other widths set their own."""
    from labkit import cli
    from labkit.table import FALLBACK_WIDTH

    os.environ["COLUMNS"] = str(FALLBACK_WIDTH)
    cli.pick_device("cpu")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def load_lab(lab: int | str, module: str | None = None):
    """A lab's starter (or its file ``module``) as a module: ``load_lab(8)``."""
    from labkit import labs

    return labs.load(lab, module)


def load_bench(name: str):
    """A benchmark script of bench/ as a module: ``load_bench("trace_bench")``."""
    import importlib.util

    if f"bench_{name}" in sys.modules:
        return sys.modules[f"bench_{name}"]
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def lab02():
    return load_lab(2)


def run_cli(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a lab's starter file as a user would, from the repository root."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(CODE / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_clean_usage_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit code 2, exactly one line on stderr, no traceback, and the line says what is wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """The site built once per run with `mkdocs build --strict`, as the README does. Under xdist the
    first process to need it builds it, in a folder common to this run's processes, and the other
    waits on a lock and reads the same build (a second build would repeat the first byte for byte)."""
    import fcntl
    import json

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _build_site(tmp_path_factory.mktemp("site"))
    shared = tmp_path_factory.getbasetemp().parent  # this run's folder, above each process's own
    with open(shared / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = shared / "site.json"
        if not record.exists():
            built = _build_site(shared / "site")
            record.write_text(json.dumps({**built, "dir": str(built["dir"])}), encoding="utf-8")
        built = json.loads(record.read_text(encoding="utf-8"))
    return {**built, "dir": Path(built["dir"])}


@pytest.fixture(scope="session")
def prewarmed(tmp_path_factory):
    """tests/prewarmed.py's server for this test process, and the client that stands in for
    ``.venv/bin/python`` in a fresh shell (``lab_runs_bench.fresh_shell``'s environment): a script runs in
    a fork of an interpreter that has imported torch once."""
    folder = tmp_path_factory.mktemp("prewarmed")
    sock = folder / "s"  # a short path: a Unix socket's name has a limit of about 100 bytes
    venv_python = ROOT / ".venv" / "bin" / "python"
    with open(folder / "server.log", "w") as log:  # the server holds its own copy of the handle
        server = subprocess.Popen([str(venv_python), str(ROOT / "tests" / "prewarmed.py"), "serve", str(sock)],
                                  cwd=ROOT, env=load_bench("lab_runs_bench").fresh_shell(folder),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    client = folder / "python"
    client.write_text(f"#!/bin/sh\nexec '{venv_python}' -I -S '{ROOT / 'tests' / 'prewarmed.py'}' '{sock}' \"$@\"\n")
    client.chmod(0o755)
    deadline = time.monotonic() + 120
    while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sock.exists(), (folder / "server.log").read_text()
    yield str(client)
    server.kill()
    server.wait()


def _build_site(out: Path) -> dict:
    import time

    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"dir": out, "seconds": seconds, "log": proc.stdout + proc.stderr}


def assert_usage_error_in_process(lab, argv: list[str], capsys, *fragments: str) -> str:
    """Run a lab's command line (``cli.main`` with its Config, run and report) in this process, from
    the repository root as :func:`run_cli` does: exit 2 and one stderr line that holds every fragment.
    A refusal is the same ``cli.main`` in either process; here torch and the lab are imported once per
    test process, not once per case (Lab 13 takes 2 s to start). A lab's list of refusals keeps a
    case in a fresh interpreter (``run_cli``), which sees what only a new process shows (a warning at
    import)."""
    import contextlib

    from labkit import cli

    with pytest.raises(SystemExit) as exc, contextlib.chdir(ROOT):
        cli.main(lab.Config, lab.run, lab.report, argv, prog="lab")
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def one_rank(monkeypatch):
    """The environment torchrun gives a world of one, so that a torchrun lab's main() runs in this
    process (Labs 10 and 11)."""
    import torch

    from labkit.dist import world_of_one

    for key, value in world_of_one().items():
        monkeypatch.setenv(key, value)
    yield
    assert not torch.distributed.is_initialized()  # ranked() left the process group
