"""The one command-line pattern every lab uses: flags built from the lab's ``Config``.

A lab ends with::

    if __name__ == "__main__":
        cli.main(Config, run, report)

:func:`main` builds an argparse parser from the dataclass (one ``--flag`` per field, its help and
choices from the field, plus ``--json``), makes the ``Config`` (whose ``__post_init__`` holds every
rule), calls ``run(config)``, and prints ``report(result)`` or, under ``--json``, the one JSON object
``result.summary()``. What the report prints is fitted to the terminal (:func:`fitted_stdout`):
tables fit themselves (:meth:`labkit.table.Table.text`), and every longer line is wrapped at its
spaces; ``--json`` is printed whole. Bad input of any kind, a :class:`UsageError` raised anywhere in the run, and
an out-of-memory error (sizes the machine cannot hold) are one line on stderr and exit code 2, never
a traceback.

Also here: :func:`pick_device` (``auto|cpu|cuda``; it only resolves, it launches nothing), which
on the CPU also settles how many intra-op threads the run uses (:func:`cpu_threads`, the one rule
every lab follows), and :func:`progress`, a bar that appears only on runs longer than two seconds
and never under ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from labkit.config import UsageError, choices_of, fields_of, flag, split_optional
from labkit.table import terminal_width, wrap

__all__ = ["UsageError", "main", "parser", "parse", "argv", "pick_device", "cpu_threads", "progress", "emit_json",
           "fitted_stdout"]


class LabArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line (no usage block) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _reader(kind, meta):
    """The argparse ``type=`` for a field: reads the text; the bounds are the Config's to check."""
    parse = meta.get("parse")
    if parse is not None:
        def read(text: str):
            try:
                return parse(_ascii_number(text))
            except ValueError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
        return read
    if typing.get_origin(kind) is tuple:
        item = _reader(typing.get_args(kind)[0], {})
        return lambda text: tuple(item(part.strip()) for part in text.split(",") if part.strip())
    if kind in (int, float):
        what = "a whole number" if kind is int else "a number"

        def number(text: str):
            try:
                return kind(_ascii_number(text))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        return number
    if kind is Path:
        def path(text: str) -> Path:
            if not text.strip():
                raise argparse.ArgumentTypeError("expected a path, got an empty one")
            return Path(text)
        return path
    return str


def _ascii_number(text: str) -> str:
    """``text`` if it is written in ASCII: Python's ``int("١٢")`` is 12 and ``float("１.５")`` 1.5,
    but a number on a command line is written with the digits 0-9."""
    if not text.isascii():
        raise ValueError(f"write numbers with the ASCII digits 0-9, got {text!r}")
    return text


_METAVAR = {int: "N", float: "X", Path: "PATH", str: "TEXT", tuple: "A,B,..."}


def parser(config_cls, prog: str | None = None) -> LabArgumentParser:
    """A parser with one flag per field of ``config_cls``, and ``--json``."""
    doc = (config_cls.__doc__ or "").strip().split("\n\n")[0]
    p = LabArgumentParser(prog=prog, description=" ".join(doc.split()) or None)
    for f, kind in fields_of(config_cls):
        meta = f.metadata
        base, _ = split_optional(kind)
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = default if not isinstance(default, tuple) else ",".join(map(str, default))
        help_text = meta.get("help", "")
        if base is bool:
            p.add_argument(flag(f.name), action="store_true", dest=f.name, help=help_text)
            continue
        choices = choices_of(base)
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "metavar": meta.get("metavar") or _METAVAR.get(
            typing.get_origin(base) or base, "TEXT")}
        if choices is not None:
            kwargs["choices"] = list(choices)
            kwargs["type"] = _reader(type(choices[0]), {}) if type(choices[0]) in (int, float) else type(choices[0])
            kwargs.pop("metavar")
        else:
            kwargs["type"] = _reader(base, meta)
        if shown not in (None, "") and "default:" not in help_text:
            help_text = f"{help_text} (default: {shown})" if help_text else f"default: {shown}"
        if meta.get("positional"):
            many = typing.get_origin(base) is tuple
            kwargs.pop("dest")
            kwargs["type"] = _reader(typing.get_args(base)[0], {}) if many else kwargs["type"]
            p.add_argument(f.name, nargs="*" if many else "?" if default is not None else None, help=help_text,
                           **{**kwargs, "metavar": meta.get("metavar") or f.name.upper()})
            continue
        p.add_argument(flag(f.name), help=help_text, **kwargs)
    p.add_argument("--json", action="store_true", help="print one JSON summary object and nothing else on stdout")
    return p


def parse(config_cls, argv: list[str] | None = None, prog: str | None = None):
    """``(config, as_json)`` from the command line; bad input exits 2 with one line."""
    args = vars(parser(config_cls, prog).parse_args(argv))
    as_json = args.pop("json")
    return config_cls(**args), as_json


def argv(config) -> list[str]:
    """The arguments that make ``config`` on the command line (each field that differs from its
    default): the inverse of :func:`parse`, for starting a lab in other processes (torchrun)."""
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            if not value:
                raise ValueError(f"{flag(f.name)} is a switch that is on by default: no flag turns it off")
            out.append(flag(f.name))
        elif f.metadata.get("positional"):
            out += [str(v) for v in value] if isinstance(value, tuple) else [str(value)]
        else:
            out += [flag(f.name), ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return out


def main(config_cls, run: Callable, report: Callable | None = None, argv: list[str] | None = None,
         prog: str | None = None) -> None:
    """The command line of a lab.

    ``config_cls``: the lab's ``Config`` dataclass; ``run(config)``: the lab, returning a result
    with a ``summary()`` (a JSON-ready dict) or the dict itself; ``report(result)``: prints the
    result for a human (without it, the summary is printed as JSON); ``argv``: the arguments
    (default ``sys.argv[1:]``); ``prog``: the name in error messages (default: the script's).
    """
    global _quiet
    name = _prog(prog)
    try:
        config, as_json = parse(config_cls, argv, name)
        _quiet = as_json
        device = getattr(config, "device", None)
        if isinstance(device, str):  # before anything runs: no GPU is one line (a notebook kernel, a rank),
            pick_device(device)  # and a CPU run has its thread count, whichever path the lab takes
        if as_json or report is None:
            result = run(config)
            emit_json(result.summary() if hasattr(result, "summary") else result)
        else:
            with fitted_stdout():  # what the run and its report print, fitted to the terminal
                report(run(config))
    except UsageError as err:
        print(f"{name}: error: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None
    except (MemoryError, RuntimeError) as err:
        if not _out_of_memory(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"{name}: error: out of memory ({first[:160]}); ask for smaller sizes", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # the reader stopped reading (`--json | head`): nothing is wrong with the run
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        raise SystemExit(STOPPED_READING) from None


class _FittedLines(io.TextIOBase):
    """A text stream that passes each whole line written to it through :func:`labkit.table.wrap`."""

    def __init__(self, out, width: int) -> None:
        self._out, self._width, self._partial = out, width, ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._out.write(wrap(line, self._width) + "\n")
        return len(text)

    def flush(self) -> None:  # a line not ended yet goes out as it is (a prompt, or before a subprocess writes)
        if self._partial:
            self._out.write(self._partial)
            self._partial = ""
        self._out.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._out.isatty()

    def fileno(self) -> int:
        return self._out.fileno()

    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self._out, "encoding", "utf-8")


@contextlib.contextmanager
def fitted_stdout(width: int | None = None):
    """Inside, every line printed to stdout fits ``width`` columns (default: the terminal's,
    :func:`labkit.table.terminal_width`): a longer one is wrapped at its spaces, words whole."""
    stream = _FittedLines(sys.stdout, width or terminal_width())
    try:
        with contextlib.redirect_stdout(stream):
            yield stream
    finally:
        stream.flush()


def _one_line(err: BaseException) -> str:
    """The message on one line, whatever it holds (a file name may hold a newline)."""
    return str(err).replace("\r", "\\r").replace("\n", "\\n")


def _prog(prog: str | None) -> str:
    return prog or (sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "lab")


def _out_of_memory(err: BaseException) -> bool:
    """The allocator could not serve a request: CUDA's OutOfMemoryError, or the CPU allocator's."""
    if isinstance(err, MemoryError):
        return True
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(err, oom) or any(sign in str(err) for sign in TOO_LARGE)


#: what torch says when sizes that passed a Config are beyond the allocator (or beyond int64 bytes)
TOO_LARGE = ("can't allocate memory", "Storage size calculation overflowed", "numel: integer multiplication overflow")


def pick_device(name: str):
    """Resolve ``auto|cpu|cuda`` (or ``cuda:N``) to a ``torch.device``; UsageError if impossible.

    It only resolves: nothing runs on the GPU here (the ledger and ``labkit.cuda.reset_peak`` warm
    the GPU up when a measurement begins). When the answer is the CPU, the run's thread count is
    settled here by :func:`cpu_threads`: every lab's ``run``, its command line, a notebook's
    ``labkit.notebook.setup`` and ``labs.load(N).run(Config(...))`` all pass through this door."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        cpu_threads()
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda was asked for, but no CUDA GPU is available (use --device cpu or auto)")
        device = torch.device(name)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
        return torch.device("cuda", index)
    raise UsageError(f"unknown device {name!r}: choose auto, cpu or cuda")


#: environment variables through which a reader sets PyTorch's intra-op thread count at start
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_torch_threads: int | None = None  # PyTorch's count before labkit first chose one (None: not yet)


def cpu_threads(threads: int | None = None) -> int:
    """Settle the intra-op thread count of a CPU run, by the rule every lab follows; returns it.

    Why: the labs' CPU configurations are tiny, each op a few microseconds to a few milliseconds.
    PyTorch starts one intra-op thread per core and splits an op over them, and the op ends when
    its slowest thread does. When other processes keep a core busy (a test suite, a browser, a
    second lab), a thread waits its turn for that core, and a few-millisecond step can take about a
    second (``bench/cpu_threads_bench.py`` measures it; the performance page shows it). On one
    thread the same step waits for no one. So a CPU run of a lab uses:

    * ``threads``, when a lab's own option asks for a count (Lab 08's ``--threads``); 0 asks for
      PyTorch's own count, the one the process started with (one per core, or the environment's);
    * else, if ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` is set, the count PyTorch read from it:
      the reader asked for it (torchrun, and ``labkit.dist`` for its ranks, set 1 per rank);
    * else one thread, chosen once per process: the first CPU run picks it, and afterwards the
      count is the reader's (``torch.set_num_threads(4)`` in a notebook holds for later runs).

    A GPU run is left alone: its host-side work (Lab 07's CPU AdamW) keeps every core.
    """
    import torch

    global _torch_threads
    first = _torch_threads is None
    if first:
        _torch_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 0:
            raise UsageError(f"threads must be 0 (PyTorch's own count) or more, got {threads}")
        torch.set_num_threads(threads or _torch_threads)
    elif first and not any(os.environ.get(name) for name in THREAD_VARIABLES):
        torch.set_num_threads(1)
    return torch.get_num_threads()


def emit_json(obj: Any) -> None:
    """Print the single machine-readable summary of a run."""
    print(json.dumps(obj, indent=None, sort_keys=False, default=_json_default))


def _json_default(obj: Any):
    if isinstance(obj, Path):
        return str(obj)
    try:
        import torch

        if isinstance(obj, torch.device):
            return str(obj)
        if isinstance(obj, torch.dtype):
            return str(obj).replace("torch.", "")
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


_quiet = False  # set by main() under --json
#: exit code when whoever reads the output closes it early, as a shell reports a SIGPIPE: 128 + 13
STOPPED_READING = 141


def answers_in_json() -> bool:
    """Whether the command ``main`` is running was given ``--json`` (its output is one JSON
    document, so nothing else may print: no progress bar; a launcher passes the flag on)."""
    return _quiet


def progress(iterable: Iterable, total: int | None = None, desc: str = "", quiet: bool = False):
    """A progress bar on stderr that shows itself only if the run lasts more than two seconds, only
    on a terminal (a notebook or a log gets no bar), and never under ``--json``."""
    from tqdm import tqdm

    on_terminal = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, disable=_quiet or quiet or not on_terminal, delay=2.0,
                leave=False, file=sys.stderr)
