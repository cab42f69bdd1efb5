"""Lab 01 - will it fit? The moments a split model adds (``fit_formula.py`` calls them): tensor parallelism's
embedding gradient and pipeline parallelism's first stage (and the model one TP rank holds), as Lab 13 traces them (``fit_parallel.py``,
``fit_pipeline.py``). ``tests/test_fit_formula.py`` holds both to real-scale traces within 0.1 %."""

from __future__ import annotations

from dataclasses import replace

import fit_formula as f  # layer(), fsdp_mixed(): read when a formula is computed (fit_formula imports this file)
from fit_expr import ZERO, Expr, ceil_div, larger, total
from fit_symbols import LSE, ROW, SCALE


def rank_spec(spec, tp: int):
    """The model one of ``tp`` tensor-parallel ranks holds (as Lab 14's ``per_gpu_spec``)."""
    if tp == 1:
        return spec
    return replace(spec, heads=spec.heads // tp, kv_heads=max(1, spec.kv_heads // tp), ffn=spec.ffn // tp,
                   vocab=-(-spec.vocab // tp), head_dim=spec.head_dim)


def float8_layer(S, sp: bool) -> Expr:
    """--float8 tensorwise under --tp (Lab 13's fit_float8_tp.py, torchao's float8 TP styles): what one block keeps
    for backward, nothing checkpointed. Each sublayer's input is cast to float8 once (under --sp before the all-gather,
    so the copy is on all T tokens) and q, k, v (gate, up) save that one copy, 1 byte per element, in place of the
    normalised stream (under autocast, of each reader's bf16 cast); the norms keep their own tensors. o_proj saves a
    float8 copy of its input beside the attention output SDPA keeps; down saves one in place of the gate x up product.
    RoPE's tables are made in the dtype of the attention's input, the float8 copy standing for a bf16 tensor: c, not
    r. And the four copies' float32 scales, one allocator block each (``SCALE``)."""
    norms = ceil_div(S.T, S.t) * 2 * f.own(S) if sp else S.T * 2 * f.own(S)  # fp32 input, 1/rms, the stream
    attention = S.h + S.c * (2 * S.q + 2 * S.g) + LSE * S.a + S.q  # q, k after RoPE, v, SDPA's output (c)
    mlp = S.h + 3 * S.c * S.f + S.f  # gate, SiLU(gate), up (c); the product's float8 copy
    return S.T * (attention + mlp) + 2 * S.s * S.d * S.c + 4 * SCALE + norms


def float8_mlp(S, sp: bool) -> Expr:
    """What a block's MLP and its norm keep for backward under the float8 TP styles (``float8_layer``'s part): the
    norm's own tensors (--sp: on T / t tokens), the float8 copy of its output, gate, SiLU(gate) and up (c), the
    product's float8 copy. ``fit_moments.recomputed_mlp`` takes it off a recomputed block for its MLP's backward."""
    return S.T * (S.h + 3 * S.c * S.f + S.f) + (ceil_div(S.T, S.t) if sp else S.T) * f.own(S)


def float8_backward(x, S, kept: Expr) -> tuple[Expr, Expr]:
    """--float8 tensorwise under --pp (Lab 13's fit_float8.py): a steady backward's (activations, temporaries) at the
    largest of these points of the last block's MLP. The down projection's weight gradient, ``kept`` alive: its input's
    gradient (c × T × f) and its own in bf16 (c × f × h), cast to the weight's dtype for autograd to accumulate (fp32
    weights, w × f × h). Without --tp, just before it: down's saved input cast again (an fp32 copy and its e4m3 bits,
    5 × T × f) beside the output's gradient (autocast's cast, c × T × h; its e5m2 bits, T × h). Under the float8 TP
    styles, later: the gate's weight gradient beside its input's and up's (c × T × h each, not yet summed), the MLP's
    gate, SiLU(gate), up and the product's float8 copy freed; or the MLP norm's backward, five fp32 tensors (--sp: on
    T / t tokens), its float8 output and its normalised stream freed too."""
    def most(*points):  # the point with the most bytes (the first of equals)
        return max(points, key=lambda point: point[0].value + point[1].value)
    cast = S.w * S.f * S.h if S.w.value != S.c.value else ZERO  # the bf16 weight gradient cast to the weight's dtype
    down = (kept, total(S.c * S.T * S.f, S.c * S.f * S.h, cast))
    if not S.f8tp:
        mixed = S.c * S.T * S.h if x.precision == "mixed" else ZERO
        return most(down, (kept, total(mixed, S.c * S.T * S.f, S.T * S.h, 5 * S.T * S.f)))
    tokens = ceil_div(S.T, S.t) if x.sp else S.T
    gate = (kept - S.T * (3 * S.c * S.f + S.f), total(2 * S.c * S.T * S.h, S.c * S.f * S.h, cast))
    norm = (kept - S.T * (S.h + 3 * S.c * S.f + S.f) - tokens * S.r * S.h, 20 * tokens * S.h)
    return most(down, most(gate, norm))


def carried(x, S, grads: Expr) -> Expr:
    """Earlier micro-batches' gradients ``grads``; under --tp at ZeRO-0, the embedding's whole (:func:`embedding`)."""
    return grads + S.w * (S.t - 1) * S.V * S.h if x.tp > 1 and x.zero_stage == 0 and x.accumulation > 1 else grads


def embedding(x, S, state: dict, held: dict) -> dict[str, dict[str, Expr]]:
    """--tp: DTensor (torch 2.13) has no vocabulary-split rule for the embedding's backward, so each rank makes the
    embedding's whole gradient. At ZeRO-0 it copies its rows out before the step (both alive); with accumulation,
    the embedding's backward makes a whole new gradient beside the one accumulated. Under FSDP2 (ZeRO-2 and 3) the
    whole gradient is in the gathered weights' dtype and the rows are copied out at once, the last thing backward
    does (``embedding_rows``): beside them the head's gradient waits for the root's reduce-scatter, every block's
    shard is out, the root is gathered and the first block's reduce-scatter input is held (``communication``). Without
    --tp: :func:`embedding_end`."""
    if x.tp == 1:
        return embedding_end(x, S, held)
    if x.zero_stage >= 2 and x.offload == "none":
        grads = held["gradients"] if x.accumulation > 1 else S.w * S.L * ceil_div(S.Pb, S.dp)
        return {"embedding_rows": held | {"gradients": grads, "temporaries": S.c * S.t * S.V * S.h + 2 * S.c * S.V * S.h}}
    if x.zero_stage:
        return {}
    whole = S.w * S.t * S.V * S.h
    out = {"embedding_gradient": dict(state) | {"gradients": state["gradients"] + whole}}
    if x.accumulation > 1:
        out["embedding_backward"] = held | {"temporaries": whole + S.T * S.r * S.h}
    return out


def embedding_end(x, S, held: dict) -> dict[str, dict[str, Expr]]:
    """FSDP2 without its mixed precision (pure bf16, fp32; mixed: ``fit_moments.backward_end``): the embedding's
    own backward, the last thing backward does: its gradient made (c × V × h) from the stream's (T × h) beside the
    head's, which waits for the root's reduce-scatter; every block's shard out, the root gathered and the first
    block's reduce-scatter input held (``communication``). Traced: an untied Llama, the blocks FSDP2's only units."""
    if x.zero_stage < 2 or x.offload != "none" or f.fsdp_mixed(x) or x.fsdp_units != "blocks" or x.method != "full" \
            or x.spec().tied or x.spec().family == "gpt" or S.E.value:
        return {}
    grads = held["gradients"] if x.accumulation > 1 else S.w * S.L * ceil_div(S.Pb, S.dp)
    return {"embedding_end": held | {"gradients": grads, "temporaries": 2 * S.c * S.V * S.h + S.T * S.c * S.h}}


def first_stage(x, S, state: dict, comm: dict) -> dict[str, dict[str, Expr]]:
    """The first stage's moments, DDP's buckets (``comm``) added: each category, 0 where it holds none."""
    return {k: f._full(v | {"communication": total(comm.get(k, comm["optimizer"]), v.get("communication", ZERO))})
            for k, v in pipeline(x, S, state).items()}


def pipeline(x, S, state: dict) -> dict[str, dict[str, Expr]]:
    """--pp (Lab 13's fit_pipeline.py): the first stage of 1F1B (L here is its ⌈L / pp⌉ blocks). At the start of a
    steady backward it holds pp micro-batches in flight (each its blocks' activations, its output, sent on and kept
    for its backward, and under autocast its own casts of the weights), every gradient, the buffer the gradient from
    the next stage is received into, and the last block's first backward matmuls: the gradients of the MLP's
    down-projection input (c × T × f) and weight (c × f × h), beside the received gradient's cast (autocast); under
    --float8, no weight casts and the points of ``float8_backward``. Or at
    the end of that backward, the embedding's: its whole new gradient made beside the one accumulated, and the
    gradient of its output (gathered whole under --sp). Or, under --sp, at the last block's reduce-scatter in a
    steady forward (output, its copy for the collective, the rank's share; under the float8 TP styles the MLP's input
    is gathered in float8 and kept, the gate x up product is not, and the point can come before, at down's weight
    cast: an fp32 copy, e4m3 bits). Without autocast or float8, later in that backward: at the last block's gate x up
    product (pipeline_product) or its MLP norm (pipeline_norm; under autocast too); under autocast with full checkpointing and
    no float8, a steady forward's last block beside autocast's cache of the stage's casts (pipeline_cache). With full
    checkpointing (no --sp, no float8) the last block is recomputed in that backward: whole at down's backward, at its
    gate x up product's (no autocast), as it is recomputed (autocast) or at its MLP norm's (under --tp: a narrow MLP)."""
    tokens = ceil_div(S.T, S.t) if x.sp else S.T
    mixed = x.precision == "mixed" and not f.fsdp_mixed(x)
    micro = S.L * f.layer(S, x.checkpointing, x.sp) + tokens * S.r * S.h
    micro = micro + S.c * S.Pm if mixed and x.checkpointing == "none" and x.float8 == "none" else micro
    temporaries = total(S.c * tokens * S.h if mixed else ZERO, S.c * S.T * S.f, S.c * S.f * S.h)
    grads = state["gradients"] + S.w * (S.t - 1) * S.V * S.h if x.tp > 1 else state["gradients"]  # DTensor's whole
    held = dict(state) | {"gradients": grads, "communication": tokens * S.r * S.h}  # embedding gradient (moments)
    plain = x.float8 == "none"  # (float8's backward points are float8_backward's)
    recomputed = plain and x.checkpointing == "full" and not x.sp  # the last block recomputed in a steady backward:
    block = last_block_recomputed(S, mixed) if recomputed else ZERO  # alive at its down projection's backward too
    backward = float8_backward(x, S, S.pp * micro) if x.float8 != "none" else (S.pp * micro, temporaries + block)
    out = {"pipeline_backward": held | dict(zip(("activations", "temporaries"), backward)),
           "embedding_backward": held | {"activations": (S.pp - 1) * micro + tokens * S.r * S.h,
                                         "temporaries": S.w * S.t * S.V * S.h + S.T * S.r * S.h},
           "optimizer": dict(state)}
    if plain and x.checkpointing == "none" and not mixed:  # or later (no autocast), at the gate x up product's backward: the
        out["pipeline_product"] = held | {"activations": S.pp * micro - S.c * S.T * S.f,  # product freed, its gradient
                                          "temporaries": 3 * S.c * S.T * S.f}  # and its factors' (the down weight's added)
    if plain and x.checkpointing == "none" and x.precision == "bf16" and not x.sp:  # or at its MLP norm's backward (wide heads, a
        out["pipeline_norm"] = held | {"activations": S.pp * micro - S.T * (4 * S.c * S.f + 4 * S.h + ROW),  # narrow MLP
                                       "temporaries": 20 * S.T * S.h}  # rank): the MLP and the norm's fp32 input freed; x,
        # x², its products: five fp32 tensors
    if plain and x.checkpointing == "none" and S.r.value == 4 and not x.sp:  # there with an fp32 stream (fp32, mixed):
        freed = S.T * (f.norm(S, 2) - 4 * S.h + 4 * S.c * S.f) + (3 * S.c * S.f * S.h if mixed else ZERO)  # the MLP,
        out["pipeline_norm"] = held | {"activations": S.pp * micro - freed,  # its weights' casts, the norm's tensors
                                       "temporaries": 20 * S.T * S.h}  # but its input (the residual sum, still read)
    if plain and mixed and x.checkpointing == "full" and not x.sp:  # a steady forward's last block, at its gate x up product:
        out["pipeline_cache"] = dict(state) | {"gradients": grads, "activations": S.pp * micro - tokens * S.r * S.h,
                                               "temporaries": total(S.c * S.Pm - S.c * S.f * S.h, 3 * S.c * S.T * S.f,
                                                                    S.T * S.r * S.h, 4 * S.T * S.h)}  # autocast's cache
        # of the stage's casts but down's; gate, SiLU(gate), their product; the stream and the MLP norm's fp32 product
    if recomputed:  # or later in that backward, at its MLP norm's backward
        out["pipeline_recomputed"] = held | {"activations": S.pp * micro, "temporaries": recomputed_norm(S, mixed)}
    if recomputed and not mixed:  # or at its gate x up product's backward: the product freed, its gradient and its
        out["pipeline_recomputed_product"] = held | {"activations": S.pp * micro,  # factors' made
                                                     "temporaries": block + 2 * S.c * S.T * S.f}
    if recomputed and mixed:  # or (autocast) as it is recomputed, at down's weight cast: the received gradient's cast,
        out["pipeline_recompute"] = held | {"activations": S.pp * micro,  # made as backward began, and the MLP norm's
                                            "temporaries": total(block, S.T * S.r * S.h, S.c * S.T * S.h)}  # fp32 output,
        # held by the MLP's forward frame (its argument; the matmuls keep their own bf16 casts)
    gathered = S.T * S.r * S.h if S.c.value != S.r.value else ZERO  # (else the matmuls keep it: activations)
    if x.sp:  # a steady forward's last reduce-scatter: the MLP's gathered input, the block's, the down-projection's
        held_by_frames = 3 * tokens * S.r * S.h if gathered is ZERO else ZERO  # bf16, fp32: the stage's embedding output,
        forward = total(gathered, tokens * S.r * S.h, held_by_frames,  # the block's attention residual sum and its MLP
                        (2 * S.T + tokens) * S.c * S.h)  # norm's output before its all-gather, held by Python frames
        if S.f8tp:  # float8 TP styles: that input gathered in float8 and kept, the gate x up product (down saves its
            forward = total(tokens * S.r * S.h, held_by_frames, S.c * S.T * S.f,  # float8 copy), or before, down's
                            larger((2 * S.T + tokens) * S.c * S.h, 5 * S.f * S.h))  # weight cast to e4m3 (fp32, bits)
        out["pipeline_forward"] = dict(state) | {"gradients": grads, "activations": S.pp * micro - tokens * S.r * S.h,
                                                 "temporaries": forward}
    if x.optimizer in ("adamw", "adamw-foreach"):  # foreach copies a moment
        out["optimizer"]["temporaries"] = S.m * (ceil_div(S.Pt, S.dp) if x.zero_stage else S.Pt)
    return out


def last_block_recomputed(S, mixed: bool) -> Expr:
    """A block recomputed whole in backward (``layer`` with nothing checkpointed): with an fp32 stream (fp32, mixed)
    its first norm reads the checkpointed input itself, no float32 copy; under autocast, its weights' bf16 casts made
    again (a block's share of the stage's)."""
    block = f.layer(S, "none") - 4 * S.T * S.h if S.r.value == 4 else f.layer(S, "none")
    return block + S.c * ceil_div(S.Pm, S.L) if mixed else block


def recomputed_norm(S, mixed: bool) -> Expr:
    """--pp, full checkpointing (Lab 13's trace): the first stage's last block recomputed in a steady backward, at its
    MLP norm's backward (under --tp the MLP is f / t wide, the norm is not). The MLP's tensors and the norm's bf16
    ones are freed; alive: the attention's (its norm's, q, k after RoPE, v, SDPA's output, RoPE's cos and sin; under
    autocast the attention weights' bf16 casts, made again), the MLP norm's fp32 input and its backward's five fp32
    tensors. With an fp32 stream (fp32, mixed) the norms read their inputs, no copies: the first the checkpointed one. The stream's gradient is the one received
    (communication)."""
    attention = S.T * (f.norm(S, 3) + S.c * (2 * S.q + 2 * S.g) + LSE * S.a) + 2 * S.s * S.d * S.r + 24 * S.T * S.h
    if S.r.value == 4:  # an fp32 stream: the first norm reads the checkpointed input, the second the residual sum
        attention = attention - 4 * S.T * S.h
    return attention + S.c * S.h * (2 * S.q + 2 * S.g) if mixed else attention
