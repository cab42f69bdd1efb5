"""Paths checked before the work starts, files read with limits, files written all or nothing.

**Paths** (:func:`check_path`, which every ``Path`` field of a ``Config`` goes through): a name the
file system cannot hold (a part over 255 bytes, a whole path over 4,095, a NUL) is refused in one
line, as is, by its role,

* a file to **read** that is missing, a folder, or not a regular file (a FIFO would block the read
  forever, ``/dev/zero`` never ends): :func:`read_bytes` reads regular files only, up to a cap;
* a file to **write** that is a folder or a device, whose nearest existing folder is a file, or
  where no file can be created (no permission, a read-only or a pseudo file system such as
  ``/proc``; probed with an anonymous temporary file, so nothing is left behind);
* a **folder** to write into, by the same rules.

**Reading** JSON (:func:`read_json`, :func:`parse_json`): a size cap, a nesting-depth limit checked
before the parser recurses, whole numbers of at most 30 digits, no NaN or infinity.

**Writing**: every file a lab, a notebook or a benchmark writes goes through :func:`atomic`:

* the data goes to a temporary file beside the target, named uniquely
  (``.NAME.<pid>.<random>.tmp``), so two runs writing one path never truncate each other's file;
* it is flushed and ``fsync``-ed, then renamed onto the target (a rename is atomic on POSIX file
  systems): a crash leaves the previous file whole, never half of a new one;
* Ctrl-C during the write is held until the file is in place, then raised: an interrupted run
  still leaves the whole file it was writing;
* on any failure the temporary is removed, and a full disk (said with the folder's mount point,
  the bytes free and, when the writer said how many it needs, those), a read-only file system or a
  missing permission is one line (:class:`UsageError`), so nothing claims success after a failed
  write;
* temporaries left by a writer that was killed (its process is gone) are removed at the next write
  to the same target, and the writer says so on stderr.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from labkit.config import UsageError

#: errors that are the machine's, not a bug: said in one line
_DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted", errno.ENAMETOOLONG: "the name is too long"}

#: bytes one part of a path may have (Linux and macOS file systems), and a whole path (Linux)
NAME_MAX, PATH_MAX = 255, 4096


# ---------------------------------------------------------------------- paths, before any work
def shown(path, limit: int = 240) -> str:
    """A path for a one-line message: control characters escaped, a long one cut in the middle."""
    text = os.fspath(path) if not isinstance(path, str) else path
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 4:]} ({len(text):,} characters)"


def path_problem(path) -> str | None:
    """Why the file system cannot hold this name (None if it can): a NUL, a part longer than
    ``NAME_MAX`` bytes, or the whole longer than ``PATH_MAX - 1`` bytes."""
    text = os.fspath(path)
    if "\0" in text:
        return "a path cannot hold a NUL character"
    raw = os.fsencode(text)
    if len(raw) >= PATH_MAX:
        return f"the path is {len(raw):,} bytes long, more than the {PATH_MAX - 1:,} a path may have"
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        return f"one name in it is {len(longest):,} bytes long, more than the {NAME_MAX} a file name may have"
    return None


def check_path(path, flag: str, role: str | None = None) -> Path:
    """``path`` as a Path, or a UsageError naming ``flag``: a name the file system cannot hold,
    and by ``role`` (``"read"``, ``"write"``, ``"folder"``, or None for the name alone) a file
    that cannot be read, a target that cannot be written. Creates and leaves nothing."""
    path = Path(path)
    if why := path_problem(path):
        raise UsageError(f"{flag} {shown(path)}: {why}")
    if role == "read":
        _regular(path, flag)
    elif role in ("write", "folder"):
        check_target(path, flag, folder=role == "folder")
    elif role is not None:
        raise ValueError(f"path role must be read, write or folder, got {role!r}")
    return path


def _regular(path: Path, flag: str) -> os.stat_result:
    try:
        info = path.stat()
    except OSError as err:
        why = "no such file" if err.errno == errno.ENOENT else _why(err)
        raise UsageError(f"{flag} {shown(path)}: {why}") from None
    if stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{flag} {shown(path)} is a folder; give a file")
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{flag} {shown(path)} is not a regular file (a device, a pipe or a socket): "
                         f"give a file")
    return info


def check_target(path: str | os.PathLike, flag: str, folder: bool = False) -> Path:
    """``path`` as a file (or, ``folder``, a folder) this process could create or replace, or a
    UsageError naming ``flag``. Nothing is created: the nearest folder that exists is probed with
    an anonymous temporary file."""
    if not str(path).strip():
        raise UsageError(f"{flag} needs a {'folder' if folder else 'file'} name, got an empty one")
    path = Path(path)
    if why := path_problem(path):
        raise UsageError(f"{flag} {shown(path)}: {why}")
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as err:
        raise UsageError(f"{flag} {shown(path)}: {_why(err)}") from None
    if folder and exists and not is_dir:
        raise UsageError(f"{flag} {shown(path)} is not a folder")
    if not folder and is_dir:
        raise UsageError(f"{flag} {shown(path)} is a directory; give a file name inside it")
    if not folder and exists and not path.is_file():
        raise UsageError(f"{flag} {shown(path)} is not a regular file (a device or a pipe?); give a file name")
    nearest = path if folder and is_dir else next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if not nearest.is_dir():
        raise UsageError(f"{flag} {shown(path)}: {shown(nearest)} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {shown(path)}: cannot write into {shown(nearest)} ({_why(err)})") from None
    return path


def check_writable(path: str | os.PathLike, flag: str) -> Path:
    """:func:`check_target`, then the file's folder created: ``path`` is ready to be written."""
    path = check_target(path, flag)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{flag} {shown(path)}: cannot create its folder ({_why(err)})") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {shown(path)}: cannot write into {shown(path.parent)} (permission denied)")
    return path


def check_room(path: str | os.PathLike, nbytes: int, flag: str) -> None:
    """UsageError, before any work, when the file system that will hold ``path`` has less than
    ``nbytes`` free (a run's output whose size is known in advance: a checkpoint)."""
    folder = next((p for p in Path(path).absolute().parents if p.exists()), Path("/"))
    free = _free(folder)
    if free is not None and nbytes > free:
        raise UsageError(f"{flag} {shown(path)}: {_disk_full(folder, free, nbytes)}")


# ---------------------------------------------------------------------- reading, with limits
def read_bytes(path: str | os.PathLike, flag: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, or a UsageError naming ``flag``.
    A FIFO, a device (``/dev/zero``, ``/dev/urandom``) or a socket is refused without a read:
    the file is opened without blocking and checked before anything is read from it."""
    path = Path(path)
    if why := path_problem(path):
        raise UsageError(f"{flag} {shown(path)}: {why}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as err:
        why = "no such file" if err.errno == errno.ENOENT else "is a folder" if err.errno == errno.EISDIR else _why(err)
        raise UsageError(f"{flag} {shown(path)}: {why}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UsageError(f"{flag} {shown(path)} is a folder; give a file")
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{flag} {shown(path)} is not a regular file (a device, a pipe or a socket): give a file")
        if info.st_size > limit:
            raise UsageError(f"{flag} {shown(path)} is {info.st_size:,} bytes, more than the {limit:,} this reads")
        try:
            data = f.read(limit + 1)
        except OSError as err:
            raise UsageError(f"{flag} {shown(path)}: cannot read it ({_why(err)})") from None
    if len(data) > limit:  # it grew while being read
        raise UsageError(f"{flag} {shown(path)} is more than the {limit:,} bytes this reads")
    return data


def read_text(path: str | os.PathLike, flag: str, limit: int) -> str:
    """:func:`read_bytes` decoded as UTF-8 (a UsageError if it is not)."""
    try:
        return read_bytes(path, flag, limit).decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{flag} {shown(path)}: not UTF-8 text (byte {err.start:,})") from None


def read_json(path: str | os.PathLike, flag: str, limit: int = 4 << 20, depth: int = 32):
    """The JSON document in a regular file of at most ``limit`` bytes, nested at most ``depth``
    deep (see :func:`parse_json`), or a UsageError naming ``flag`` and the file."""
    return parse_json(read_text(path, flag, limit), f"{flag} {shown(path)}", depth)


#: a string literal or a bracket, for the depth check (strings may hold brackets)
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
#: digits a whole number may have: an int64 has 19, a byte count of any machine fewer
MAX_DIGITS = 30


def parse_json(text: str, where: str, depth: int = 32):
    """``json.loads`` with limits, for text from a user: nesting deeper than ``depth`` is refused
    before the parser recurses; a whole number of more than ``MAX_DIGITS`` digits, a float that
    overflows, NaN and Infinity are refused. UsageError ``"{where}: ..."`` for anything wrong."""
    level = deepest = 0
    for token in _JSON_TOKENS.finditer(text):
        c = token.group()
        if c in "[{":
            level += 1
            if level > depth:
                raise UsageError(f"{where}: nested more than {depth} levels deep")
        elif c in "]}":
            level -= 1
        deepest = max(deepest, level)

    def whole(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_DIGITS:
            raise _Refused(f"a number of {len(digits.lstrip('-')):,} digits (at most {MAX_DIGITS})")
        return int(digits)

    def real(digits: str) -> float:
        value = float(digits)
        if not -1.8e308 < value < 1.8e308:
            raise _Refused(f"the number {digits[:20]} overflows a float")
        return value

    def constant(name: str):
        raise _Refused(f"{name} is not a number JSON allows")

    try:
        return json.loads(text, parse_int=whole, parse_float=real, parse_constant=constant)
    except _Refused as err:
        raise UsageError(f"{where}: {err}") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}: not JSON ({err.msg}, line {err.lineno} column {err.colno})") from None
    except (ValueError, RecursionError) as err:
        raise UsageError(f"{where}: not JSON ({' '.join(str(err).split())[:120]})") from None


class _Refused(ValueError):
    pass


@contextlib.contextmanager
def atomic(path: str | os.PathLike, mode: str = "wb", size: int | None = None) -> Iterator:
    """Open a temporary file for writing; on success it replaces ``path``, on failure it is gone.

    ``mode``: ``"wb"`` or ``"w"`` (text, UTF-8). Use as ``with atomic(p) as f: f.write(...)``.
    ``size``: the bytes the file will have, when the writer knows (about) it: a disk without that
    much room is refused before anything is written, and a full disk is said with it.
    """
    path = Path(path)
    if path.exists() and not path.is_file():  # a rename would replace a device, a pipe or a folder
        raise UsageError(f"cannot write {shown(path)}: it is not a regular file")
    if size is not None:
        free = _free(path.parent)
        if free is not None and size > free:
            raise UsageError(f"cannot write {shown(path)}: {_disk_full(path.parent, free, size)}")
    _remove_stale(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with interrupts_held():
        try:
            with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except UsageError:
            tmp.unlink(missing_ok=True)
            raise
        except BaseException as err:
            # a writer may hide the OSError: torch.save raises "enforce fail at inline_container.cc" from it
            cause = next((e for e in _chain(err) if isinstance(e, OSError) and e.errno in _DISK_ERRORS), None)
            full = isinstance(err, Exception) and (cause.errno in (errno.ENOSPC, errno.EDQUOT) if cause is not None
                                                   else isinstance(err, RuntimeError) and _nearly_full(path.parent))
            free = _free(path.parent) if full else None  # measured before the temporary is gone
            written = tmp.stat().st_size if full and tmp.exists() else 0
            tmp.unlink(missing_ok=True)
            if full:
                raise UsageError(f"cannot write {shown(path)}: {_disk_full(path.parent, free, size, written)}") \
                    from None
            if cause is not None and isinstance(err, Exception):
                raise UsageError(f"cannot write {shown(path)}: {_why(cause)}") from None
            raise


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) arriving in the block is held, and raised as ``KeyboardInterrupt`` once the
    block has finished (its own error, if it raised one, goes first). Outside the main thread, or
    under a handler that is not Python's, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except (ValueError, TypeError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and callable(previous):
        previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
    elif held and previous == signal.SIG_DFL:
        raise KeyboardInterrupt


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic(path, "wb", size=len(data)) as f:
        f.write(data)
    return Path(path)


def _free(folder: Path) -> int | None:
    import shutil

    try:
        return shutil.disk_usage(next((p for p in [Path(folder), *Path(folder).absolute().parents] if p.exists()),
                                      Path("/"))).free
    except OSError:
        return None


def _nearly_full(folder: Path) -> bool:
    free = _free(folder)
    return free is not None and free < (1 << 20)


def _mount_point(folder: Path) -> Path:
    folder = next((p for p in [Path(folder).absolute(), *Path(folder).absolute().parents] if p.exists()), Path("/"))
    while not os.path.ismount(folder) and folder != folder.parent:
        folder = folder.parent
    return folder


def _disk_full(folder: Path, free: int | None, needed: int | None, written: int = 0) -> str:
    from labkit.table import format_bytes

    room = f"{format_bytes(free) if free else '0 B'} free" if free is not None else "no room left"
    need = (f"; the file needs {format_bytes(needed)}" if needed else
            f"; the file needs more than the {format_bytes(written)} written when it filled" if written else "")
    return f"the disk is full (the file system at {shown(_mount_point(folder))} has {room}{need})"


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
    hash of every entry of ``state``, tensors and plain values alike (a learning rate, a step
    count), so that :func:`load_checked` can tell a file whose bytes changed."""
    import torch

    with atomic(path, "wb", size=_tensor_bytes(state)) as f:
        torch.save({"state": state, "sha256": _hashes(state)}, f)
    return Path(path)


def load_checked(path: str | os.PathLike) -> dict:
    """The ``state`` :func:`save_checked` wrote, after checking every entry's hash. ``ValueError``
    (one line) for a file that is not such a checkpoint or whose bytes changed. ``torch.load`` runs
    with ``weights_only=True``: only tensors and plain containers are unpickled, so a file from an
    untrusted source cannot run code."""
    import torch

    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or set(data) != {"state", "sha256"} or not isinstance(data["sha256"], dict):
        raise ValueError("not a checked checkpoint (no content hashes)")
    found = _hashes(data["state"])
    if found.keys() != data["sha256"].keys():
        raise ValueError("its entries are not the ones it was saved with")
    if bad := [k for k, h in found.items() if data["sha256"][k] != h]:
        raise ValueError(f"{len(bad)} entries changed since it was saved (first: {bad[0]}): the file is corrupt")
    return data["state"]


def _hashes(obj, prefix: str = "") -> dict[str, str]:
    """A SHA-256 per leaf of ``obj``, keyed by its path: a tensor's bytes with its dtype and shape,
    or a plain value's type and repr (``0.003`` and ``0.5`` differ, so do ``2`` and ``2.0``)."""
    import hashlib

    import torch

    out: dict[str, str] = {}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # the bytes, whatever the dtype
        out[prefix or "."] = hashlib.sha256(raw + str((t.dtype, tuple(t.shape))).encode()).hexdigest()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out |= _hashes(v, f"{prefix}/{k if isinstance(k, str) else repr(k)}")
    elif isinstance(obj, (list, tuple)):
        out[f"{prefix}#"] = hashlib.sha256(f"{type(obj).__name__}:{len(obj)}".encode()).hexdigest()
        for i, v in enumerate(obj):
            out |= _hashes(v, f"{prefix}/{i}")
    else:
        out[prefix or "."] = hashlib.sha256(f"{type(obj).__name__}:{obj!r}".encode()).hexdigest()
    return out


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj``: the least a file holding them takes."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
