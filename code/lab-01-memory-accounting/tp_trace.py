"""Lab 01 · tensor parallelism traced: ONE GPU of a t-way split block, as PyTorch's DTensor runs it.

Harness, not lesson: it holds ``activation_bytes_per_layer``'s tensor- and sequence-parallel terms
against what PyTorch itself keeps. A transformer layer written plainly (:class:`Block`) is split
with ``torch.distributed.tensor.parallel.parallelize_module`` in Megatron's pattern (:func:`plan`);
this process plays rank 0 of t under PyTorch's *fake* process group (every collective returns at
once and moves nothing; ``torch.testing._internal.distributed.fake_pg``, an internal module), and
the block runs forward on fake tensors (:mod:`labkit.fake`) while the memory ledger watches. The
ledger counts a DTensor as its local shard, which is what occupies this GPU.

What the block keeps that the paper's count does not (:func:`gap_to_formula` lists the bytes):

* each layer norm's mean and 1/std per row (the paper leaves them out as small);
* ``F.scaled_dot_product_attention`` (flash on CPU, as on CUDA) keeps one float32 log-sum-exp per
  row and head instead of the ``s x s`` scores, so the block is the paper's *selective* case;
* no dropout, so no masks (the paper's ``2m`` per ``sbh`` and its score mask);
* with sequence parallelism, PyTorch saves the all-gathered input of the first column-parallel
  linear of each sublayer: two ``sbh`` tensors stay whole on every GPU. Megatron saves only this
  GPU's sequence shard and gathers it again in backward (Korthikanti et al. 2022, 4.2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit import dist as dist_kit
from labkit import fake, marks
from labkit.ledger import Ledger

class Attention(nn.Module):
    """Causal self-attention with separate Q, K and V linears, so that a column split hands each GPU
    whole heads; the head count comes from the local shapes."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(y).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(y)))


class Block(nn.Module):
    """The paper's layer without dropout (Korthikanti et al. 2022, Figure 2): pre-norm attention and
    a 4h GELU MLP, 12h^2 + 13h parameters as in TinyGPT's block."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(hidden), Attention(hidden, heads), \
            nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def plan(sp: bool) -> dict:
    """Megatron's split as DTensor styles: Q, K, V and the MLP's first matrix by columns, the output
    projections by rows. With ``sp`` the norms work on sequence shards and each sublayer gathers its
    input once (torchtitan's Llama plan does the same)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    cols = {f"attn.{n}": ColwiseParallel() for n in "qkv"} | {"mlp.up": ColwiseParallel()}
    if not sp:
        return cols | {"attn.o": RowwiseParallel(), "mlp.down": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    return cols | {"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                   "mlp.down": RowwiseParallel(output_layouts=Shard(1))} | {"attn": gather, "mlp": gather}


@dataclass
class Trace:
    """What one GPU of the split block holds: bytes by category, and each activation by the op that made it."""

    parameters: int
    activations: int  # born in forward and alive when it ended: kept for backward
    saved: list[tuple[str, int]]  # (op, bytes) of every activation


def trace_block(hidden: int, heads: int, seq: int, batch: int, tp: int, sp: bool = False,
                dtype: torch.dtype = torch.float32) -> Trace:
    """Forward of one :class:`Block` on rank 0 of ``tp``, on fake tensors, under the ledger.

    hidden, heads, seq, batch: h, a, s, b; tp: the tensor-parallel size; sp: sequence parallelism
    (this GPU's input is then its s/t tokens); dtype: the block's weights and input."""
    with dist_kit.fake_group(tp) as mesh, fake.tensors(block=None):
        from torch.distributed.tensor.parallel import parallelize_module

        block = parallelize_module(fake.materialize(lambda: Block(hidden, heads), dtype=dtype), mesh, plan(sp))
        ledger = Ledger("cpu").track_module(block)
        with ledger, marks.phase("forward", 0):
            x = torch.empty(batch, seq // tp if sp else seq, hidden, dtype=dtype)
            graph = block(x).grad_fn  # the graph keeps what backward needs; the output itself is let go
        tl = ledger.timeline()
        end = next(s for s in tl.spans if s.name == "forward").end - 1
        saved = [(r.op, r.nbytes) for r in ledger.records if ledger.category_of(r) == "activations"]
        del graph
        return Trace(tl.device["parameters"][end], tl.device["activations"][end], saved)


def gap_to_formula(hidden: int, heads: int, seq: int, batch: int, tp: int, sp: bool = False,
                   elem: int = 4) -> list[tuple[str, int]]:
    """What :class:`Block` keeps beyond ``activation_bytes_per_layer(..., mask=None,
    recompute="selective", tp=tp, sp=sp)``, term by term, in bytes (arguments as for trace_block;
    elem: bytes per element of the block's dtype)."""
    shard = tp if sp else 1  # what sequence parallelism splits along s
    out = [("two layer norms' mean and 1/std per row", 2 * 2 * batch * seq * elem // shard),
           ("flash attention's float32 log-sum-exp per row and head", heads // tp * batch * seq * 4)]
    if sp:
        out.append(("the all-gathered inputs of Q/K/V and of the MLP, saved whole (Megatron keeps the shard)",
                    2 * seq * batch * hidden * elem * (tp - 1) // tp))
    return out
