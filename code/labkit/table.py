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

In a terminal, :meth:`Table.text` fits the table to :func:`terminal_width` (100 columns through
a pipe): a wider table keeps its numbers whole, moves each URL into a numbered note under the
table (the cell keeps ``[1]``) and wraps its text cells and headers within their columns; where
even that cannot fit, it turns (a column per row) or prints each row as a record. :func:`wrap`
fits prose lines to the same width (``labkit.cli.main`` passes every report through it). Markdown
and :meth:`Table.to_dict` never change with the width: pages and results keep their exact text.

This module imports neither torch nor matplotlib: the site build uses it.
"""

from __future__ import annotations

import html
import re
import shutil
import unicodedata
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

# ---------------------------------------------------------------------- the terminal's width
#: columns a line may take when stdout is not a terminal (a pipe, a file, a test, a notebook)
FALLBACK_WIDTH = 100
#: the widest a line gets on a wide terminal: past it, prose and tables are hard to read
MAX_WIDTH = 120
#: the narrowest width honoured: below it a table of a few numbers cannot fit at all
MIN_WIDTH = 40
_GAP = "  "  # between columns
_TEXT_FLOOR = 20  # a text column wider than this may be narrowed down to it, its cells wrapped
_URL = re.compile(r"https?://\S+")
_NOTE = re.compile(r"\s*\[\d+\] https?://\S+")  # a note under a table: never wrapped


def terminal_width() -> int:
    """Columns a terminal line may take: the terminal's width (``$COLUMNS`` first, as
    :func:`shutil.get_terminal_size` reads it), at most :data:`MAX_WIDTH`, at least
    :data:`MIN_WIDTH`; :data:`FALLBACK_WIDTH` when stdout is not a terminal."""
    columns = shutil.get_terminal_size((FALLBACK_WIDTH, 24)).columns
    return max(MIN_WIDTH, min(columns, MAX_WIDTH))


def width_of(text: str) -> int:
    """Terminal columns ``text`` takes: East Asian wide characters take two, combining marks none."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _pad(text: str, width: int, right: bool) -> str:
    fill = " " * max(width - width_of(text), 0)
    return fill + text if right else text + fill


def _cut(word: str, width: int) -> tuple[str, str]:
    """``word`` split so that its head fits ``width`` columns, after a ``/ . _ - : , =`` where one
    falls in the second half of the head (a path or a name breaks where a reader expects)."""
    head, used = "", 0
    for c in word:
        if used + width_of(c) > width and head:
            break
        head, used = head + c, used + width_of(c)
    at = max(head.rfind(c) for c in "/._-:,=")
    if at >= len(head) // 2 and at < len(head) - 1:
        head = head[:at + 1]
    return head, word[len(head):]


def _lines(text: str, width: int, indent: str = "", hanging: str = "", break_words: bool = True) -> list[str]:
    """``text`` filled at its spaces into lines of at most ``width`` columns, the first starting with
    ``indent``, the others with ``hanging``, the spaces between words on a line kept as they were; a
    word longer than a line is cut (``break_words``) or kept whole on a line of its own."""
    lines, line = [], indent
    for space, word in re.findall(r"(\s*)(\S+)", text):
        space = space if space.strip(" ") == "" else " "  # a tab or a line break: one space
        while word:
            if line.strip() and width_of(line) + len(space) + width_of(word) <= width:
                line, word = line + space + word, ""
            elif line.strip():
                lines.append(line)
                line = hanging
            elif width_of(line) + width_of(word) <= width or not break_words or width_of(line) >= width:
                line, word = line + word, ""
            else:
                head, word = _cut(word, width - width_of(line))
                lines.append(line + head)
                line = hanging
    if line.strip() or not lines:
        lines.append(line)
    return lines


def wrap(text: str, width: int | None = None) -> str:
    """Prose fitted to ``width`` columns (default :func:`terminal_width`): each line longer than that
    is filled at its spaces, continuation lines indented two columns past the line's own indent. A
    word is never cut (a URL, a path or a flag stays whole and copyable), and a table's note line
    (``[1] https://...``) is left as it is."""
    width = width or terminal_width()
    out = []
    for line in str(text).split("\n"):
        if width_of(line) <= width or _NOTE.fullmatch(line):
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        out += _lines(line, width, indent, indent + "  ", break_words=False)
    return "\n".join(out)


def _urls_to_notes(text: str, notes: dict[str, int]) -> str:
    """``text`` with each URL replaced by ``[n]``, ``notes`` mapping each URL to its ``n``. A URL
    ends before trailing punctuation, and before a closing bracket it did not open."""
    def note(m: re.Match) -> str:
        url, tail = m.group(), ""
        while url and (url[-1] in ".,;:!?'\"" or (url[-1] in ")]}" and url.count(url[-1]) > url.count(
                {")": "(", "]": "[", "}": "{"}[url[-1]]))):
            url, tail = url[:-1], url[-1] + tail
        return f"[{notes.setdefault(url, len(notes) + 1)}]{tail}"
    return _URL.sub(note, text)


def _grid(names: list[str], head_right: list[bool], cells: list[list[str]], flags: list[list[bool]],
          widths: list[int]) -> list[str]:
    """The lines of a table whose columns have ``widths``: the headers (wrapped where wider than
    their column, at its bottom, aligned by ``head_right``), a ruler, and each row (``flags``: which
    cells are numbers, set right and never wrapped; text wraps within its column, at the top)."""
    def line(values, right):
        return _GAP.join(_pad(v, w, r) for v, w, r in zip(values, widths, right)).rstrip()
    head = [[n] if width_of(n) <= w else _lines(n, w) for n, w in zip(names, widths)]
    tall = max(map(len, head))
    out = [line([([""] * (tall - len(h)) + h)[i] for h in head], head_right) for i in range(tall)]
    out.append(line(["-" * w for w in widths], head_right))
    for row, right in zip(cells, flags):
        wrapped = [[v] if r or width_of(v) <= w else _lines(v, w) for v, w, r in zip(row, widths, right)]
        out += [line([c[i] if i < len(c) else "" for c in wrapped], right) for i in range(max(map(len, wrapped)))]
    return out


def _fit(names: list[str], cells: list[list[str]], flags: list[list[bool]], width: int,
         whole: Sequence[bool] = ()) -> list[int] | None:
    """Column widths within ``width``, or None if even the narrowest do not fit. A header may wrap
    (unless ``whole``: a number), so a column needs only its widest cell and its header's longest
    word; numbers get that, text at least ``_TEXT_FLOOR`` of it, and the columns still short of
    their widest cell share what is left in proportion to what each lacks (prose gets most)."""
    natural, widths = [], []
    for i, name in enumerate(names):
        numbers = [width_of(r[i]) for r, f in zip(cells, flags) if f[i]]
        words = [width_of(r[i]) for r, f in zip(cells, flags) if not f[i]]
        head = [width_of(name)] if i < len(whole) and whole[i] else list(map(width_of, name.split()))
        numbers += head if i < len(whole) and whole[i] else []
        natural.append(max([*numbers, *words, *head, 1]))
        widths.append(max([*numbers, min(natural[i], _TEXT_FLOOR)]) if words else natural[i])
    left = width - len(_GAP) * (len(names) - 1) - sum(widths)
    if left < 0:
        return None
    while left > 0 and any(w < n for w, n in zip(widths, natural)):
        lacking = sum(n - w for w, n in zip(widths, natural))
        shares = [(n - w) * min(left, lacking) // lacking for w, n in zip(widths, natural)]
        if not any(shares):  # the last few columns of room: to the column that lacks most
            shares[max(range(len(widths)), key=lambda i: natural[i] - widths[i])] = 1
        widths = [w + s for w, s in zip(widths, shares)]
        left -= sum(shares)
    return widths


def _records(names: list[str], cells: list[list[str]], width: int, empty: str) -> list[str]:
    """Each row as a record, one ``header  value`` line per column, a blank line between records."""
    label = min(max(map(width_of, names)), width // 3)
    out: list[str] = []
    for row in cells:
        out += [""] if out else []
        for name, value in zip(names, row):
            heads, values = _lines(name, label), _lines(value, width - label - len(_GAP))
            for i in range(max(len(heads), len(values))):
                head = _pad(heads[i] if i < len(heads) else "", label, False)
                out.append((head + _GAP + (values[i] if i < len(values) else "")).rstrip())
    return out or [wrap(empty, width)]


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

    def text(self, width: int | None = None) -> str:
        """Aligned columns for a terminal, numbers to the right and text to the left, in at most
        ``width`` columns (default: :func:`terminal_width`).

        A table that fits prints as it is. A wider one first moves each URL of a text cell into a
        numbered note under the table (``[1] https://...``; the cell keeps ``[1]``). Then its text
        columns are narrowed (each to no less than ``_TEXT_FLOOR``), their cells and the headers
        wrapped at spaces (a word longer than its column is cut, after a ``/`` or a ``.`` where it
        can be); numbers are never split. If the numbers and the narrowed text still do not fit,
        the table is turned (a column per row, a row per column: a few rows of many numbers); if
        that does not fit either, each row prints as a record of ``header  value`` lines. Only a
        note whose URL is longer than a line is wider than ``width``."""
        width = width or terminal_width()
        names = [n for n, _ in self.columns]
        numeric = [k.partition(":")[0] in _NUMERIC for _, k in self.columns]
        cells = [[" ".join(c.splitlines()).replace("\t", " ") for c in row] for row in self._cells(False)]
        flags = [numeric] * len(cells)
        natural = [max([width_of(names[i]), *(width_of(r[i]) for r in cells)]) for i in range(len(names))]
        if sum(natural) + len(_GAP) * (len(names) - 1) <= width:
            return "\n".join(_grid(names, numeric, cells, flags, natural) + ([] if cells else [wrap(self.empty, width)]))

        notes: dict[str, int] = {}
        cells = [[c if r else _urls_to_notes(c, notes) for c, r in zip(row, numeric)] for row in cells]
        widths = _fit(names, cells, flags, width)
        if widths is not None:
            out = _grid(names, numeric, cells, flags, widths) + ([] if cells else [wrap(self.empty, width)])
        else:
            turned = [names[0], *(r[0] for r in cells)]
            turned_cells = [[names[j], *(r[j] for r in cells)] for j in range(1, len(names))]
            turned_flags = [[False, *(f[j] for f in flags)] for j in range(1, len(names))]
            whole = [False, *(numeric[:1] * len(cells))]  # the first column's numbers head the columns
            widths = _fit(turned, turned_cells, turned_flags, width, whole) if cells else None
            if widths is not None:
                out = _grid(turned, whole, turned_cells, turned_flags, widths)
            else:
                out = _records(names, cells, width, self.empty)
        return "\n".join([*out, *(f"[{n}] {url}" for url, n in notes.items())])

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
