"""Lab 01 - a formula that knows how it is written: ``Expr`` keeps its text in symbols, the same text
with the numbers filled in, and its value, so what a page shows is what was computed.

    h, T = sym("h", 4096), sym("T", 8192)
    e = T * (4 * h + 4)      # e.text "T × (4 × h + 4)", e.filled "8,192 × (4 × 4,096 + 4)", e.value 134250496

``docs/assets/fit.js`` has the same class (same operators, same parentheses, same number format), and
the page's test holds the two texts equal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Expr:
    text: str  # in symbols: "w × P"
    filled: str  # with their numbers: "4 × 8,030,261,248"
    value: int
    sum: bool = False  # a sum or difference: parenthesised when multiplied

    def __add__(self, other) -> Expr:
        other = lift(other)
        return Expr(f"{self.text} + {other.text}", f"{self.filled} + {other.filled}", self.value + other.value, True)

    def __radd__(self, other) -> Expr:
        return lift(other) + self

    def __sub__(self, other) -> Expr:
        other = lift(other)
        return Expr(f"{self.text} − {_par(other, 'text')}", f"{self.filled} − {_par(other, 'filled')}",
                    self.value - other.value, True)

    def __mul__(self, other) -> Expr:
        other = lift(other)
        return Expr(f"{_par(self, 'text')} × {_par(other, 'text')}", f"{_par(self, 'filled')} × {_par(other, 'filled')}",
                    self.value * other.value)

    def __rmul__(self, other) -> Expr:
        return lift(other) * self


def _par(e: Expr, which: str) -> str:
    return f"({getattr(e, which)})" if e.sum else getattr(e, which)


def lift(x) -> Expr:
    """An int as an Expr (its text is its number)."""
    return x if isinstance(x, Expr) else Expr(str(x), f"{x:,}", x)


def sym(name: str, value: int) -> Expr:
    return Expr(name, f"{value:,}", value)


def ceil_div(a, b) -> Expr:
    a, b = lift(a), lift(b)
    return Expr(f"⌈{a.text} / {b.text}⌉", f"⌈{a.filled} / {b.filled}⌉", -(-a.value // b.value))


def larger(a, b) -> Expr:
    a, b = lift(a), lift(b)
    return Expr(f"max({a.text}, {b.text})", f"max({a.filled}, {b.filled})", max(a.value, b.value))


def named(text: str, value: int) -> Expr:
    """A value computed elsewhere (one of Lab 01's functions), shown with the formula that gives it."""
    return Expr(text, f"{value:,}", value, True)


ZERO = Expr("0", "0", 0)


def total(*terms) -> Expr:
    """The sum of ``terms``, leaving out those that are :data:`ZERO` (so a formula says only what it counts)."""
    kept = [t for t in terms if t is not ZERO]
    out = kept[0] if kept else ZERO
    for t in kept[1:]:
        out = out + t
    return out
