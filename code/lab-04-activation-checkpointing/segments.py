"""Lab 04 - the segment rule: how many blocks should one checkpoint hold? Derived, then measured.

Checkpoint n blocks in segments of k. Forward keeps one input per segment. Backward recomputes a
segment whole, so for a while its k blocks hold everything a block saves. With b the bytes of a block
input, a what one block keeps for backward, C what lives outside the blocks and G what backward
itself holds at that moment (the gradients in flight, less what the head has already freed):

    kept(k) = C + ceil(n/k)*b        peak(k) = C + G + (n/k)*b + k*a   (k dividing n)

The peak is smallest where -n*b/k**2 + a = 0: k* = sqrt(n*b/a). For a chain of simple layers a = b
and k* = sqrt(n), the textbook rule (Chen et al., 2016). A transformer block keeps some twenty times
its input, and k* falls below 1. This file builds the simple chain, predicts both curves, and
measures them for the chain and for TinyGPT with ``checkpointing.measure_memory``.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.models import run_in_order
from labkit.table import Table

from checkpointing import activation_memory, measure_memory

TOLERANCE = 0.01  # how far a measured figure may sit from its prediction; on a CPU they agree to the byte


# --8<-- [start:chain]
def linear_relu(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


class Chain(nn.Module):
    """A stem, then n blocks of Linear + ReLU, and a regression loss. A block keeps one tensor for
    backward, its ReLU output (the next block's input, the same tensor): a = b, the case the textbook
    rule is made for. ``forward(x, y, run_blocks=None)`` is TinyGPT's seam, so the same step runs both."""

    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        self.stem = linear_relu(width)  # outside the segments, as TinyGPT's embedding is
        self.blocks = nn.ModuleList(linear_relu(width) for _ in range(n))

    def forward(self, x, y, run_blocks=None):
        h = (run_blocks or run_in_order)(self.blocks, self.stem(x))
        return h, F.mse_loss(h, y)
# --8<-- [end:chain]


# --8<-- [start:rule]
def predict(n: int, k: int, a: float, b: int, C: int = 0, G: float = 0) -> tuple[int, float]:
    """Derived: the bytes kept after forward, and the activation peak, for ``n`` blocks in segments
    of ``k``, a block keeping ``a`` bytes and its input ``b``, ``C`` outside the blocks, ``G`` held by
    backward. While backward recomputes segment j (the first is 1), the inputs of segments 1..j are
    still kept and its blocks are back."""
    sizes = [min(k, n - i) for i in range(0, n, k)]  # blocks per segment; the last one may be short
    return C + len(sizes) * b, C + G + max((j + 1) * b + s * a for j, s in enumerate(sizes))


def constants(mem: dict, n: int, b: int) -> tuple[int, float, float]:
    """C, a and G from two runs, not fitted to the sweep: k = 1 keeps C + n*b and none keeps
    C + n*a after forward; k = 1 peaks at C + G + n*b + a."""
    C = mem[1]["kept_bytes"] - n * b
    a = (mem["none"]["kept_bytes"] - C) / n
    return C, a, mem[1]["activation_peak_bytes"] - predict(n, 1, a, b, C)[1]


def k_star(n: int, a: float, b: int) -> float:
    return math.sqrt(n * b / a)
# --8<-- [end:rule]


# --8<-- [start:head]
def predict_with_head(n: int, k: int, a: float, b: int, C: int, G: float, S: float) -> tuple[int, float]:
    """:func:`predict` (same arguments) with a second peak outside the segments: as backward starts,
    the loss holds ``S`` bytes above what forward kept (at a real vocabulary, its gradient through
    the fp32 log-softmax: two float32 tensors of the logits' shape), on top of every kept block
    input. The higher peak counts."""
    return predict(n, k, a, b, C, G)[0], max(two_peaks(n, k, a, b, C, G, S))


def two_peaks(n: int, k: int, a: float, b: int, C: int, G: float, S: float) -> tuple[float, float]:
    """The recompute window's peak and the head's (arguments of :func:`predict_with_head`)."""
    kept, window = predict(n, k, a, b, C, G)
    return window, kept + S


def head_constants(mem: dict, n: int, b: int) -> tuple[int, float, float, float]:
    """C and a as :func:`constants` (none and k = 1); S from k = 1, where the head's peak is the higher
    (when it is not, S comes out at most G + a and the window wins at every k); G from the largest k
    run, where the recompute window is the higher. Three runs; the other points test the rule."""
    C = mem[1]["kept_bytes"] - n * b
    a = (mem["none"]["kept_bytes"] - C) / n
    S = mem[1]["activation_peak_bytes"] - mem[1]["kept_bytes"]
    top = max(k for k in mem if k != "none")
    return C, a, mem[top]["activation_peak_bytes"] - predict(n, top, a, b, C)[1], S
# --8<-- [end:head]


def sweep(model, x, y, ks, none: bool = True) -> dict:
    """activation_memory of one step without checkpointing ("none"; left out with ``none=False``)
    and with segments of each k in ``ks``."""
    def measure(strategy, k):
        return activation_memory(measure_memory(model, x, y, strategy, k).timeline())
    return ({"none": measure("none", 1)} if none else {}) | {k: measure("every-k", k) for k in ks}


def compare(mem: dict, n: int, b: int, head: bool = False) -> dict:
    """A :func:`sweep` of ``n`` blocks with inputs of ``b`` bytes against the rule: the constants
    (from two runs; with ``head``, three, and :func:`predict_with_head`), k*, per k the predicted
    kept bytes and peak and their relative errors against the measured ones, and the best k
    measured and predicted."""
    if head:
        C, a, G, S = head_constants(mem, n, b)
        rule = partial(predict_with_head, S=S)
    else:
        (C, a, G), S, rule = constants(mem, n, b), None, predict
    ks = [k for k in mem if k != "none"]
    rows = {}
    for k in ks:
        kept, peak = rule(n, k, a, b, C, G)
        rows[k] = {"kept": kept, "peak": peak, "kept_error": kept / mem[k]["kept_bytes"] - 1,
                   "peak_error": peak / mem[k]["activation_peak_bytes"] - 1}
    return {"block_input_bytes": b, "per_block_bytes": a, "outside_bytes": C, "backward_extra_bytes": G,
            **({"head_spike_bytes": S} if head else {}), "k_star": k_star(n, a, b), "best_k_measured": min(ks, key=lambda k: mem[k]["activation_peak_bytes"]),
            "best_k_predicted": min(ks, key=lambda k: rows[k]["peak"]),
            "measured": {k: mem[k] for k in ks}, "none": mem["none"], "predicted": rows}


def chain(n: int, width: int, batch: int, device) -> tuple[Chain, torch.Tensor, torch.Tensor]:
    """The chain of ``n`` blocks of ``width`` (seed 0) on ``device``, and a random batch of ``batch``
    inputs and targets, drawn as one tensor (so the two share one storage)."""
    torch.manual_seed(0)
    model = Chain(n, width).to(device)
    x, y = torch.randn(2, batch, width, device=device)
    return model, x, y


def table(rule: dict, n: int, kind: str = "B", evidence: str = "measured") -> Table:
    """A :func:`compare` as rows: per k, the kept bytes and the peak, ``evidence`` (measured, or
    traced) and derived, in byte columns of ``kind`` (exact ``B``, or ``bytes`` in one unit)."""
    rows = [[k, math.ceil(n / k), m["kept_bytes"], p["kept"], m["activation_peak_bytes"], p["peak"], p["peak_error"]]
            for (k, m), p in zip(rule["measured"].items(), rule["predicted"].values())]
    return Table([("k", "int"), ("segments ⌈n/k⌉", "int"), (f"kept, {evidence}", kind), ("kept, derived", kind),
                  (f"peak, {evidence}", kind), ("peak, derived", kind), ("error", "pct:1")], rows)


def findings(rules: dict[str, dict]) -> dict:
    """What a page says about the sweeps of the ``chain`` and ``TinyGPT`` rules: a/b for each, how far
    the chain's best k peaks below k = 1, and the worst error at any k but 1 (k = 1 fixes G)."""
    chain_rule = rules["chain"]
    best = chain_rule["measured"][chain_rule["best_k_measured"]]["activation_peak_bytes"]
    return {"a_over_b": {name: r["per_block_bytes"] / r["block_input_bytes"] for name, r in rules.items()},
            "chain_best_below_k1": 1 - best / chain_rule["measured"][1]["activation_peak_bytes"],
            "worst_error": max(abs(row[e]) for r in rules.values() for k, row in r["predicted"].items() if k != 1
                               for e in ("kept_error", "peak_error")),
            "exact": all(row["kept"] == r["measured"][k]["kept_bytes"]
                         and row["peak"] == r["measured"][k]["activation_peak_bytes"]
                         for r in rules.values() for k, row in r["predicted"].items())}
