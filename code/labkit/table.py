"""One table renderer for the console, the notebooks and the site; one way to write bytes.

A :class:`Table` holds raw values (numbers stay numbers) and a kind per column. The same object
prints aligned in a terminal (:meth:`Table.text`), shows as Markdown in a notebook and is written
into a lab's results JSON (:meth:`Table.to_dict`), from which the site's build hook renders it
again with :meth:`Table.markdown`. So a page and the command line cannot disagree on a number, and
a page never includes text a notebook generated.

Column kinds (``("peak total", "bytes")``; a bare name is ``text``):

==============  ======================================  ============
kind            shows                                   example
==============  ======================================  ============
``text``        the value, escaped for Markdown          ``forward``
``code``        the value as inline code                 ```none```
``bytes``       bytes in the table's unit                ``1.53 MiB``
``size``        bytes, each cell in its own unit         ``33.00 KiB``
``B``           exact bytes                              ``3,149,824 B``
``+B``          a signed difference of bytes             ``+512 B``
``int``         a whole number with separators           ``131,072``
``float:N``     N decimals                               ``0.9981``
``pct:N``       a fraction as a percentage               ``61.4 %``
``x:N``         a ratio                                  ``2.85x``
``sci:N``       scientific notation                      ``3.1e-07``
``yes``         True/False as yes/no                     ``yes``
==============  ======================================  ============

This module imports neither torch nor matplotlib: the site build uses it.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field

UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def pick_unit(max_bytes: float) -> tuple[str, int]:
    """The largest binary unit that ``max_bytes`` reaches."""
    for name, size in UNITS:
        if max_bytes >= size:
            return name, size
    return "B", 1


def format_bytes(n: float, unit: str | None = None, digits: int = 2) -> str:
    """``format_bytes(3 * 2**20) == '3.00 MiB'``; exact integers below 1 KiB."""
    if unit is None:
        unit, size = pick_unit(abs(n))
    else:
        size = dict(UNITS)[unit]
    if n == 0:
        return "0"
    if size == 1:
        return f"{int(n)} B"
    return f"{n / size:.{digits}f} {unit}"


#: Markdown's punctuation, written as character references: a value shows as the same text and builds
#: nothing (a link, an image, an attribute list, an emoji, emphasis, a code span); ``==`` and ``++`` are
#: the mark and keys extensions' markers, harmless alone
_MARKDOWN = {ord(c): f"&#{ord(c)};" for c in "\\`*_[]{}!:"}


def escape(text: str) -> str:
    """Text safe inside Markdown, a table cell included: HTML escaped, Markdown's punctuation written
    as character references (``[x](javascript:...)`` and ``![p](http://...)`` stay text: no link, no
    request), pipes and line breaks neutralised."""
    out = html.escape(str(text), quote=False).translate(_MARKDOWN)
    return out.replace("==", "&#61;&#61;").replace("++", "&#43;&#43;").replace("|", "\\|").replace("\n", " ")


_NUMERIC = ("bytes", "size", "B", "+B", "int", "float", "pct", "x", "sci")


@dataclass
class Table:
    """Rows of raw values under typed columns.

    ``columns``: names, or ``(name, kind)`` pairs; ``rows``: one list of values per row;
    ``unit``: the unit of ``bytes`` columns (default: the largest value's); ``strong``: column
    names whose cells are set in bold (a total, say); ``empty``: what a table with no rows says
    under its header (a flat loop has nothing that grew: that is an answer, not an error).
    """

    columns: list
    rows: list[list] = field(default_factory=list)
    unit: str | None = None
    strong: Sequence[str] = ()
    empty: str = "(no rows)"

    def __post_init__(self) -> None:
        self.columns = [tuple(c) if isinstance(c, (list, tuple)) else (c, "text") for c in self.columns]
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"a row has {len(row)} values for {len(self.columns)} columns: {row!r}")

    def add(self, *values) -> Table:
        if len(values) != len(self.columns):
            raise ValueError(f"{len(values)} values for {len(self.columns)} columns")
        self.rows.append(list(values))
        return self

    # ------------------------------------------------------------------ cells
    def _unit(self) -> tuple[str, int]:
        if self.unit:
            return self.unit, dict(UNITS)[self.unit]
        values = [abs(r[i]) for r in self.rows for i, (_, k) in enumerate(self.columns)
                  if k == "bytes" and isinstance(r[i], (int, float))]
        return pick_unit(max(values, default=1))

    def cell(self, value, kind: str, markdown: bool = True) -> str:
        if value is None:
            return "-"
        name, _, digits = kind.partition(":")
        d = int(digits) if digits else None
        if name == "bytes":
            unit, size = self._unit()
            # a value too small for the table's unit keeps its own unit
            return format_bytes(value, unit) if value == 0 or abs(value) >= size / 100 else format_bytes(value)
        if name == "size":
            return format_bytes(value)
        if name == "B":
            return f"{int(value):,} B"
        if name == "+B":
            return f"{int(value):+,} B"
        if name == "int":
            return f"{int(value):,}"
        if name == "float":
            return f"{value:.{4 if d is None else d}f}"
        if name == "pct":
            return f"{100 * value:.{1 if d is None else d}f} %"
        if name == "x":
            return f"{value:.{2 if d is None else d}f}x"
        if name == "sci":
            return f"{value:.{1 if d is None else d}e}"
        if name == "yes":
            return "yes" if value else "no"
        if name == "code":
            return f"`{str(value).replace('`', '')}`" if markdown else str(value)
        return escape(value) if markdown else str(value)

    def _cells(self, markdown: bool) -> list[list[str]]:
        out = []
        for row in self.rows:
            cells = []
            for (name, kind), value in zip(self.columns, row):
                text = self.cell(value, kind, markdown)
                if markdown and name in self.strong and value is not None:
                    text = f"**{text}**"
                cells.append(text)
            out.append(cells)
        return out

    # ------------------------------------------------------------------ renderers
    def markdown(self) -> str:
        head = "| " + " | ".join(escape(n) for n, _ in self.columns) + " |"
        sep = "|" + "".join("---:|" if k.partition(":")[0] in _NUMERIC else "---|" for _, k in self.columns)
        cells = self._cells(True) or [[f"*{escape(self.empty)}*", *("" for _ in self.columns[1:])]]
        return "\n".join([head, sep, *("| " + " | ".join(c) + " |" for c in cells)])

    def text(self) -> str:
        """Aligned columns for a terminal: numbers to the right, text to the left."""
        cells = self._cells(False)
        names = [n for n, _ in self.columns]
        widths = [max([len(names[i]), *(len(r[i]) for r in cells)]) for i in range(len(names))]
        right = [k.partition(":")[0] in _NUMERIC for _, k in self.columns]

        def line(values):
            return "  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)).rstrip()
        body = [line(r) for r in cells] or [self.empty]  # no rows: the header, then what that means
        return "\n".join([line(names), line(["-" * w for w in widths]), *body])

    def _repr_markdown_(self) -> str:  # a notebook shows a Table as Markdown
        return self.markdown()

    def __str__(self) -> str:
        return self.text()

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        out = {"columns": [list(c) for c in self.columns], "rows": self.rows, "unit": self.unit,
               "strong": list(self.strong)}
        if not self.rows:
            out["empty"] = self.empty
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Table:
        return cls(columns=d["columns"], rows=d["rows"], unit=d.get("unit"), strong=tuple(d.get("strong", ())),
                   empty=d.get("empty", "(no rows)"))


def by_category(peaks: dict[str, dict[str, int]], label: str = "phase", categories: Sequence[str] | None = None,
                unit: str | None = None) -> Table:
    """One row per phase (or other ``label``), the total in bold next to it (the column a reader
    looks for first, visible on a phone before the table scrolls), then one ``bytes`` column per
    category that ever holds bytes: the ledger's peaks as a table."""
    from labkit.timeline import CATEGORIES

    cats = [c for c in (categories or CATEGORIES) if any(row.get(c, 0) for row in peaks.values())]
    rows = [[name, sum(v for k, v in row.items() if k in CATEGORIES), *(row.get(c, 0) for c in cats)]
            for name, row in peaks.items()]
    return Table([label, ("total", "bytes"), *((c.replace("_", " "), "bytes") for c in cats)], rows,
                 unit=unit, strong=("total",))
