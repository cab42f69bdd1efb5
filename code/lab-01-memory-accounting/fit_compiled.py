"""Lab 01 - will it fit? ``--compile``: what a compiled Llama block keeps for backward, as Lab 13 traces it.

Lab 13 (``fit_compile.py``) compiles each block, lets AOTAutograd and inductor's min-cut partitioner split the
joint graph (``min_cut_rematerialization_partition`` in torch/_functorch/partitioners.py, v2.13.0), and runs
the two graphs as Python on fake tensors. The forward graph's extra outputs are what the block saves. For a
Llama block that set is one list, the same at every size traced (1B, 3B, 8B, 70B and 405B widths; 16 to 65,536
tokens; batches of 1 to 4; fp32, bf16 and mixed; 1 to 32 KV heads): the partitioner never recomputes a matmul
(``is_compute_intensive``), and what it recomputes from the saved set (the norms' scaling, RoPE, SiLU, casts)
is cheap at any size, so no byte count moves the cut. ``layer`` writes that list term by term.

What the trace counts and inductor's generated code would not hold: the temporaries of the pointwise chains
it fuses into one kernel, and the buffers it reuses. So the saved set is the compiled step's; its temporaries
are an upper bound (Lab 13's page says so). ``tests/test_fit_formula.py`` holds the formula to the trace."""

from __future__ import annotations

from types import SimpleNamespace

from fit_expr import ZERO, Expr, ceil_div, larger, total
from fit_symbols import LSE, ROW
from labkit import labs
from labkit.config import UsageError


# --8<-- [start:compiled]
def layer(S) -> Expr:
    """Bytes one compiled Llama block keeps for backward, nothing checkpointed: its input (the residual stream,
    r), the two norms' 1/rms, the attention norm's output in c (one copy for q, k and v), q and k after RoPE and
    v, RoPE's angle table (fp32, one per sequence position), attention's log-sum-exp and output, o_proj's output,
    the MLP norm's output, gate's and up's outputs and their product SiLU(gate) × up. Recomputed in backward:
    the norms' fp32 work, RoPE's rotation, SiLU, the residual sums. Under autocast the seven matmul weights' c
    casts are saved too: the calculator adds them as it does for eager blocks (``casts``)."""
    tokens = S.r * S.h + 2 * ROW + 3 * S.c * S.h + S.c * (2 * S.q + 2 * S.g) + LSE * S.a + 3 * S.c * S.f
    return S.T * tokens + 4 * S.s * S.d


def saved(x, S, eager: Expr) -> Expr:
    """What a compiled block keeps, given what the eager one keeps (``eager``) under the same checkpointing. Nothing
    checkpointed: ``layer``. Checkpointed whole (full): its input, as eager. Under a policy (save-matmuls,
    save-alternate-matmuls) the partitioner keeps what the policy must save and backward reads: every saved
    matmul output but the down projection's, which only the block's output is made from (T × c × h less). No
    weight cast is kept under autocast: the compiled backward casts again (the calculator adds none)."""
    if x.checkpointing == "none":
        return layer(S)
    return eager - S.T * S.c * S.h if x.checkpointing.startswith("save") else eager


def block_backward(x, S, held: dict, act: dict) -> dict[str, dict[str, Expr]]:
    """FSDP2 at ZeRO-3 or 2 (Lab 13's trace): the peak of a compiled block's backward, at its attention norm's
    backward. The backward graph runs as one call: what the block saved stays until it returns (a checkpointed
    block's input; its recompute is freed by then but for the norm's input), and so does every weight gradient it
    has made, in c (all of the block's, by the time its first norm comes back). Beside them: the head's c gradient,
    waiting for the root's reduce-scatter (under fused-linear, made in forward: an activation); the norm's fp32
    input and products (four T × h) and two c gradients of the stream. Checkpointed whole (full), the block's peak
    can come earlier, in its recomputed MLP's backward (``recomputed_mlp``). FSDP2 holds the root, this block and
    the next one gathered (ZeRO-2: every block not done), and the block after's reduce-scatter input
    (``communication``, as for an eager block). Each block done frees its saved set and leaves a gradient shard,
    so the peak is near one end: the second block from the end (the last one's shard out, L − 1 saved sets alive;
    ``block_backward``, at ZeRO-2 ``recomputed_backward``), or the second from the front (L − 2 shards, two saved
    sets: where a block keeps less than its shard, as a checkpointed one does; ``recomputed_front``). Gone: the
    loss's log-softmax, the final norm, the later blocks' saved sets."""
    from fit_formula import layer, norm  # here: fit_formula imports this file
    if x.zero_stage < 2 or x.offload != "none" or S.L.value < 3:
        return {}
    per = saved(x, S, layer(S, x.checkpointing))  # what one compiled block keeps (FSDP2: no weight casts)
    shard = S.w * ceil_div(S.Pb, S.dp)  # a block's gradient shard
    units, fused = x.fsdp_units != "blocks", x.loss == "fused-linear"
    head = ZERO if units else S.c * S.V * S.h  # the head's gradient (fused-linear: made in forward; its own unit: reduced)
    own = S.w * ceil_div(S.Pr - S.V * S.h, S.dp) if units else ZERO  # the head unit's shard
    work = total(S.c * S.Pb, S.T * (16 * S.h + 2 * S.c * S.h))
    if x.checkpointing == "full":  # or, earlier, the recomputed MLP's backward: down's weight gradient made
        work = larger(work, recomputed_mlp(S))
    out = {}
    end = "block_backward" if x.zero_stage == 3 else "recomputed_backward"  # (ZeRO-2: every block not done gathered)
    ends = ((end, S.L, 0), ("recomputed_front", 1, S.L - 1)) if units else ((end, S.L - 1, 1), ("recomputed_front", 2, S.L - 2))
    if units and x.zero_stage == 3:  # and the second block from the end, its own unit's shard and the last's out
        ends += (("second_block_backward", S.L - 1, 1),)
    for moment, blocks, done in ends:
        shards = ZERO if done == 0 else shard if done == 1 else done * shard
        grads = held["gradients"] if x.accumulation > 1 else total(own, shards)
        kept = per if blocks == 1 else blocks * per
        out[moment] = held | {"gradients": grads, "activations": total(kept, head) if fused else kept,
                              "temporaries": work if fused else total(head, work)}
    if units and x.zero_stage == 3:  # before the blocks: the head unit's reduce-scatter, as eager's (fit_moments)
        out["head_reduced"] = held | {"gradients": held["gradients"] if x.accumulation > 1 else own, "activations":
                                      act["kept"] - act["loss"] - S.T * norm(S, 1), "temporaries": S.c * S.V * S.h + S.T * S.c * S.h}
    return out


def recomputed_mlp(S) -> Expr:
    """A compiled block checkpointed whole (full), in its backward graph: the block recomputed, then its MLP's
    backward, at the larger of two points. (1) The product's gradient times up's output: beside the head's gradient,
    five T × f (gate's and up's outputs, SiLU's, the product's gradient and that product); the two norms' fp32
    inputs (T × h each) and five c tensors T × h wide (their outputs, the residual sum, the stream's gradient; in
    fp32 six, and no copies), two T × q (q after RoPE, attention's output) and two T × g (k after RoPE, v),
    attention's log-sum-exp and the norms' 1/rms, RoPE's cos and sin (c), and down's weight gradient. (2) Later, a
    second weight gradient made (f × h: the larger where h is above T, as in a 70B at 4,096 tokens): two of the
    T × f freed, one gradient of the MLP's input (T × h) made."""
    wide = 8 * S.h + 5 * S.c * S.h if S.c.value < 4 else 6 * S.c * S.h  # (fp32: no fp32 copies; six T × h)
    stream = wide + 2 * S.c * S.q + 2 * S.c * S.g + LSE * S.a + 2 * ROW
    first = total(5 * S.T * S.c * S.f, S.T * stream, 2 * S.s * S.d * S.c, S.c * S.f * S.h)
    second = total(3 * S.T * S.c * S.f, S.T * (stream + S.c * S.h), 2 * S.s * S.d * S.c, 2 * S.c * S.f * S.h)
    return larger(first, second)


def moments(x, S, held: dict, state: dict, act: dict) -> dict[str, dict[str, Expr]]:
    """The compiled step's moments beside eager's: a block's backward (``block_backward``) and, on one GPU, the
    embedding's backward: every gradient made, the embedding's last, beside the stream's gradient (T × r × h).
    With checkpointing a block keeps less than its gradient, so the step's total grows to there."""
    out = block_backward(x, S, held, act)
    if x.dp == 1 and x.accumulation == 1 and x.offload == "none":
        out["embedding_backward"] = state | {"temporaries": S.T * S.r * S.h}
    return out
# --8<-- [end:compiled]


def check(x, family: str, dims: dict) -> None:
    """What Lab 13 refuses with --compile (its own check, one source), then what the formula does not count."""
    if not x.compile:
        return
    spec = SimpleNamespace(family=family, experts=dims["experts"])  # Lab 13's config holds its spec; Inputs makes it
    config = SimpleNamespace(**{k: getattr(x, k) for k in ("compile", "task", "model", "checkpointing", "tp", "pp",
                                                          "method")}, spec=spec)
    labs.load(13, "fit_compile").check_compile(config)
    for bad, why in ((x.cp > 1, "--cp's ring attention is not traced compiled (Lab 13)"),
                     (x.pp > 1 or x.checkpointing == "every-kth-block" or x.method != "full", "a pipeline stage, "
                      "every-kth-block and LoRA's adapters in a compiled block have no formula here (Lab 13 traces them)"),
                     (x.optimizer_in_backward or x.offload_activations, "--optimizer-in-backward and "
                      "--offload-activations are not traced compiled (Lab 13)"),
                     (x.float8 != "none", "--float8's casts in a compiled block have no formula here (Lab 13 traces them)"),
                     (x.offload == "params" and (x.loss != "full" or x.checkpointing != "none"), "--offload params "
                      "beside a checkpointed block or a chunked loss: a compiled block's backward then holds the peak, "
                      "with the offloaded shards, and has no formula here (Lab 13 traces it)")):
        if bad:
            raise UsageError(f"--compile: {why}: leave one out")

