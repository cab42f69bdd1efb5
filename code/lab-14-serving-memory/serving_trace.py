"""Lab 14 - request traces: drawn from stated distributions with a seed, or read from a JSON-lines file.

A trace is what a server is asked to do: when each request arrives (in engine steps), how long its
prompt is, how many tokens it will generate, and optionally which shared prefix (a system prompt)
its prompt starts with. One request per line of a trace file::

    {"arrival": 0, "prompt_len": 40, "output_len": 24}
    {"arrival": 3, "prompt_len": 72, "output_len": 10, "prefix": "system", "prefix_len": 32}

``arrival`` is the engine step the request arrives at (a number >= 0; a fraction arrives at the next
whole step), ``prompt_len`` and ``output_len`` are whole numbers >= 1, and a request with ``prefix``
shares its first ``prefix_len`` prompt tokens (<= ``prompt_len``) with every request of that prefix.
Token ids are not part of a trace: they are drawn from the seed (the same prefix gives the same
tokens), since memory depends on lengths alone and greedy decoding makes the outputs deterministic.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from labkit import files
from labkit.config import MAX_BATCH, UsageError


@dataclass(frozen=True)
class Request:
    id: int
    arrival: int  # the engine step it arrives at
    prompt_len: int
    output_len: int
    prefix: str | None = None  # requests with the same prefix share its first prefix_len prompt tokens
    prefix_len: int = 0


def generate(*, requests: int, seed: int, arrival_rate: float, prompt_lens: tuple[int, int],
             output_lens: tuple[int, int], system_prompt: int = 0) -> list[Request]:
    """A seeded trace: Poisson arrivals (``arrival_rate`` requests per engine step on average),
    prompt and output lengths uniform over the closed ranges ``prompt_lens`` and ``output_lens``;
    with ``system_prompt`` > 0 every prompt starts with the same ``system_prompt`` tokens (prefix
    ``"system"``), added to its own length."""
    rng = random.Random(seed)
    clock, out = 0.0, []
    for i in range(requests):
        clock += rng.expovariate(arrival_rate) if i else 0.0
        prompt, output = rng.randint(*prompt_lens), rng.randint(*output_lens)
        out.append(Request(i, math.ceil(clock), system_prompt + prompt, output,
                           "system" if system_prompt else None, system_prompt))
    return out


#: the most bytes a trace file may have, and requests in it (as --requests): a run can serve them all
TRACE_BYTES, TRACE_REQUESTS = 64 << 20, MAX_BATCH


def read(path: Path) -> list[Request]:
    """The requests of a JSON-lines trace file; UsageError naming the line for anything wrong.

    Read with limits (:func:`labkit.files.read_text`: a regular file, no FIFO or device, at most
    ``TRACE_BYTES``), split on ``\\n`` alone (a U+2028 inside a string is text, not a line break),
    each line parsed with a depth limit and no number beyond a 64-bit integer."""
    text = files.read_text(path, "--trace", TRACE_BYTES)
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"--trace {files.shown(path)}, line {number}"
        entry = files.parse_json(line, where, depth=2)
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: each line must be a JSON object")
        if len(out) == TRACE_REQUESTS:
            raise UsageError(f"{where}: more than the {TRACE_REQUESTS:,} requests a trace may have")
        out.append(_request(len(out), entry, where))
    if not out:
        raise UsageError(f"--trace {files.shown(path)}: no requests in it")
    check_prefixes(out)
    return out


def _request(i: int, entry: dict, where: str) -> Request:
    unknown = set(entry) - {"arrival", "prompt_len", "output_len", "prefix", "prefix_len"}
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    for key in ("arrival", "prompt_len", "output_len"):
        if key not in entry:
            raise UsageError(f"{where}: no {key}")
    arrival = entry["arrival"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival < 2**53:
        raise UsageError(f"{where}: arrival must be a number of steps >= 0, got {arrival!r:.60}")

    def whole(key: str, least: int) -> int:
        value = entry.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value < 2**40:
            raise UsageError(f"{where}: {key} must be a whole number >= {least}, got {value!r:.60}")
        return value

    prompt, output, prefix_len = whole("prompt_len", 1), whole("output_len", 1), whole("prefix_len", 0)
    prefix = entry.get("prefix")
    if prefix is not None and (not isinstance(prefix, (str, int)) or isinstance(prefix, bool) or len(str(prefix)) > 200):
        raise UsageError(f"{where}: prefix must be a name or a number (of at most 200 characters), "
                         f"got {str(prefix)[:40]!r}")
    if prefix_len > prompt or (prefix_len and prefix is None):
        raise UsageError(f"{where}: prefix_len {prefix_len} needs a prefix and at most prompt_len ({prompt}) tokens")
    return Request(i, math.ceil(arrival), prompt, output, None if prefix is None else str(prefix), prefix_len)


def write(path: Path, requests: list[Request]) -> None:
    """Write ``requests`` as a trace file that :func:`read` reads back."""
    def line(r: Request) -> str:
        entry = {"arrival": r.arrival, "prompt_len": r.prompt_len, "output_len": r.output_len}
        if r.prefix is not None:
            entry |= {"prefix": r.prefix, "prefix_len": r.prefix_len}
        return json.dumps(entry)
    Path(path).write_text("".join(line(r) + "\n" for r in requests), encoding="utf-8")


def check_prefixes(requests: list[Request]) -> None:
    """Every request of one prefix must name the same prefix length."""
    lengths: dict[str, int] = {}
    for r in requests:
        if r.prefix is not None and lengths.setdefault(r.prefix, r.prefix_len) != r.prefix_len:
            raise UsageError(f"--trace: prefix {r.prefix!r} has lengths {lengths[r.prefix]} and {r.prefix_len}")


def prompt_tokens(request: Request, vocab: int, seed: int) -> list[int]:
    """The token ids of a request's prompt: its prefix's (the same for every request of that prefix),
    then its own, drawn from ``seed``."""
    shared = random.Random(f"{seed}:prefix:{request.prefix}")
    own = random.Random(f"{seed}:request:{request.id}")
    return ([shared.randrange(vocab) for _ in range(request.prefix_len)]
            + [own.randrange(vocab) for _ in range(request.prompt_len - request.prefix_len)])
