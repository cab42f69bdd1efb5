"""Lab 04 - the segment rule: how many blocks should one checkpoint hold? Derived, then measured.

Checkpoint n blocks in segments of k. Forward keeps one input per segment. Backward recomputes a
segment whole, so for a while its k blocks hold everything a block saves. With b the bytes of a block
input, a what one block keeps for backward, C what lives outside the blocks and G what backward
itself holds at that moment (the gradients in flight, less what the head has already freed):

    kept(k) = C + ceil(n/k)*b        peak(k) = C + G + (n/k)*b + k*a   (k dividing n)

The peak is smallest where -n*b/k**2 + a = 0: k* = sqrt(n*b/a). For a chain of simple layers a = b
and k* = sqrt(n), the textbook rule (Chen et al., 2016). A transformer block keeps some twenty times
its input, and k* falls below 1. This file builds the simple chain and predicts both curves; the
notebook and tests/test_lab04.py measure them with ``checkpointing.measure_memory``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkpointing.py, next to this file

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from checkpointing import activation_memory, forward, measure_memory, run_blocks  # noqa: E402


# --8<-- [start:chain]
def chain(n: int, width: int) -> torch.nn.Sequential:
    """A stem, then n blocks of Linear + ReLU. A block keeps one tensor for backward, its ReLU output
    (the next block's input, the same tensor): a = b, the case the textbook rule is made for."""
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                 for _ in range(n + 1)))


def chain_loss(model: torch.nn.Sequential, x, y, strategy: str, every: int):
    """checkpointing.forward for the chain: the same run_blocks, a regression loss."""
    h = model[0](x)  # the stem stays outside the segments, as TinyGPT's embedding does
    return F.mse_loss(run_blocks(list(model[1:]), h, strategy, every), y)
# --8<-- [end:chain]


# --8<-- [start:rule]
def predict(n: int, k: int, a: float, b: int, C: int = 0, G: float = 0) -> tuple[int, float]:
    """Derived: the bytes kept after forward, and the activation peak. While backward recomputes
    segment j (the first is 1), the inputs of segments 1..j are still kept and its blocks are back."""
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


def sweep(model, x, y, ks, loss_of=forward) -> dict:
    """activation_memory of one step without checkpointing ("none") and with segments of each k."""
    def measure(strategy, k):
        return activation_memory(measure_memory(model, x, y, strategy, k, 0, loss_of)[0])
    return {"none": measure("none", 1)} | {k: measure("every-k", k) for k in ks}


def compare(mem: dict, n: int, b: int) -> dict:
    """The sweep against the rule: per k the predicted kept bytes and peak, and their relative errors
    against the measured ones; the best k measured and predicted; and the constants used."""
    C, a, G = constants(mem, n, b)
    ks = [k for k in mem if k != "none"]
    rows = {}
    for k in ks:
        kept, peak = predict(n, k, a, b, C, G)
        rows[k] = {"kept": kept, "peak": peak, "kept_error": kept / mem[k]["kept_bytes"] - 1,
                   "peak_error": peak / mem[k]["activation_peak_bytes"] - 1}
    return {"C": C, "a": a, "b": b, "G": G, "k_star": k_star(n, a, b), "rows": rows,
            "best_measured": min(ks, key=lambda k: mem[k]["activation_peak_bytes"]),
            "best_predicted": min(ks, key=lambda k: rows[k]["peak"])}
