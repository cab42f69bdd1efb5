"""Lab 06 - the arithmetic the notebook draws over its measurements, derived rather than measured.

* how far accumulated gradients are from the large batch's: as a fraction of the largest gradient
  (:func:`relative_gap`) and in fp32 units of the last place (:func:`gap_in_ulps`);
* the fp32 AdamW model state no batch size goes under (:func:`model_state_floor`);
* the large batch's derived line, linear in the batch (:func:`line_through_first_two`).
"""

from __future__ import annotations

import math


def relative_gap(gap: dict) -> float:
    """The largest gradient difference as a fraction of the largest gradient."""
    return gap["max_abs_diff"] / gap["max_abs_grad"]


def gap_in_ulps(gap: dict) -> float:
    """The largest gradient difference in units of the last place (ulps) of the largest gradient:
    the spacing of fp32 numbers at |x| is 2^(floor(log2 |x|) - 23)."""
    return gap["max_abs_diff"] / 2.0 ** (math.floor(math.log2(gap["max_abs_grad"])) - 23)


def model_state_floor(params: int, tensors: int) -> int:
    """fp32 AdamW model state, which no batch size goes under: 4 B parameters + 4 B gradients +
    8 B moments per parameter, and a 4 B step counter per parameter tensor."""
    return 16 * params + 4 * tensors


def line_through_first_two(xs: list[int], ys: list[int]) -> tuple[float, list[float]]:
    """The straight line through (xs[0], ys[0]) and (xs[1], ys[1]): its slope, and its value at
    every x (the large batch's derived line: linear in the batch)."""
    slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
    return slope, [ys[0] + (x - xs[0]) * slope for x in xs]
