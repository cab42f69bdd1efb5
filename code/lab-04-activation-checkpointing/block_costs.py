"""Lab 04 - what one TinyGPT block costs, derived, and each formula against the measurement.

``block_costs`` is the arithmetic: the bytes a block keeps for backward, the bytes a checkpoint
keeps instead, what the save-matmuls policy keeps, and the FLOPs a recompute redoes. ``checks``
holds every formula against what ``checkpointing.run`` measured (the ledger, ``FlopCounterMode``);
on a CPU they agree to the byte and to the FLOP, and ``tests/test_lab04.py`` asserts it.
``CPU_ATTENTION_FLOPS`` teaches the FLOP counter the CPU flash-attention kernel, which it does not
know (a real-size trace runs it in every block).
"""

from __future__ import annotations

import math

import torch

from labkit.table import Table

aten = torch.ops.aten


# --8<-- [start:costs]
def block_costs(batch: int, seq: int, width: int, heads: int) -> dict[str, int]:
    """What one TinyGPT block costs, derived for fp32 on the CPU path that dropout selects (attention
    as two ``bmm``, 4-byte dropout masks), in the handbook's notation: ``batch`` b, ``seq`` s,
    ``width`` h, ``heads`` a.

    ``input``: I_blk = 4·s·b·h bytes, one block input, what a checkpoint keeps;
    ``kept``: K_blk = 72·s·b·h + 12·a·s²·b + 16·s·b bytes kept for backward without checkpointing:
    Korthikanti et al. (2022), 34·s·b·h + 5·a·s²·b bytes for 2-byte tensors and 1-byte masks,
    rewritten for fp32 and 4-byte masks, plus the two layer norms' fp32 mean and 1/std per token
    (16·s·b);
    ``matmul_outputs``: 4·(10·s·b·h + a·s²·b) bytes, what save-matmuls keeps: the outputs of the four
    linear layers (3h + h + 4h + h per token) and of the two attention ``bmm`` (a·s²·b, and s·b·h);
    ``forward_flops``: 24·s·b·h² + 4·s²·b·h, the matmul FLOPs a checkpointed block recomputes.
    """
    b, s, h, a = batch, seq, width, heads
    return {"input": 4 * s * b * h,
            "kept": 72 * s * b * h + 12 * a * s * s * b + 16 * s * b,
            "matmul_outputs": 4 * (10 * s * b * h + a * s * s * b),
            "forward_flops": 24 * s * b * h * h + 4 * s * s * b * h}
# --8<-- [end:costs]


def attention_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    """Fused attention forward, from the shapes of q (b, a, s_q, d_head) and k: q·kᵀ and p·v, two
    matmuls of b·a·s_q·s_k·d_head multiply-adds (a the query heads, GQA or not; a causal mask is not
    discounted)."""
    return 4 * math.prod(q) * k[-2]


def attention_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    """Its backward: q·kᵀ again, then the gradients of p, v, q and k, five such matmuls."""
    return 10 * math.prod(q) * k[-2]


# torch.utils.flop_counter counts CUDA's fused attention kernels (with these formulas) but not the CPU
# flash kernel that a CPU run without dropout, and so every trace, takes: count that one the same way.
CPU_ATTENTION_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu: attention_flops,
                       aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops}


def checks(result) -> Table:
    """Each formula of :func:`block_costs` against a ``checkpointing.run`` result of all four
    strategies. The save-matmuls and per-block rows hold for the CPU path only, and only there
    are they shown."""
    c, r, L, k = result.config, result.results, result.config.layers, result.every
    cost = block_costs(c.batch_size, c.seq_len, c.width, c.heads)
    flops = L * cost["forward_flops"]
    rows = [["kept: full − every-k", "(L − ⌈L/k⌉)·I_blk", (L - math.ceil(L / k)) * cost["input"],
             r["full"]["kept_bytes"] - r["every-k"]["kept_bytes"], "B"],
            ["recompute FLOPs, full", "L·(24·s·b·h² + 4·s²·b·h)", flops, r["full"]["recompute_flops"], "FLOP"],
            ["recompute FLOPs, every-k", "the same: every block once", flops, r["every-k"]["recompute_flops"], "FLOP"]]
    if result.device.type == "cpu":  # dropout sends attention down the math path: two bmm, both kept
        rows += [["kept: save-matmuls − full", "L·4·(10·s·b·h + a·s²·b)", L * cost["matmul_outputs"],
                  r["save-matmuls"]["kept_bytes"] - r["full"]["kept_bytes"], "B"],
                 ["recompute FLOPs, save-matmuls", "0: every matmul is kept", 0,
                  r["save-matmuls"]["recompute_flops"], "FLOP"],
                 ["kept per block, none", "72·s·b·h + 12·a·s²·b + 16·s·b", cost["kept"], result.per_block_bytes, "B"]]
    return Table(["quantity", "formula", ("derived", "int"), ("measured", "int"), "unit"], rows)
