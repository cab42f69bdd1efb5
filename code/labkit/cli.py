"""The one command-line pattern every lab uses.

* ``lab_parser`` gives the common flags (``--device {auto,cpu,cuda}``, ``--json``, ``--seed``) and
  a parser whose errors are one line on stderr with exit code 2 (argparse's usage block is left out).
* ``run_lab(main)`` runs a lab's ``main`` and turns a :class:`UsageError` into that same one line
  and exit code 2, never a traceback; so too an out-of-memory error, whose cause is sizes asked
  for that the machine cannot hold.
* ``pick_device`` resolves ``auto`` and refuses ``cuda`` on a machine without a GPU; on a GPU it
  lets cuBLAS take its workspaces at once (``labkit.cuda.warm_up``), before anything is measured.
* ``progress`` is a tqdm bar that only appears on runs longer than a couple of seconds and is
  silent under ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any


class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr, exit code 2."""


class LabArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line (no usage block) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(convert, ok, what: str):
    """An argparse ``type=`` that converts and checks, with a message that says what is wrong."""
    kind = "a whole number" if convert is int else "a number"

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


positive_int = _number(int, lambda v: v > 0, "a positive whole number")
non_negative_int = _number(int, lambda v: v >= 0, "0 or more")
positive_float = _number(float, lambda v: v > 0, "a positive number")
non_negative_float = _number(float, lambda v: v >= 0, "0 or more")
probability = _number(float, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
seed_int = _number(int, lambda v: 0 <= v < 2**32, "a whole number in [0, 2**32)")


def lab_parser(description: str, prog: str | None = None) -> LabArgumentParser:
    """A parser with the flags every lab shares."""
    parser = LabArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to run: auto picks cuda when a GPU is present, else cpu (default: auto)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON summary object and nothing else on stdout"
    )
    parser.add_argument("--seed", type=seed_int, default=0, help="random seed (default: 0)")
    return parser


def pick_device(name: str):
    """Resolve ``auto|cpu|cuda`` (or ``cuda:N``) to a ``torch.device``; UsageError if impossible."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda was asked for, but no CUDA GPU is available (use --device cpu or auto)")
        device = torch.device(name)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
        from labkit.cuda import warm_up

        device = torch.device("cuda", index)
        warm_up(device)  # cuBLAS workspaces taken now, before any measurement (see labkit.cuda)
        return device
    raise UsageError(f"unknown device {name!r}: choose auto, cpu or cuda")


def run_lab(main: Callable[[list[str] | None], Any], argv: list[str] | None = None, prog: str | None = None) -> None:
    """Run ``main(argv)``; a UsageError becomes one line on stderr and exit code 2."""
    try:
        main(argv)
    except UsageError as err:
        print(f"{_prog(prog)}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except (MemoryError, RuntimeError) as err:
        if not _out_of_memory(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"{_prog(prog)}: error: out of memory ({first[:160]}); ask for smaller sizes", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def _prog(prog: str | None) -> str:
    return prog or (sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "lab")


def _out_of_memory(err: BaseException) -> bool:
    """The allocator could not serve a request: CUDA's OutOfMemoryError, or the CPU allocator's."""
    if isinstance(err, MemoryError):
        return True
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(err, oom) or "can't allocate memory" in str(err)


def emit_json(obj: Any) -> None:
    """Print the single machine-readable summary of a run."""
    print(json.dumps(obj, indent=None, sort_keys=False, default=_json_default))


def _json_default(obj: Any):
    try:
        import torch

        if isinstance(obj, torch.device):
            return str(obj)
        if isinstance(obj, torch.dtype):
            return str(obj).replace("torch.", "")
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def progress(iterable: Iterable, total: int | None = None, desc: str = "", quiet: bool = False):
    """A progress bar that shows itself only if the run lasts more than two seconds."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=quiet, delay=2.0, leave=False, file=sys.stderr)
