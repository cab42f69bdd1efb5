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
import re
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE_DIR = REPO_ROOT / "code"
LABKIT_DIR = Path(__file__).resolve().parent


def lab_dir(lab: str | os.PathLike) -> Path:
    """``"lab-02-single-gpu-training"`` or a path inside it -> the lab's folder under code/."""
    p = Path(lab)
    if not p.is_absolute():
        candidate = CODE_DIR / p
        p = candidate if candidate.exists() else (REPO_ROOT / p)
    p = p.resolve()
    if p.is_file():
        p = p.parent
    if not p.is_dir():
        raise FileNotFoundError(f"no lab folder at {p}")
    return p


def source_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*.py") if "__pycache__" not in f.parts)


LAB_NAME = re.compile(rb"lab-\d\d-[a-z0-9-]+")


def lab_folders(folder: Path) -> list[Path]:
    """The lab's folder and every other lab folder its code names (it imports from them)."""
    seen, todo = [], [folder]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        for f in source_files(current):
            for name in LAB_NAME.findall(f.read_bytes()):
                other = CODE_DIR / name.decode()
                if other.is_dir() and other not in seen:
                    todo.append(other)
    return [seen[0], *sorted(seen[1:])]


def source_hash(lab: str | os.PathLike) -> str:
    """SHA-256 (first 16 hex digits) over the ``*.py`` files of the lab and of the labs it uses."""
    folder = lab_dir(lab)
    h = hashlib.sha256()
    for root in lab_folders(folder) if folder.parent == CODE_DIR else [folder]:
        for f in source_files(root):
            h.update(f.relative_to(CODE_DIR if root != folder else folder).as_posix().encode())
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


def collect(lab: str | os.PathLike | None = None, device: Any = None, wall_time_s: float | None = None) -> dict:
    """The provenance record of a measurement made now, on ``device``, by ``lab``'s code."""
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
        "labkit_hash": source_hash(LABKIT_DIR),
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
        folder = lab_dir(lab)
        record["lab"] = folder.name
        record["source_hash"] = source_hash(folder)
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
    """Write ``payload`` plus its provenance as JSON (parents created, written atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"provenance": record, **payload}, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path
