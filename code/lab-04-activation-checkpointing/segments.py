"""Lab 04 - the segment rule: how many blocks should one checkpoint hold? Derived, then measured.

Checkpoint L blocks in segments of k. Forward keeps one input per segment. Backward recomputes a
segment whole, so for a while its k blocks hold everything a block saves. With I_blk the bytes of a
block input, K_blk what one block keeps for backward, C what lives outside the blocks and G what
backward itself holds at that moment (the gradients in flight, less what the head has already freed):

    kept(k) = C + ceil(L/k)*I_blk        peak(k) = C + G + (L/k)*I_blk + k*K_blk   (k dividing L)

The peak is smallest where -L*I_blk/k**2 + K_blk = 0: k* = sqrt(L*I_blk/K_blk). For a chain of simple
layers K_blk = I_blk and k* = sqrt(L), the textbook rule (Chen et al., 2016). A transformer block keeps
some twenty times its input, and k* falls below 1. This file builds the simple chain, predicts both
curves, and measures them for the chain and for TinyGPT with ``checkpointing.measure_memory``.
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
    """A stem, then ``blocks`` blocks of Linear + ReLU, and a regression loss. A block keeps one tensor
    for backward, its ReLU output (the next block's input, the same tensor): K_blk = I_blk, the case the
    textbook rule is made for. ``forward(x, y, run_blocks=None)`` is TinyGPT's seam, so the same step runs both."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.stem = linear_relu(width)  # outside the segments, as TinyGPT's embedding is
        self.blocks = nn.ModuleList(linear_relu(width) for _ in range(blocks))

    def forward(self, x, y, run_blocks=None):
        h = (run_blocks or run_in_order)(self.blocks, self.stem(x))
        return h, F.mse_loss(h, y)
# --8<-- [end:chain]


# --8<-- [start:rule]
def predict(blocks: int, k: int, kept_per_block: float, block_input: int, C: int = 0,
            G: float = 0) -> tuple[int, float]:
    """Derived: the bytes kept after forward, and the activation peak, for L = ``blocks`` blocks in
    segments of ``k``, a block keeping K_blk = ``kept_per_block`` bytes and its input I_blk =
    ``block_input``, ``C`` outside the blocks, ``G`` held by backward. While backward recomputes
    segment j (the first is 1), the inputs of segments 1..j are still kept and its blocks are back."""
    sizes = [min(k, blocks - i) for i in range(0, blocks, k)]  # blocks per segment; the last may be short
    return (C + len(sizes) * block_input,
            C + G + max((j + 1) * block_input + s * kept_per_block for j, s in enumerate(sizes)))


def constants(mem: dict, blocks: int, block_input: int) -> tuple[int, float, float]:
    """C, K_blk and G from two runs, not fitted to the sweep: k = 1 keeps C + L*I_blk and none keeps
    C + L*K_blk after forward; k = 1 peaks at C + G + L*I_blk + K_blk."""
    C = mem[1]["kept_bytes"] - blocks * block_input
    kept_per_block = (mem["none"]["kept_bytes"] - C) / blocks
    return C, kept_per_block, mem[1]["activation_peak_bytes"] - predict(blocks, 1, kept_per_block, block_input, C)[1]


def k_star(blocks: int, kept_per_block: float, block_input: int) -> float:
    """k* = sqrt(L*I_blk/K_blk), where the recompute window's peak is lowest."""
    return math.sqrt(blocks * block_input / kept_per_block)
# --8<-- [end:rule]


# --8<-- [start:head]
def predict_with_head(blocks: int, k: int, kept_per_block: float, block_input: int, C: int, G: float,
                      S: float) -> tuple[int, float]:
    """:func:`predict` (same arguments) with a second peak outside the segments: as backward starts,
    the loss holds ``S`` bytes above what forward kept (at a real vocabulary, its gradient through
    the fp32 log-softmax: two float32 tensors of the logits' shape), on top of every kept block
    input. The higher peak counts."""
    args = blocks, k, kept_per_block, block_input, C, G
    return predict(*args)[0], max(two_peaks(*args, S))


def two_peaks(blocks: int, k: int, kept_per_block: float, block_input: int, C: int, G: float,
              S: float) -> tuple[float, float]:
    """The recompute window's peak and the head's (arguments of :func:`predict_with_head`)."""
    kept, window = predict(blocks, k, kept_per_block, block_input, C, G)
    return window, kept + S


def head_constants(mem: dict, blocks: int, block_input: int) -> tuple[int, float, float, float]:
    """C and K_blk as :func:`constants` (none and k = 1); S from k = 1, where the head's peak is the
    higher (when it is not, S comes out at most G + K_blk and the window wins at every k); G from the
    largest k run, where the recompute window is the higher. Three runs; the other points test the rule."""
    C = mem[1]["kept_bytes"] - blocks * block_input
    kept_per_block = (mem["none"]["kept_bytes"] - C) / blocks
    S = mem[1]["activation_peak_bytes"] - mem[1]["kept_bytes"]
    top = max(k for k in mem if k != "none")
    G = mem[top]["activation_peak_bytes"] - predict(blocks, top, kept_per_block, block_input, C)[1]
    return C, kept_per_block, G, S
# --8<-- [end:head]


def sweep(model, x, y, ks, none: bool = True) -> dict:
    """activation_memory of one step without checkpointing ("none"; left out with ``none=False``)
    and with segments of each k in ``ks``."""
    def measure(strategy, k):
        return activation_memory(measure_memory(model, x, y, strategy, k).timeline())
    return ({"none": measure("none", 1)} if none else {}) | {k: measure("every-k", k) for k in ks}


def compare(mem: dict, blocks: int, block_input: int, head: bool = False) -> dict:
    """A :func:`sweep` of ``blocks`` blocks with inputs of ``block_input`` bytes against the rule: the constants
    (from two runs; with ``head``, three, and :func:`predict_with_head`), k*, per k the predicted
    kept bytes and peak and their relative errors against the measured ones, and the best k
    measured and predicted."""
    if head:
        C, kept_per_block, G, S = head_constants(mem, blocks, block_input)
        rule = partial(predict_with_head, S=S)
    else:
        (C, kept_per_block, G), S, rule = constants(mem, blocks, block_input), None, predict
    ks = [k for k in mem if k != "none"]
    rows = {}
    for k in ks:
        kept, peak = rule(blocks, k, kept_per_block, block_input, C, G)
        rows[k] = {"kept": kept, "peak": peak, "kept_error": kept / mem[k]["kept_bytes"] - 1,
                   "peak_error": peak / mem[k]["activation_peak_bytes"] - 1}
    return {"block_input_bytes": block_input, "per_block_bytes": kept_per_block, "outside_bytes": C,
            "backward_extra_bytes": G, **({"head_spike_bytes": S} if head else {}),
            "k_star": k_star(blocks, kept_per_block, block_input), "best_k_measured": min(ks, key=lambda k: mem[k]["activation_peak_bytes"]),
            "best_k_predicted": min(ks, key=lambda k: rows[k]["peak"]),
            "measured": {k: mem[k] for k in ks}, "none": mem["none"], "predicted": rows}


def chain(blocks: int, width: int, batch: int, device) -> tuple[Chain, torch.Tensor, torch.Tensor]:
    """The chain of ``blocks`` blocks of ``width`` (seed 0) on ``device``, and a random batch of ``batch``
    inputs and targets, drawn as one tensor (so the two share one storage)."""
    torch.manual_seed(0)
    model = Chain(blocks, width).to(device)
    x, y = torch.randn(2, batch, width, device=device)
    return model, x, y


def table(rule: dict, blocks: int, kind: str = "B", evidence: str = "measured") -> Table:
    """A :func:`compare` as rows: per k, the kept bytes and the peak, ``evidence`` (measured, or
    traced) and derived, in byte columns of ``kind`` (exact ``B``, or ``bytes`` in one unit)."""
    rows = [[k, math.ceil(blocks / k), m["kept_bytes"], p["kept"], m["activation_peak_bytes"], p["peak"], p["peak_error"]]
            for (k, m), p in zip(rule["measured"].items(), rule["predicted"].values())]
    return Table([("k", "int"), ("segments ⌈L/k⌉", "int"), (f"kept, {evidence}", kind), ("kept, derived", kind),
                  (f"peak, {evidence}", kind), ("peak, derived", kind), ("error", "pct:1")], rows)


def findings(rules: dict[str, dict]) -> dict:
    """What a page says about the sweeps of the ``chain`` and ``TinyGPT`` rules: K_blk/I_blk for each, how far
    the chain's best k peaks below k = 1, and the worst error at any k but 1 (k = 1 fixes G)."""
    chain_rule = rules["chain"]
    best = chain_rule["measured"][chain_rule["best_k_measured"]]["activation_peak_bytes"]
    return {"kept_over_input": {name: r["per_block_bytes"] / r["block_input_bytes"] for name, r in rules.items()},
            "chain_best_below_k1": 1 - best / chain_rule["measured"][1]["activation_peak_bytes"],
            "worst_error": max(abs(row[e]) for r in rules.values() for k, row in r["predicted"].items() if k != 1
                               for e in ("kept_error", "peak_error")),
            "exact": all(row["kept"] == r["measured"][k]["kept_bytes"]
                         and row["peak"] == r["measured"][k]["activation_peak_bytes"]
                         for r in rules.values() for k, row in r["predicted"].items())}
