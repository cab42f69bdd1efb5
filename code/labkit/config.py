"""One typed configuration per lab: a dataclass whose fields are the lab's flags.

A lab writes its knobs once, with their defaults, their help and their bounds::

    @dataclass
    class Config(LabConfig):
        steps: int = option(6, "steps in this run", min=1)
        lr: float = option(3e-3, "AdamW learning rate", above=0)
        zero_grad: Literal["none", "zeros", "skip"] = option("none", "how gradients are cleared")

        def __post_init__(self):
            super().__post_init__()          # types, bounds and choices of every field
            if self.width % self.heads:      # then the lab's own rules, in one place
                raise UsageError(...)

``Config(...)`` is then the one door into the lab: the command line is built from the dataclass
(:func:`labkit.cli.main`), and notebooks, benchmarks, tests and other labs call
``run(Config(steps=3))``. Bad input raises :class:`UsageError` whose message names the flag
(``--steps must be 1 or more, got 0``), whichever way it came in. Whole numbers must fit int64, so a
size of 10**30 is refused here, before anything is allocated; a float must be finite and not
subnormal (below 2.2e-308 a number has lost its precision, and 1/x overflows).

A path field says what the run does with it (``path="read"``, ``"write"`` or ``"folder"``), and is
checked here, before any work: a name the file system cannot hold (a part over 255 bytes, a path
over 4,095), a file to read that is missing, a folder or a device or a pipe, a target that could
not be written (see :func:`labkit.files.check_target`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

INT64_MAX = 2**63 - 1

# Ceilings every lab's sizes share: above every published model and every run a lab can finish, far
# below what overflows torch's int64 sizes. A flag that sizes an allocation or a loop takes one as
# its ``max``, so ``--layers 9223372036854775807`` is one line here, not a hang. Inside them, a run
# may still be beyond the machine: the lab's memory floor (labkit.budget) refuses that, and torch's
# own refusal is one line too (labkit.cli.main).
MAX_LAYERS = 1 << 10  # 1,024 blocks; Llama-3.1-405B has 126, GPT-3 96
MAX_WIDTH = 1 << 17  # 131,072 features (hidden, MLP, head); GPT-3 is 12,288 wide, its MLP 49,152
MAX_HEADS = 1 << 12  # 4,096 attention heads; Llama-3.1-405B has 128
MAX_TOKENS = 1 << 24  # 16,777,216 tokens in one sequence, prompt or pool; Llama 3.1's context is 131,072
MAX_VOCAB = 1 << 22  # 4,194,304 tokens; Gemma's vocabulary is 262,144
MAX_BATCH = 1 << 16  # 65,536 sequences (or requests) at once
MAX_STEPS = 100_000  # steps, iterations, repeats: what a lab's loop can finish
MAX_EXPERTS = 1 << 12  # 4,096 experts per layer; DeepSeek-V3 has 256
MAX_PARAMS = 1 << 50  # 1.1e15 parameters; the largest published models have about 1e12
MAX_COUNT = 1 << 20  # how many of a thing: saved tensors, table rows, buffers
MAX_THREADS = 1 << 12  # CPU threads
MAX_LR = 1e3  # a learning rate (or a weight decay) beyond any that trains
MAX_RANKS = 1 << 20  # 1,048,576 ranks along one parallel dimension
MAX_BYTES = 1 << 50  # 1 PiB; MiB-sized flags take MAX_BYTES >> 20
MAX_SECONDS = 86_400  # a day: a time-out no lab step needs more than


class UsageError(ValueError):
    """Bad input from the user: reported as one line on stderr, exit code 2."""


def option(default: Any = None, help: str = "", *, min: float | None = None, above: float | None = None,
           max: float | None = None, below: float | None = None, parse=None, metavar: str | None = None,
           positional: bool = False, path: Literal["read", "write", "folder"] | None = None):
    """A config field: its default, its ``--help`` text and its bounds.

    ``min``/``max`` are inclusive bounds, ``above``/``below`` exclusive ones (a learning rate is
    ``above=0``). ``parse(text) -> value`` reads the flag's text where the type alone cannot (a byte
    budget such as ``24MiB``); it raises ``ValueError`` with a message for bad text. The type, and
    with it the choices of a ``Literal``, comes from the field's annotation. ``positional``: given
    without a flag (a ``tuple`` field takes any number of them: ``run_notebooks.py lab-02 lab-08``).
    ``path`` (a ``Path`` field): ``"read"`` a regular file that exists, ``"write"`` a file to create
    or replace, ``"folder"`` a folder to write into; checked when the config is made.
    """
    meta = {"help": help, "min": min, "above": above, "max": max, "below": below, "parse": parse,
            "metavar": metavar, "positional": positional, "path": path}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for a default sequence")
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    """``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


@dataclass
class LabConfig:
    """What every lab takes: where to run, and the seed."""

    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "where to run: auto picks cuda when a GPU is present, else cpu")
    seed: int = option(0, "random seed", min=0, max=2**32 - 1)

    def __post_init__(self) -> None:
        check_fields(self)


def fields_of(config_cls) -> list[tuple[dataclasses.Field, Any]]:
    """Each field of a config class with its resolved type."""
    hints = typing.get_type_hints(config_cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(config_cls) if f.init]


def split_optional(kind) -> tuple[Any, bool]:
    """``int | None`` -> ``(int, True)``; ``int`` -> ``(int, False)``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(kind)) == 2:
            return args[0], True
    return kind, False


def choices_of(kind) -> tuple | None:
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def check_fields(config) -> None:
    """Types, bounds and choices of every field; converts what is unambiguous (a str to a Path, an
    int to a float where a float is asked for). Raises UsageError naming the flag."""
    for f, kind in fields_of(type(config)):
        value = getattr(config, f.name)
        base, optional = split_optional(kind)
        if value is None:
            if optional:
                continue
            raise UsageError(f"{flag(f.name)} needs a value")
        setattr(config, f.name, _check(flag(f.name), value, base, f.metadata))


def _check(name: str, value, kind, meta) -> Any:
    choices = choices_of(kind)
    if choices is not None:
        if value not in choices:
            raise UsageError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise UsageError(f"{name} is a switch (True or False), got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{name} must be a whole number, got {value!r}")
        if abs(value) > INT64_MAX:
            raise UsageError(f"{name} {value:.3g} does not fit a 64-bit integer: no tensor can be that large")
        return _bounded(name, value, meta)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{name} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise UsageError(f"{name} must be a finite number, got {value}")
        if value and abs(value) < sys.float_info.min:
            raise UsageError(f"{name} {value:g} is subnormal (closer to 0 than {sys.float_info.min:.3g}): "
                             f"too small to compute with; give 0 or a larger number")
        return _bounded(name, value, meta)
    if kind is str:
        if not isinstance(value, str):
            raise UsageError(f"{name} must be text, got {value!r}")
        return value
    if kind is Path:
        if isinstance(value, str):
            value = Path(value)
        if not isinstance(value, Path) or not str(value).strip():
            raise UsageError(f"{name} must be a path, got {value!r}")
        from labkit import files

        return files.check_path(value, name, meta.get("path"))
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        if isinstance(value, (list, tuple)):
            if not value and not meta.get("positional"):
                raise UsageError(f"{name} needs at least one value")
            return tuple(_check(name, v, item, meta) for v in value)
        raise UsageError(f"{name} must be a list of values, got {value!r}")
    return value  # another type: the lab's __post_init__ checks it


def _bounded(name: str, value, meta):
    lo, hi, above, below = meta.get("min"), meta.get("max"), meta.get("above"), meta.get("below")
    if lo is not None and value < lo:
        raise UsageError(f"{name} must be {_range(lo, hi)}, got {value}")
    if hi is not None and value > hi:
        raise UsageError(f"{name} must be {_range(lo, hi)}, got {value}")
    if above is not None and value <= above:
        raise UsageError(f"{name} must be above {above:g}, got {value}")
    if below is not None and value >= below:
        raise UsageError(f"{name} must be below {below:g}, got {value}")
    return value


def _range(lo, hi) -> str:
    if hi is None:
        return f"{_num(lo)} or more"
    if lo is None:
        return f"{_num(hi)} or less"
    return f"in [{_num(lo)}, {_num(hi)}]"


def _num(x) -> str:
    """A bound as a reader writes it: 4,096 and 1,048,576 for whole numbers, 1e-06 for small floats."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 2**63 else f"{x:g}"


def summary_of(config) -> dict:
    """The config as JSON-ready values (Paths as text)."""
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(config).items()}
