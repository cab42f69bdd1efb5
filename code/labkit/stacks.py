"""Stack attribution: which line of code allocated a storage, and which lab line called it there.

``Ledger(..., stacks=True)`` calls :func:`origin` on every allocation and keeps two strings per
storage: ``where``, the innermost frame outside torch, the standard library and labkit's
instruments, and ``called_from``, the lab line that called labkit's model code when ``where`` is
inside it (a tensor born in ``models.py`` is named by that line *and* by the lab line that ran the
model). :func:`live_by_origin` groups what is alive by category and by both lines, largest first:
the table a leak hunt starts from (Lab 12).
"""

from __future__ import annotations

import linecache
import sys

#: labkit's model code: a tensor born there is named by that line and by the lab line that called
#: it. Every other labkit module is an instrument, never where a tensor comes from.
MODEL_CODE = frozenset({"models.py", "diffusion.py", "zoo.py"})


def origin() -> dict[str, str | None]:
    """``where`` and ``called_from`` for an allocation happening now.

    Walks the live frames and reads a source line only for the frames it returns: it runs on every
    allocation, so it must stay cheap.
    """
    where = None
    frame = sys._getframe(1)
    while frame is not None:
        f = frame.f_code.co_filename.replace("\\", "/")
        library = "/torch/" in f or "/lib/python3" in f or f.startswith("<frozen")
        if not library and "/labkit/" not in f:  # the lab's own code (or a test's)
            line = frame_line(frame)
            return {"where": where or line, "called_from": line if where else None}
        if not library and where is None and f.rsplit("/", 1)[-1] in MODEL_CODE:
            where = frame_line(frame)  # labkit's model code: walk on to the lab line that called it
        frame = frame.f_back
    return {"where": where, "called_from": None}


def frame_line(frame) -> str:
    """``"file.py:123 in fn: the code"`` for a frame."""
    name = frame.f_code.co_filename.replace("\\", "/").rsplit("/", 1)[-1]
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}: {line}"


def live_by_origin(ledger) -> list[dict]:
    """What ``ledger`` holds alive now, grouped by scope, category, the line that allocated it and
    the lab line that called it there (``called_from``; None when that line is the lab's own),
    largest first. Needs ``Ledger(..., stacks=True)``; without it every origin reads "unknown"."""
    groups: dict[tuple, dict] = {}
    for rec in ledger.live_records():
        key = (ledger.scope_of(rec), ledger.category_of(rec), rec.where or "unknown", rec.called_from)
        g = groups.setdefault(key, {"scope": key[0], "category": key[1], "where": key[2],
                                    "called_from": key[3], "bytes": 0, "tensors": 0})
        g["bytes"] += rec.nbytes
        g["tensors"] += 1
    return sorted(groups.values(), key=lambda g: -g["bytes"])
