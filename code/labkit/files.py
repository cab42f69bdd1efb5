"""Files written all or nothing, and output paths refused before the work starts.

Every file a lab, a notebook or a benchmark writes goes through :func:`atomic`:

* the data goes to a temporary file beside the target, named uniquely
  (``.NAME.<pid>.<random>.tmp``), so two runs writing one path never truncate each other's file;
* it is flushed and ``fsync``-ed, then renamed onto the target (a rename is atomic on POSIX file
  systems): a crash leaves the previous file whole, never half of a new one;
* on any failure the temporary is removed, and a full disk, a read-only file system or a missing
  permission is one line (:class:`UsageError`), so nothing claims success after a failed write;
* temporaries left by a writer that was killed (its process is gone) are removed at the next write
  to the same target, and the writer says so on stderr.

:func:`check_writable` refuses, before any work, a target that could not be written: an empty
path, a folder, a parent that is a file, a folder without write permission, or something that is
not a regular file (a device, a FIFO: a rename would replace it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

from labkit.config import UsageError

#: errors that are the machine's, not a bug: said in one line
_DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted", errno.ENAMETOOLONG: "the name is too long"}


def check_writable(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a file this process can create or replace, or a UsageError naming ``flag``."""
    if not str(path).strip():
        raise UsageError(f"{flag} needs a file name, got an empty one")
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name inside it")
    if path.exists() and not path.is_file():
        raise UsageError(f"{flag} {path} is not a regular file (a device or a pipe?); give a file name")
    folder = next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: {folder} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot create its folder ({_why(err)})") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write into {path.parent} (permission denied)")
    return path


@contextlib.contextmanager
def atomic(path: str | os.PathLike, mode: str = "wb") -> Iterator:
    """Open a temporary file for writing; on success it replaces ``path``, on failure it is gone.

    ``mode``: ``"wb"`` or ``"w"`` (text, UTF-8). Use as ``with atomic(p) as f: f.write(...)``.
    """
    path = Path(path)
    if path.exists() and not path.is_file():  # a rename would replace a device, a pipe or a folder
        raise UsageError(f"cannot write {path}: it is not a regular file")
    _remove_stale(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in _DISK_ERRORS:
            raise UsageError(f"cannot write {path}: {_why(err)}") from None
        raise
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        # a writer that hides the OSError (torch.save says "enforce fail at inline_container.cc")
        if isinstance(err, Exception) and _nearly_full(path.parent):
            raise UsageError(f"cannot write {path}: the disk is full") from None
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic(path, "w") as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic(path, "wb") as f:
        f.write(data)
    return Path(path)


def _nearly_full(folder: Path) -> bool:
    import shutil

    try:
        return shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


def _why(err: OSError) -> str:
    return _DISK_ERRORS.get(err.errno) or err.strerror or str(err)


def _remove_stale(path: Path) -> None:
    """Temporaries of ``path`` whose writer process no longer exists."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp") if path.parent.is_dir() else ():
        parts = tmp.name[len(path.name) + 2:].split(".")
        if len(parts) == 3 and parts[0].isdigit() and not _alive(int(parts[0])):
            with contextlib.suppress(OSError):
                size = tmp.stat().st_size
                tmp.unlink()
                print(f"removed {tmp.name} ({size:,} B), left by an interrupted write of {path.name}", file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------- checkpoints that cannot load wrong
def save_checked(state: dict, path: str | os.PathLike) -> Path:
    """``torch.save`` of ``{"state": state, "sha256": {...}}`` through :func:`atomic`: a content
    hash of every tensor in ``state``, so that :func:`load_checked` can tell a damaged file."""
    import torch

    with atomic(path, "wb") as f:
        torch.save({"state": state, "sha256": _tensor_hashes(state)}, f)
    return Path(path)


def load_checked(path: str | os.PathLike) -> dict:
    """The ``state`` :func:`save_checked` wrote, after checking every tensor's hash. ``ValueError``
    (one line) for a file that is not such a checkpoint or whose bytes changed. ``torch.load`` runs
    with ``weights_only=True``: only tensors and plain containers are unpickled, so a file from an
    untrusted source cannot run code."""
    import torch

    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or set(data) != {"state", "sha256"} or not isinstance(data["sha256"], dict):
        raise ValueError("not a checked checkpoint (no content hashes)")
    found = _tensor_hashes(data["state"])
    if found.keys() != data["sha256"].keys():
        raise ValueError("its tensors are not the ones it was saved with")
    if bad := [k for k, h in found.items() if data["sha256"][k] != h]:
        raise ValueError(f"{len(bad)} tensor(s) changed since it was saved (first: {bad[0]}): the file is corrupt")
    return data["state"]


def _tensor_hashes(obj, prefix: str = "") -> dict[str, str]:
    import hashlib

    import torch

    out: dict[str, str] = {}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # the bytes, whatever the dtype
        out[prefix or "."] = hashlib.sha256(raw + str((t.dtype, tuple(t.shape))).encode()).hexdigest()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out |= _tensor_hashes(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out |= _tensor_hashes(v, f"{prefix}/{i}")
    return out
