"""Provenance: where and when a number was measured, and on which code.

Every results file and every executed notebook carries the record made by :func:`collect`:
device, driver and CUDA versions, torch and Python versions, git commit, a hash of the lab's
source files, date and wall time. The site compares ``source_hash`` with the current files to say
when a figure was measured on older lab code.

This module imports torch only inside :func:`collect`, so the site build can call
:func:`source_hash` cheaply.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from labkit import labs

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE_DIR = REPO_ROOT / "code"
LABKIT_DIR = Path(__file__).resolve().parent


def source_hash(lab: str | os.PathLike | int) -> str:
    """SHA-256 (first 16 hex digits) over a lab's source files: every ``*.py`` of its folder and
    every lab file they import (:func:`labkit.labs.sources`)."""
    return _hash(labs.sources(lab), CODE_DIR)


def labkit_hash() -> str:
    """The same hash over labkit's own files: the instruments a measurement was made with."""
    return _hash(sorted(f for f in LABKIT_DIR.rglob("*.py") if "__pycache__" not in f.parts), LABKIT_DIR)


def code_hash(*extra: str | os.PathLike) -> str:
    """The same hash over everything a notebook executes: every file under ``code/`` (labkit and all
    the labs, whichever it loads), ``requirements.txt`` (the pinned packages) and ``extra`` files of
    the repository (the notebook's own source). Two executions on equal hashes run the same code."""
    files = sorted(f for f in CODE_DIR.rglob("*") if f.is_file() and "__pycache__" not in f.parts
                   and f.suffix != ".pyc")
    files += [REPO_ROOT / "requirements.txt", *(Path(e).resolve() for e in extra)]
    return _hash(files, REPO_ROOT)


def _hash(files: list[Path], base: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(base).as_posix().encode())
        h.update(b"\0")
        h.update(f.read_bytes().replace(b"\r\n", b"\n"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def collect(lab: str | os.PathLike | int | None = None, device: Any = None, wall_time_s: float | None = None) -> dict:
    """The provenance record of a measurement made now, on ``device``, by ``lab``'s code.

    ``lab``: a lab number, slug, or a path inside its folder (a starter passes ``__file__``);
    ``device``: where it ran; ``wall_time_s``: how long the measurement took."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    record: dict[str, Any] = {
        "device_type": dev.type,
        "device_name": None,
        "cpu": _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "driver_version": None,
        "cuda_version": torch.version.cuda,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(terse=True),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None,
        "lab": None,
        "source_hash": None,
        "labkit_hash": labkit_hash(),
        "date_utc": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "wall_time_s": None if wall_time_s is None else round(float(wall_time_s), 3),
    }
    status = _git("status", "--porcelain", "--", "code")
    record["git_dirty"] = None if status is None else bool(status)
    if record["git_commit"] is None and os.environ.get("INFRALAB_GIT_COMMIT"):
        # a copy of the tree without .git (a rented GPU machine): scripts/gpu_kit wrote down the commit
        # the copy was made from, and whether code/ differed from it, before the tree was sent
        record["git_commit"] = os.environ["INFRALAB_GIT_COMMIT"]
        record["git_dirty"] = os.environ.get("INFRALAB_GIT_DIRTY", "").lower() in ("1", "true", "yes")
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        record["device_name"] = torch.cuda.get_device_name(index)
        record["driver_version"] = _nvidia_driver()
        props = torch.cuda.get_device_properties(index)
        record["device_memory_bytes"] = int(props.total_memory)
    else:
        record["device_name"] = record["cpu"]
    if lab is not None:
        record["lab"] = labs.slug(lab)
        record["source_hash"] = source_hash(lab)
    return record


def describe(record: dict) -> str:
    """One line for humans: 'NVIDIA H100 80GB HBM3 · CUDA 13.0 · torch 2.11.0 · 2026-11-22'."""
    parts = [record.get("device_name") or record.get("device_type", "?")]
    if record.get("device_type") == "cuda":
        parts.append(f"driver {record.get('driver_version')}, CUDA {record.get('cuda_version')}")
    else:
        parts.append("CPU only")
    parts.append(f"torch {record.get('torch_version')}")
    parts.append(f"Python {record.get('python_version')}")
    if record.get("git_commit"):
        parts.append(f"commit {record['git_commit'][:10]}{' (dirty)' if record.get('git_dirty') else ''}")
    if record.get("source_hash"):
        parts.append(f"lab source {record['source_hash']}")
    if record.get("labkit_hash"):
        parts.append(f"labkit {record['labkit_hash']}")
    if record.get("cpu_threads"):
        parts.append(f"{record['cpu_threads']} CPU thread{'s' if record['cpu_threads'] != 1 else ''}")
    if record.get("wall_time_s") is not None:
        parts.append(f"{record['wall_time_s']:.1f} s")
    parts.append(str(record.get("date_utc", "?"))[:10])
    return " · ".join(parts)


def write_results(path: str | os.PathLike, payload: dict, record: dict) -> Path:
    """Write ``payload`` plus its provenance as JSON, all or nothing (:mod:`labkit.files`)."""
    from labkit.files import write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, json.dumps({"provenance": record, **payload}, indent=1, sort_keys=False, default=_plain)
                      + "\n")


def _plain(obj):
    """JSON for the few non-JSON values a result holds: paths, devices, dtypes."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if type(obj).__module__.startswith("torch"):
        return str(obj).replace("torch.", "")
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


# ---------------------------------------------------------------------- results files, checked before use
_SCALAR = (str, int, float, bool, type(None))


def check_results(data) -> None:
    """ValueError (one line) unless ``data`` has the shape of a results file: a JSON object whose
    ``provenance`` holds only plain values, and, for a notebook's summary, ``numbers`` (an object),
    ``tables`` (each one columns of ``[name, kind]`` and rows of plain values) and ``figures``
    (file names). Results arrive from other machines: the site renders nothing unchecked."""
    if not isinstance(data, dict):
        raise ValueError("a results file is a JSON object")
    prov = data.get("provenance")
    if not isinstance(prov, dict) or not all(isinstance(v, _SCALAR) for v in prov.values()):
        raise ValueError("'provenance' must be an object of plain values")
    if "numbers" in data and not isinstance(data["numbers"], dict):
        raise ValueError("'numbers' must be an object")
    for name, table in (data.get("tables") or {}).items():
        columns, rows = (table.get("columns"), table.get("rows")) if isinstance(table, dict) else (None, None)
        if not (isinstance(columns, list) and all(isinstance(c, list) and len(c) == 2 and all(isinstance(x, str)
                                                                                             for x in c)
                                                   for c in columns)):
            raise ValueError(f"table {name!r}: columns must be [name, kind] pairs")
        if not (isinstance(rows, list) and all(isinstance(r, list) and len(r) == len(columns)
                                               and all(isinstance(v, _SCALAR) for v in r) for r in rows)):
            raise ValueError(f"table {name!r}: rows must be lists of plain values, one per column")
    figures = data.get("figures", [])
    if not (isinstance(figures, list) and all(isinstance(f, str) and "/" not in f and not f.startswith(".")
                                              for f in figures)):
        raise ValueError("'figures' must be file names in the results folder")
    rows = data.get("summary_rows", [])
    if not (isinstance(rows, list) and all(isinstance(r, dict) and all(isinstance(v, _SCALAR) for v in r.values())
                                           for r in rows)):
        raise ValueError("'summary_rows' must be objects of plain values")
