"""Lab 01 - will it fit? The bytes one rank holds at the peak of a real model's step, by formula.

Lab 01's formulas (``memory_accounting.py``) count a GPT layer as Korthikanti et al. (2022) do and the model state
as the ZeRO paper does. A Llama-shaped model, traced by Lab 13, keeps other tensors: grouped-query K and V, a SwiGLU
MLP of width ``ffn``, RMSNorms that work in float32, an untied head, float32 logits for the loss, Mixtral's experts.
This file extends the formulas to that model, term by term as PyTorch saves tensors for backward, and counts what a
*peak* needs that a sum of categories does not: categories live at different moments, so the step is counted at each
moment that can hold the peak (end of forward, start of backward, the head's gradient, the optimizer step) and the
largest wins. Serving is Lab 14's budget: weights, a prefill's peak, the requests' KV blocks.
``tests/test_fit_formula.py`` holds the formulas to Lab 01's functions and to Lab 13's traces.

Every formula is an :class:`fit_expr.Expr`: its text in the symbols of ``SYMBOLS``, the same text filled in, and its
value. Everything is per rank: tensor parallelism over t ranks divides the heads, KV heads (at least one per rank),
MLP and vocabulary as Megatron does (Korthikanti et al. 2022, section 4.2); ZeRO divides the model state over dp
ranks (Rajbhandari et al. 2020).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import fit_compiled  # --compile: a compiled block's saved set
import fit_kth  # --checkpointing every-kth-block
import fit_split  # --tp's embedding moments and --pp's first stage (it reads layer() from here, when called)
from fit_expr import ZERO, Expr, ceil_div, larger, sym, total
from fit_inputs import Inputs
from fit_moments import (autocast_cache, backward_end, block_backward, experts, float8_gather, fsdp_units, head_step,
                         offloaded, recomputed_block, recomputed_gathers, segment_backward)
from fit_lora import (  # noqa: F401 (FROZEN, NF4_BLOCKS, OPT8: the calculator's constants read them here)
    FROZEN, NF4_BLOCKS, OPT8, adam8bit_chunk, counts, fine_tune_state, fine_tune_symbols, lora_activations, lora_step,
    lora_recomputed)
from fit_serve import kv_per_token, prefill, weights
from fit_symbols import INDICES, LEGEND, LSE, ROW, SCALE, SLOT, SYMBOLS  # noqa: F401 (the page's legend reads them here)
from memory_accounting import MOMENTS, RECIPES, STEP_COUNTER, ZERO_SHARDS

# --8<-- [start:recipes]
PRECISIONS = {  # fit.py's --precision: (Lab 01's recipe for the model state, c, r)
    "fp32": ("fp32", 4, 4),
    "bf16": ("bf16", 2, 2),  # pure bf16 (no fp32 master): weights, gradients and AdamW's moments in bf16
    "mixed": ("fp32", 2, 4),  # torch AMP: fp32 weights and state (Lab 01's fp32 recipe), bf16 matmuls
}  # under FSDP2 (ZeRO-2/3), mixed is its MixedPrecisionPolicy: bf16 gathers and stream (r = c), fp32 reduction
OPTIMIZERS = {"adamw": "adamw", "adamw-foreach": "adamw", "adamw-fused": "adamw", "adamw8bit": "adamw", "sgd": "momentum"}
KV_DTYPES = {"fp32": (4, 0), "bf16": (2, 0), "fp8": (1, 0), "fp8-per-head": (1, 0),  # element, fp32 scale per
             "fp8-per-token": (1, 4), "int8": (1, 4)}  # token and KV head (fp8's per-layer scales: a few bytes)
LOSS_CHUNKS = 8  # --loss chunked and fused-linear: chunks of tokens (Lab 13's fit_loss.LOSS_CHUNKS, torchtune's)
# --8<-- [end:recipes]
CATEGORIES = ("parameters", "frozen_weights", "quant_constants", "gradients", "optimizer_state", "activations", "temporaries",
              "communication", "kv_cache", "dequantized")


@dataclass(frozen=True)
class Sizes:
    """What the formulas read off a model and a step, for ONE tensor-parallel rank."""

    spec: object  # labkit.zoo.ModelSpec of the rank: heads, kv_heads, ffn and vocab divided by tp
    P: int  # parameters of the rank
    Pt: int  # trainable parameters: P, or the LoRA adapters'
    n: int  # trainable parameter tensors (AdamW keeps an fp32 step count for each)
    block: int  # parameters of one block
    root: int  # parameters outside the blocks: embedding, final norm, head
    matmuls: int  # weights the blocks' matmuls read: autocast casts each to bf16; QLoRA stores them in NF4
    nf4: tuple[int, int, int, int] = (0, 0, 0, 0)  # QLoRA: code bytes, absmax codes, their scales, linears
    opt8: tuple[int, int, int, int] = (0, 0, 0, 0)  # adamw8bit: 8-bit values, their blocks, float32 values, chunk


def fsdp_mixed(x: Inputs) -> bool:
    """Mixed precision under FSDP2 (ZeRO-2/3), as Lab 13 traces it: MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32), no autocast. fp32 shards, gradients and state; each unit's weights gathered in bf16,
    so the whole forward runs in bf16 (no weight casts); bf16 gradients reduce-scattered in fp32."""
    return x.precision == "mixed" and x.zero_stage >= 2 and x.task != "serve"


def sizes(x: Inputs) -> Sizes:
    """The counts the formulas use; parameter counts are the zoo's closed forms (``param_count``)."""
    s = fit_split.rank_spec(x.spec(), x.tp)
    s = replace(s, layers=-(-s.layers // x.pp))  # --pp: the first stage of 1F1B (fit_split.first_stage)
    P, block = s.param_count(), replace(s, layers=2).param_count() - replace(s, layers=1).param_count()
    gpt = s.family == "gpt"
    n = 12 * s.layers + 4 if gpt else s.layers * (9 + (3 * s.experts - 2 if s.experts else 0)) + 2 + (not s.tied)
    P, n = (P - s.width - (0 if s.tied else s.vocab * s.width), n - 1 - (not s.tied)) if x.pp > 1 else (P, n)
    Pt, n, *lab15 = counts(x, s, P, n)  # LoRA's adapters, QLoRA's NF4 base, 8-bit AdamW (fit_lora.py)
    return Sizes(s, P, Pt, n, block, P - s.layers * block, s.layers * (block - (13 if gpt else 2) * s.width), *lab15)


def symbols(x: Inputs, z: Sizes) -> SimpleNamespace:
    """Each symbol of ``SYMBOLS`` as an :class:`Expr` with this configuration's value."""
    s, (recipe, c, r) = z.spec, PRECISIONS[x.precision]
    w = RECIPES[recipe].param if x.task != "serve" else (4 if x.precision == "fp32" else 2)
    new = min(x.prefill_chunk or x.context, x.context)
    r = c if fsdp_mixed(x) or lora_step(x) else r  # bf16 weights (FSDP2's gathers, a LoRA's base): a bf16 stream
    q, g, E = s.heads * s.head_dim, s.kv_heads * s.head_dim, max(s.experts, 1)  # the matrices --weights stores
    quantized = dict(Pq=2 * s.width * (q + g) + 3 * s.width * s.ffn * E, nq=4 + 3 * E,
                     so=q + 2 * g + s.width + (2 * s.ffn + s.width) * E, si=3 * s.width + q + (2 * s.width + s.ffn) * E)
    values = dict(L=s.layers, h=s.width, a=s.heads, k=s.kv_heads, d=s.head_dim, q=s.heads * s.head_dim,
                  g=s.kv_heads * s.head_dim, f=s.ffn, V=s.vocab, E=s.experts, K=s.top_k, s=x.seq // x.cp, T=x.batch * x.seq // x.cp,
                  P=z.P, Pt=z.Pt, Pb=z.block, Pr=z.root, Pm=z.matmuls, n=z.n, R=x.lora_rank, dp=x.dp // x.replicate * x.cp, w=w,
                  m=RECIPES[recipe].moment, c=c if x.task != "serve" else w, r=r, N=x.requests, C=x.context,
                  B=x.block_size, e=KV_DTYPES[x.kv_dtype][0], p=new, u=-(-x.batch * x.seq // x.cp // LOSS_CHUNKS),
                  b=x.batch, D=x.kv_len or x.seq, j=x.new_tokens, G=x.checkpoint_every or 1, t=x.tp, pp=x.pp, **quantized, **fine_tune_symbols(x, z))
    S = SimpleNamespace(**{k: sym(k, v) for k, v in values.items()}, f8tp=x.float8 == "tensorwise" and x.tp > 1)
    S.Pt = S.P if x.method == "full" else S.Pt  # every weight is trained: the formulas say P
    return S


# --8<-- [start:activations]
def norm(S, readers: int, sp: bool = False) -> Expr:
    """Bytes per token an RMSNorm keeps: its float32 input, 1/rms, the normalised stream, and what the
    matmuls reading it keep (one copy; under autocast, each reader its own bf16 cast); ``sp``: the readers' alone."""
    kept = S.c * S.h if S.c.value == S.r.value else readers * S.c * S.h
    return kept if sp else own(S) + kept


def own(S) -> Expr:  # an RMSNorm's own tensors per token: its float32 input, 1/rms, the normalised stream
    return 4 * S.h + ROW + S.r * S.h


def layer(S, checkpointing: str, sp: bool = False) -> Expr:
    """Bytes one Llama (or Mixtral) block keeps for backward (``sp``: its norms and stream on T / t tokens,
    the gathered inputs of its matmuls whole, as PyTorch's SequenceParallel saves them)."""
    moe = S.E.value > 0
    if checkpointing == "none" and S.f8tp:  # torchao's float8 TP styles: float8 copies of the linears' inputs
        return fit_split.float8_layer(S, sp)
    stream = (ceil_div(S.T, S.t) if sp else S.T) * S.r * S.h  # the block's input (every-k: a segment's)
    if checkpointing in ("full", "every-k"):  # the rest is recomputed
        return stream
    if checkpointing == "save-matmuls":  # Lab 04's: matmul and attention outputs, the input
        mlp = S.K * S.c * (2 * S.f + S.h) + S.c * S.E if moe else S.c * (2 * S.f + S.h)
        kept = S.c * (2 * S.q + 2 * S.g + S.h) + LSE * S.a + mlp
    elif checkpointing == "save-alternate-matmuls":  # torchtitan's: odd matmuls (MoE: router, up or gate+down)
        mlp = S.c * S.E + S.K * S.c * S.f + ceil_div(S.K * S.c * S.h, 2) if moe else S.c * (S.f + S.h)
        kept = S.c * (2 * S.q + S.g) + LSE * S.a + mlp
    else:
        attention = norm(S, 3, sp) + S.c * (2 * S.q + 2 * S.g) + LSE * S.a  # q, k after RoPE, v, SDPA's output
        if moe:  # the router's logits and fp32 probabilities; per routed token its rows, SwiGLU and output
            mlp = norm(S, 1) + experts(S)
        else:
            mlp = norm(S, 2, sp) + 4 * S.c * S.f  # gate, SiLU(gate), up, their product
        kept = attention + mlp
    kept = S.T * kept + stream if checkpointing.startswith("save") else S.T * kept + 2 * S.s * S.d * S.r  # RoPE's cos, sin
    return kept + ceil_div(S.T, S.t) * 2 * own(S) if sp and checkpointing == "none" else kept  # the norms' own


def gpt_layer(S, checkpointing: str) -> Expr:
    """Lab 01's GPT layer (Korthikanti et al. 2022), without dropout: ``activation_bytes_per_layer``."""
    if checkpointing in ("full", "every-k"):
        return S.c * S.T * S.h
    kept = 16 * S.c * S.T * S.h  # save-matmuls: the paper's selective recomputation (no scores kept)
    return kept if checkpointing == "save-matmuls" else kept + S.c * S.a * S.s * S.T


def activations(x: Inputs, S) -> dict[str, Expr]:
    """What the forward keeps for backward, and autocast's bf16 weights, kept or cached."""
    if lora_step(x):  # a frozen base (fit_lora.py)
        return lora_activations(x, S, layer)
    mixed = x.precision == "mixed" and not fsdp_mixed(x)  # autocast's casts; FSDP2 gathers bf16 weights instead
    per = gpt_layer(S, x.checkpointing) if x.spec().family == "gpt" else layer(S, x.checkpointing, x.sp)
    per = fit_compiled.saved(x, S, per) if x.compile else per  # the partitioner's saved set
    head = S.c * S.V * S.h if mixed else ZERO  # the head's bf16 weight, kept by its matmul
    casts = S.c * S.Pm if mixed and x.float8 == "none" else ZERO  # every block's, kept or cached (float8 saves
    # the weight itself, not a cast); offload: what the hooks leave on the device; fit_kth.blocks: every-k, every-kth
    blocks = offloaded(x, S, per, mixed) if x.offload_activations else fit_kth.blocks(x, S, per, mixed)
    if x.loss != "full":  # the final norm's output kept whole (chunked: for the recomputed chunks; fused: its
        kept = blocks + S.T * (4 * S.h + ROW + 2 * S.r * S.h)  # gradient); the head's cast is not kept
    else:
        kept = blocks + S.T * (norm(S, 1, x.sp) + 4 * S.V)  # + the final norm and the loss's fp32 log-softmax
        kept = kept + ceil_div(S.T, S.t) * own(S) if x.sp else kept
        kept = kept + head if mixed else kept
    kept = kept + casts if mixed and x.checkpointing == "none" and not x.offload_activations else kept
    cache = autocast_cache(x, S, casts) if mixed and not x.compile else ZERO  # a compiled block frees its own
    return {"kept": kept, "cache": cache,
            "loss": ZERO if x.loss != "full" else 4 * S.T * S.V + head if mixed else 4 * S.T * S.V, "autocast": mixed}


def chunked_loss(x: Inputs, S, held: dict, act: dict) -> dict[str, dict[str, Expr]]:
    """--loss chunked and fused-linear (Lab 13's fit_loss.py): the moments of the loss, u tokens at a time.
    fused-linear: inside forward, a chunk's weight gradient (c × V × h) made while the head's gradient
    (held from forward to backward), the hidden states and their gradient are alive. chunked: in forward, a
    chunk's logits, their fp32 copy and log-softmax; in backward (the last chunk to come back), the
    log-softmax, its gradient and the logits' gradient, or the head's gradient of that chunk, beside the
    other chunks' input gradients (T − u tokens) and, under autocast, the head's bf16 cast (recomputed)
    and the gradient of it the chunks add up."""
    cast = S.c * S.V * S.h if act["autocast"] else ZERO  # the head weight's bf16 cast (autocast)
    wide = S.c * S.u * S.h if act["autocast"] else ZERO  # a chunk's bf16 cast of its hidden states
    pending = (S.T - S.u) * S.r * S.h  # the other chunks' gradients of their hidden states
    frame = S.T * S.r * S.h if S.r.value < 4 else ZERO  # the blocks' output, still held by forward (the norm copied it)
    if x.loss == "fused-linear":
        logits = 4 * S.u * S.V + S.c * S.u * S.V if S.c.value < 4 else 4 * S.u * S.V
        step = total(act["cache"], cast, S.T * S.r * S.h, logits, ZERO if lora_step(x) else S.c * S.V * S.h, wide, frame)
        head = ZERO if lora_step(x) else (S.c if fsdp_mixed(x) else S.w) * S.V * S.h  # in the weight's dtype
        return {"forward_end": held | {"gradients": total(held["gradients"], head), "activations": act["kept"],
                                       "temporaries": step}}
    logits = (S.c + 8) * S.u * S.V if S.c.value < 4 else 8 * S.u * S.V
    several = S.T.value > S.u.value and not lora_step(x)  # LoRA's frozen head: no weight gradient to sum
    buffer = S.c * S.V * S.h if several else ZERO  # the chunks' weight gradients, summed by autograd as they come
    if act["autocast"]:  # a chunk's head gradient made beside the recomputed cast and the sum so far
        head_gradient = total(pending, S.c * S.u * S.V, cast, buffer, 2 * wide, S.c * S.V * S.h)
    elif several:  # the sum so far, this chunk's gradient and their sum
        head_gradient = total(pending, 3 * S.c * S.V * S.h)
    else:  # one chunk: its matmul's backward
        head_gradient = S.c * S.u * S.V + S.c * S.u * S.h + S.c * S.V * S.h
    return {"forward_end": held | {"activations": act["kept"], "temporaries": total(act["cache"], cast, logits, frame)},
            "backward_start": held | {"activations": act["kept"],
                                      "temporaries": total(pending, 12 * S.u * S.V, cast, buffer, wide)},
            **({} if lora_step(x) else {"head_gradient": held | {"activations": act["kept"], "temporaries": head_gradient}})}
# --8<-- [end:activations]


# --8<-- [start:state]
def model_state(x: Inputs, S) -> dict[str, Expr]:
    """Parameters, gradients and optimizer state on the device: Lab 01's ``zero_model_state`` (the test
    holds them equal), a frozen LoRA base beside its adapters, and what an offload puts on the host."""
    def share(what: str, count: Expr, stage: int = x.zero_stage) -> Expr:
        return ceil_div(count, S.dp) if stage >= ZERO_SHARDS[what] else count

    kind = OPTIMIZERS[x.optimizer]
    fsdp = 3 if x.zero_stage == 2 else x.zero_stage  # FSDP2 keeps shards between steps at ZeRO-2 too
    state = total(MOMENTS[kind] * S.m * share("optimizer_state", S.Pt), STEP_COUNTER * S.n if kind == "adamw" else ZERO)
    out = {"parameters": S.w * share("parameters", S.Pt, fsdp), "gradients": S.w * share("gradients", S.Pt),
           "optimizer_state": state}
    out = fine_tune_state(x, S, out)  # Lab 15: the 8-bit AdamW's blocks; a frozen base beside the adapters
    if x.offload == "params":  # FSDP2's CPU offload: shards, their gradients and the optimizer on the host
        return dict.fromkeys(out, ZERO)
    if x.offload == "optimizer":  # ZeRO-Offload: the state on the host; Lab 07 moves each gradient there too
        out["optimizer_state"] = ZERO
        out["gradients"] = out["gradients"] if x.zero_stage else ZERO
    return out


def communication(x: Inputs, S) -> dict[str, Expr]:
    """Buffers of data-parallel training at each moment: DDP's gradient buckets (a copy of every
    gradient, Lab 10), or what FSDP2 holds gathered (Lab 11's wrap: a unit per block, the root's own)."""
    fwd = bwd = gather = opt = ZERO
    gathered = S.c if fsdp_mixed(x) else S.w  # MixedPrecisionPolicy gathers bf16 weights
    if x.dp > 1 and x.zero_stage <= 1:
        fwd = bwd = gather = opt = S.w * S.Pt
    elif x.zero_stage == 2:  # no resharding after forward: every weight stays gathered until backward ends
        fwd, bwd = gathered * (S.P + S.Pb), gathered * S.P
    elif x.zero_stage == 3:  # the root and one block gathered; backward gathers the root again (buffer + copy)
        fwd = bwd = gathered * (S.Pr + S.Pb)
        gather = 2 * gathered * S.Pr
    end = S.w * S.Pr if fsdp_mixed(x) else ZERO  # the root's fp32 reduce-scatter input; its bf16 weights resharded
    if x.offload == "params":  # two blocks' shards copied to the device first (Lab 13, derived)
        shards = 2 * S.w * ceil_div(ceil_div(S.P, S.L), S.dp)
        fwd, bwd, gather, opt, end = (shards if e is ZERO else e + shards for e in (fwd, bwd, gather, opt, end))
    out = {"forward_end": fwd, "backward_start": bwd, "head_gradient": bwd, "root_gathered": gather, "optimizer": opt,
           "backward_end": end}
    out |= recomputed_gathers(x, S, gathered)  # a block's backward, recomputed or not (fit_moments.py)
    out["embedding_rows"] = out["embedding_end"] = gathered * S.Pr + S.w * S.Pb  # the root, the first block's reduce
    return float8_gather(x, S, gathered, fsdp_units(x, S, gathered, out))  # the embedding and head apart; float8
# --8<-- [end:state]


# --8<-- [start:moments]
def moments(x: Inputs) -> dict[str, dict[str, Expr]]:
    """The categories at each moment that can hold the step's peak, on one rank."""
    S = symbols(x, sizes(x))
    if x.task != "train":
        return {x.task: _full(inference(x, S))}
    state, comm, act = model_state(x, S), communication(x, S), activations(x, S)
    if x.pp > 1:
        return fit_split.first_stage(x, S, state, comm)
    carried = fit_split.carried(x, S, state["gradients"] if x.accumulation > 1 else ZERO)  # earlier micro-batches'
    held = {k: v for k, v in state.items() if k != "gradients"} | {"gradients": carried}
    logits = (4 + S.c) * S.T * S.V if S.c.value < 4 else 4 * S.T * S.V  # the logits and their fp32 copy
    logits = logits + 4 * S.T * S.V if x.tp > 1 else logits  # --tp: loss_parallel's fp32 shifted logits (x − max)
    frame = (ceil_div(S.T, S.t) if x.sp else S.T) * S.r * S.h if S.r.value < 4 else ZERO  # (--sp: T / t tokens)
    out = {
        "forward_end": held | {"activations": act["kept"],  # + the blocks' output, held by forward (a bf16 stream)
                               "temporaries": total(act["cache"], logits, frame)},
        "backward_start": held | {"activations": act["kept"], "temporaries": (12 if x.tp > 1 else 8) * S.T * S.V},
        "optimizer": dict(state),
    }
    if x.optimizer_in_backward:  # fit_backward.py: each parameter stepped in backward, its gradient freed
        del out["optimizer"]["gradients"]
    elif x.optimizer in ("adamw", "adamw-foreach") and x.offload == "none":  # foreach copies a moment
        out["optimizer"]["temporaries"] = S.m * (ceil_div(S.Pt, S.dp) if x.zero_stage else S.Pt)
    out["optimizer"] |= adam8bit_chunk(x, S)  # Lab 15's 8-bit AdamW: a chunk's float32 working copies
    out |= lora_recomputed(x, S, held, layer)  # LoRA, full checkpointing: the last block's recomputed MLP
    out |= fit_split.embedding(x, S, state, held)  # --tp: DTensor's whole embedding gradient; FSDP2: the embedding's backward
    if x.loss != "full":
        del out["backward_start"]
        out |= chunked_loss(x, S, held, act)
    elif x.zero_stage <= 1 and not lora_step(x):  # the head's gradient arrives while the loss's are alive
        head = S.w * S.V * S.h
        out["head_gradient"] = held | {"gradients": head if carried is ZERO else carried,
                                       "activations": act["kept"] - act["loss"],
                                       "temporaries": 8 * S.T * S.V + 4 * S.T * S.h if act["autocast"]  # no autocast:
                                       else S.c * S.T * S.V + S.T * S.r * S.h}  # only the logits' own gradient
    if x.optimizer_in_backward and x.loss == "full" and x.optimizer in ("adamw", "adamw-foreach"):
        out["head_step"] = head_step(S, held, act)
    if x.zero_stage == 3 and x.offload != "params" and x.fsdp_units == "blocks":  # no root gathered again
        out["root_gathered"] = held | {"activations": act["kept"]}
    if {"none": "block_backward", "full": "recomputed_backward", "every-k": "recomputed_backward"}.get(x.checkpointing) in comm and not lora_step(x) \
            and (not S.E.value or x.checkpointing == "none") and x.spec().family != "gpt" and x.offload == "none" and not x.compile:
        out |= block_backward(x, S, held, act) if x.checkpointing == "none" else recomputed_block(x, S, held)
    out |= fit_kth.last_block(x, S, held) if x.checkpointing == "every-kth-block" else {}  # (fit_kth.py)
    out |= fit_compiled.moments(x, S, held, state, act) if x.compile else {}  # a compiled block's backward; the embedding's
    out |= segment_backward(x, S, held, carried, layer(S, "none", False))  # one rank's recomputes (every-k, full)
    if fsdp_mixed(x) and not lora_step(x):  # the root's backward done: its bf16 gradients, about to be reduced
        out["backward_end"] = backward_end(x, S, held, state["gradients"], carried)  # (or the embedding's)
    return {k: _full(v | {"communication": comm.get(k, comm["optimizer"])}) for k, v in out.items()}  # (ZeRO-0)


def peak(x: Inputs) -> tuple[str, dict[str, Expr]]:
    """The moment with the most bytes, and its categories."""
    return max(moments(x).items(), key=lambda kv: sum(e.value for e in kv[1].values()))


def estimate(x: Inputs) -> dict[str, int]:
    """Bytes per category on one rank at the step's peak."""
    return {k: e.value for k, e in peak(x)[1].items()}
# --8<-- [end:moments]


# --8<-- [start:serve]
def inference(x: Inputs, S) -> dict[str, Expr]:
    """``infer``: Lab 13's prefill of batch x seq (every position's logits, the K and V of those
    tokens); ``serve``: Lab 14's budget (weights, a prefill's peak, the requests' KV blocks)."""
    if x.task == "serve":
        kv = S.N * ceil_div(S.C, S.B) * S.B * kv_per_token(S, KV_DTYPES[x.kv_dtype][1])
        return {"parameters": weights(x, S), "activations": prefill(S), "kv_cache": kv}
    if x.task == "decode":  # Lab 13's decode step: the preallocated cache, and a prefill's work over b × j tokens
        step = larger((S.c * S.V + 4 * S.h) * S.b * S.j, S.b * S.j * (3 * S.c * S.f + 3 * S.c * S.h))
        return {"parameters": S.w * S.P, "kv_cache": 2 * S.L * S.b * S.D * S.g * S.c, "temporaries": step}
    work = larger((S.c * S.V + 4 * S.h) * S.T, S.T * (3 * S.c * S.f + 3 * S.c * S.h))  # the logits; an MLP
    if x.precision == "mixed" and not fsdp_mixed(x):  # autocast's cache of every weight's bf16 cast, until the forward ends
        work = S.c * (S.Pm + S.V * S.h) + work
    out = {"parameters": S.w * S.P, "kv_cache": 2 * S.L * S.T * S.g * S.c, "temporaries": work}
    if x.zero_stage == 3:
        out |= {"parameters": S.w * ceil_div(S.P, S.dp), "communication": S.w * (S.Pr + S.Pb)}
    if x.offload == "params":
        out["parameters"] = ZERO
    return out
# --8<-- [end:serve]


def _full(m: dict) -> dict[str, Expr]:
    return {k: m.get(k, ZERO) for k in CATEGORIES}
