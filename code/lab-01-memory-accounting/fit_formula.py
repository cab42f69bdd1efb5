"""Lab 01 - will it fit? The bytes one rank holds at the peak of a real model's step, by formula.

Lab 01's formulas (``memory_accounting.py``) count a GPT layer as Korthikanti et al. (2022) do and
the model state as the ZeRO paper does. A Llama-shaped model, traced by Lab 13, keeps other tensors:
grouped-query K and V, a SwiGLU MLP of width ``ffn``, RMSNorms that work in float32, an untied head,
float32 logits for the loss, Mixtral's experts. This file extends the formulas to that model, term
by term as PyTorch saves tensors for backward, and counts what a *peak* needs that a sum of
categories does not: categories live at different moments, so the step is counted at each moment
that can hold the peak (end of forward, start of backward, the head's gradient, the optimizer step)
and the largest wins. Serving is Lab 14's budget: weights, a prefill's peak, the requests' KV blocks.
``tests/test_fit_formula.py`` holds the formulas to Lab 01's functions and to Lab 13's traces.

Every formula is an :class:`fit_expr.Expr`: its text in the symbols of ``SYMBOLS``, the same text
filled in, and its value. Everything is per rank: tensor parallelism over t ranks divides the heads,
KV heads (at least one per rank), MLP and vocabulary as Megatron does (Korthikanti et al. 2022,
section 4.2); ZeRO divides the model state over dp ranks (Rajbhandari et al. 2020).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from fit_expr import ZERO, Expr, ceil_div, larger, sym
from fit_inputs import Inputs
from memory_accounting import MOMENTS, RECIPES, STEP_COUNTER, ZERO_SHARDS

from labkit import labs

lora, nf4, adam8bit = labs.load(15, "lora"), labs.load(15, "nf4"), labs.load(15, "adam8bit")  # Lab 15's facts

# --8<-- [start:recipes]
PRECISIONS = {  # fit.py's --precision: (Lab 01's recipe for the model state, c, r)
    "fp32": ("fp32", 4, 4),
    "bf16": ("bf16", 2, 2),  # pure bf16 (no fp32 master): weights, gradients and AdamW's moments in bf16
    "mixed": ("fp32", 2, 4),  # torch AMP: fp32 weights and state (Lab 01's fp32 recipe), bf16 matmuls
}  # under FSDP2 (ZeRO-2/3), mixed is its MixedPrecisionPolicy: bf16 gathers and stream (r = c), fp32 reduction
OPTIMIZERS = {"adamw": "adamw", "adamw-foreach": "adamw", "adamw-fused": "adamw", "adamw8bit": "adamw", "sgd": "momentum"}
FROZEN = {"fp32": 4, "bf16": 2, "mixed": 2}  # --method lora|qlora: bytes of a frozen weight (PEFT loads the base in bf16)
#: Lab 15's block sizes: NF4 (weights per absmax, absmax per scale); the 8-bit AdamW (values per absmax,
#: the smallest tensor in 8 bits, values updated at once)
NF4_BLOCKS = (nf4.BLOCK, nf4.DOUBLE_BLOCK)
OPT8 = {"block": adam8bit.BLOCK, "min_8bit": adam8bit.MIN_8BIT, "chunk": adam8bit.BLOCK * adam8bit.CHUNK_BLOCKS,
        "working": adam8bit.WORKING_BYTES}
KV_DTYPES = {"fp32": (4, 0), "bf16": (2, 0), "fp8": (1, 4), "int8": (1, 4)}  # element, fp32 scale per KV head
ROW, LSE, SLOT = 4, 4, 12  # fp32 1/rms per token; fp32 log-sum-exp per head and token; a routed token's index, weight
INDICES = 24  # a serving forward's int64 positions, pool rows and gather index, per new token (LEGEND says each)
# --8<-- [end:recipes]
CATEGORIES = ("parameters", "frozen_weights", "quant_constants", "gradients", "optimizer_state", "activations", "temporaries",
              "communication", "kv_cache")
SYMBOLS = {
    "L": "layers", "h": "hidden size", "a": "attention heads (per rank)", "k": "KV heads (per rank)",
    "d": "head size", "q": "a × d", "g": "k × d", "f": "MLP hidden size (per rank)", "V": "vocabulary (per rank)",
    "E": "experts", "K": "experts per token", "s": "tokens per sequence", "T": "tokens per micro-batch",
    "P": "parameters (per rank)", "Pt": "trainable parameters", "Pb": "parameters of one block",
    "Pr": "parameters outside the blocks", "Pm": "matmul weights of the blocks", "n": "trainable tensors",
    "R": "LoRA rank", "dp": "data-parallel ranks", "w": "bytes of a weight and its gradient",
    "b": "bytes of a frozen weight", "Pc": "bytes of the NF4 codes (⌈n / 2⌉ per linear)",
    "Nb": "NF4 blocks (an 8-bit absmax code per 64 weights)", "Ns": "float32 scales of the absmax codes (one per 256)",
    "Nq": "NF4 linears (a float32 offset each)", "Pk": "trained values with 8-bit moments (tensors of 4,096 or more)",
    "Nk": "blocks of 2,048 of those (a float32 absmax per moment)", "Ps": "trained values with float32 moments",
    "Cw": "values the 8-bit AdamW updates at once (its chunk, or the largest tensor)",
    "m": "bytes of an optimizer moment", "c": "bytes of a matmul operand", "r": "bytes of the residual stream",
    "N": "requests", "C": "tokens per request", "B": "tokens per KV block", "e": "bytes of a cached K or V element",
    "p": "prefill tokens at once",
}
#: What every other name in the formula code the "Will it fit?" page quotes means (``scripts/fit_table.py``
#: writes the page's legend from SYMBOLS, the inputs' help and this, and fails on a name none of them holds).
LEGEND = {
    "S": "the symbols of this configuration (symbols()): S.h is h, with its value",
    "x": "the calculator's inputs (Inputs): x.seq is --seq",
    "Expr": "a formula: its text in symbols, the same text filled in, and its value (fit_expr.py)",
    "Inputs": "the inputs, one field per flag of Lab 13's fit.py and Lab 14's serve_memory.py (fit_inputs.py)",
    "ZERO": "the formula 0",
    "ceil_div": "⌈a / b⌉: a share rounded up",
    "larger": "max(a, b): the larger of two moments",
    "ROW": "bytes of an RMSNorm's fp32 1/rms, per token",
    "LSE": "bytes of flash attention's fp32 log-sum-exp, per head and token",
    "SLOT": "bytes a routed token keeps: its expert's index and weight",
    "INDICES": "bytes per new token of a serving forward's int64 positions, pool rows and gather index",
    "MOMENTS": "optimizer moments per parameter, by optimizer kind (Lab 01)",
    "STEP_COUNTER": "bytes of AdamW's fp32 step count, per trainable tensor (Lab 01)",
    "ZERO_SHARDS": "the ZeRO stage from which each category is sharded (Lab 01)",
    "OPTIMIZERS": "each --optimizer choice's kind, as Lab 01 counts its state",
    "KV_DTYPES": "each --kv-dtype: bytes of a cached element, and of its fp32 scale per KV head",
    "x.spec": "the model: the preset's dimensions, or the typed ones (a labkit.zoo ModelSpec)",
    "fsdp_mixed": "mixed precision under FSDP2 (ZeRO-2 and 3): bf16 gathers, fp32 reduction, no autocast",
    "sizes": "the counts a formula reads off the model and the step, for one rank",
    "symbols": "each count as a symbol with this configuration's value: the S above",
    "_full": "a moment's categories, 0 where it holds none",
    "FROZEN": "bytes of a frozen weight under --method lora or qlora, by --precision (the base PEFT loads)",
    "NF4_BLOCKS": "NF4's blocks (Lab 15): weights per 8-bit absmax code, absmax codes per float32 scale",
    "OPT8": "the 8-bit AdamW (Lab 15): values per absmax, the smallest tensor in 8 bits, values updated at once, "
            "bytes of its working copies",
    "lora": "Lab 15's lora.py: the projections an adapter can target (ALL), their shapes and adapter sizes",
    "nf4": "Lab 15's nf4.py: NF4 with double quantization",
    "adam8bit": "Lab 15's adam8bit.py: the 8-bit AdamW (state_bytes: its state, tensor by tensor)",
    "lora_step": "a LoRA or QLoRA training step (--method lora|qlora, --task train): the base frozen",
}


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


def rank_spec(spec, tp: int):
    """The model one of ``tp`` tensor-parallel ranks holds (as Lab 14's ``per_gpu_spec``)."""
    if tp == 1:
        return spec
    return replace(spec, heads=spec.heads // tp, kv_heads=max(1, spec.kv_heads // tp), ffn=spec.ffn // tp,
                   vocab=-(-spec.vocab // tp), head_dim=spec.head_dim)


def sizes(x: Inputs) -> Sizes:
    """The counts the formulas use; parameter counts are the zoo's closed forms (``param_count``)."""
    s = rank_spec(x.spec(), x.tp)
    P, block = s.param_count(), replace(s, layers=2).param_count() - replace(s, layers=1).param_count()
    gpt = s.family == "gpt"
    n = 12 * s.layers + 4 if gpt else s.layers * (9 + (3 * s.experts - 2 if s.experts else 0)) + 2 + (not s.tied)
    Pt, trained = P, tensors(s)
    if lora_step(x):  # adapters A (R x in) and B (out x R) on each targeted projection of every block
        shapes = lora.shapes(s, x.lora_targets)
        Pt, n = s.layers * lora.adapter_numel([(i, o) for _, i, o in shapes], x.lora_rank), s.layers * 2 * len(shapes)
        trained = [(x.lora_rank * i, s.layers) for _, i, _ in shapes] + [(x.lora_rank * o, s.layers) for _, _, o in shapes]
    codes = (0, 0, 0, 0)
    if lora_step(x) and x.method == "qlora":  # every linear of the blocks in NF4 (nf4.quantize_linears)
        weights = [(i * o, s.layers) for i, o in block_linears(s)]
        blocks = [(-(-v // NF4_BLOCKS[0]), k) for v, k in weights]
        codes = (sum(-(-v // 2) * k for v, k in weights), sum(v * k for v, k in blocks),
                 sum(-(-v // NF4_BLOCKS[1]) * k for v, k in blocks), sum(k for _, k in weights))
    state = (0, 0, 0, 0)
    if x.optimizer == "adamw8bit" and x.task == "train":  # adam8bit.state_bytes, tensor by tensor
        big = [(v, k) for v, k in trained if v >= OPT8["min_8bit"]]
        state = (sum(v * k for v, k in big), sum(-(-v // OPT8["block"]) * k for v, k in big),
                 sum(v * k for v, k in trained if v < OPT8["min_8bit"]), min(OPT8["chunk"], max(v for v, _ in trained)))
    return Sizes(s, P, Pt, n, block, P - s.layers * block, s.layers * (block - (13 if gpt else 2) * s.width), codes,
                 state)


def block_linears(s) -> list[tuple[int, int]]:
    """(in, out) of every linear of one Llama (or Mixtral) block: q, k, v, o, each expert's gate, up and
    down, the router."""
    h, q, g, e = s.width, s.heads * s.head_dim, s.kv_heads * s.head_dim, max(s.experts, 1)
    return [(h, q), (h, g), (h, g), (q, h)] + [(h, s.ffn), (h, s.ffn), (s.ffn, h)] * e + ([(h, s.experts)] if s.experts else [])


def tensors(s) -> list[tuple[int, int]]:
    """Every parameter tensor of the model as (values, how many): what an 8-bit AdamW keeps state for."""
    h, V = s.width, s.vocab
    if s.family == "gpt":  # TinyGPT's blocks: LayerNorms and linears with biases; learned positions; tied head
        per = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
        return [(V * h, 1), (s.context * h, 1), (h, 2)] + [(v, s.layers) for v in per]
    per = [h, h] + [i * o for i, o in block_linears(s)]  # two RMSNorms and the linears
    return [(V * h, 1 if s.tied else 2), (h, 1)] + [(v, s.layers) for v in per]


def symbols(x: Inputs, z: Sizes) -> SimpleNamespace:
    """Each symbol of ``SYMBOLS`` as an :class:`Expr` with this configuration's value."""
    s, (recipe, c, r) = z.spec, PRECISIONS[x.precision]
    w = RECIPES[recipe].param if x.task != "serve" else (4 if x.precision == "fp32" else 2)
    new = min(x.prefill_chunk or x.context, x.context)
    r = c if fsdp_mixed(x) or lora_step(x) else r  # bf16 weights (FSDP2's gathers, a LoRA's base) make a bf16 stream
    values = dict(L=s.layers, h=s.width, a=s.heads, k=s.kv_heads, d=s.head_dim, q=s.heads * s.head_dim,
                  g=s.kv_heads * s.head_dim, f=s.ffn, V=s.vocab, E=s.experts, K=s.top_k, s=x.seq, T=x.batch * x.seq,
                  P=z.P, Pt=z.Pt, Pb=z.block, Pr=z.root, Pm=z.matmuls, n=z.n, R=x.lora_rank, dp=x.dp, w=w,
                  m=RECIPES[recipe].moment, c=c if x.task != "serve" else w, r=r, N=x.requests, C=x.context,
                  B=x.block_size, e=KV_DTYPES[x.kv_dtype][0], p=new, b=FROZEN[x.precision], Pc=z.nf4[0], Nb=z.nf4[1],
                  Ns=z.nf4[2], Nq=z.nf4[3], Pk=z.opt8[0], Nk=z.opt8[1], Ps=z.opt8[2], Cw=z.opt8[3])
    S = SimpleNamespace(**{k: sym(k, v) for k, v in values.items()})
    if x.method == "full":
        S.Pt = S.P  # every weight is trained: the formulas say P
    return S


def lora_step(x: Inputs) -> bool:
    """A LoRA or QLoRA training step (Lab 15): adapters on a frozen base."""
    return x.method != "full" and x.task == "train"


# --8<-- [start:activations]
def norm(S, readers: int) -> Expr:
    """Bytes per token an RMSNorm keeps: its float32 input, 1/rms, the normalised stream, and what the
    matmuls reading it keep (one copy; under autocast, each reader its own bf16 cast)."""
    kept = S.c * S.h if S.c.value == S.r.value else readers * S.c * S.h
    return 4 * S.h + ROW + S.r * S.h + kept


def layer(S, checkpointing: str) -> Expr:
    """Bytes one Llama (or Mixtral) block keeps for backward."""
    moe = S.E.value > 0
    if checkpointing == "full":
        return S.T * S.r * S.h  # the block's input; the rest is recomputed in backward
    if checkpointing == "selective":  # Lab 04's save-matmuls: matmul and attention outputs, the input
        mlp = S.K * S.c * (2 * S.f + S.h) + S.c * S.E if moe else S.c * (2 * S.f + S.h)
        kept = S.c * (2 * S.q + 2 * S.g + S.h) + LSE * S.a + S.r * S.h + mlp
    else:
        attention = norm(S, 3) + S.c * (2 * S.q + 2 * S.g) + LSE * S.a  # q, k after RoPE, v, SDPA's output
        if moe:  # the router's logits and fp32 probabilities; per routed token its rows, SwiGLU and output
            rows = S.r * S.h + (S.c * S.h if S.c.value == S.r.value else 2 * S.c * S.h) + S.c * S.h + SLOT
            mlp = norm(S, 1) + (S.c + 4) * S.E + S.K * (4 * S.c * S.f + rows)
        else:
            mlp = norm(S, 2) + 4 * S.c * S.f  # gate, SiLU(gate), up, their product
        kept = attention + mlp
    return S.T * kept if checkpointing == "selective" else S.T * kept + 2 * S.s * S.d * S.r  # + RoPE's cos, sin


def lora_layer(S, x: Inputs) -> Expr:
    """Bytes one Llama block keeps for backward under LoRA (Lab 15, PEFT's order of operations): its frozen
    weights need no input kept for a gradient, so a matmul's input is kept only where an adapter reads it;
    each adapter keeps its A output, and, under autocast, its own bf16 cast of its input."""
    targets, mixed = set(x.lora_targets), x.precision == "mixed"
    outputs = len(targets) * S.c * S.R  # each adapter's A output, for B's gradient
    if x.checkpointing == "full":
        return layer(S, "full")
    if x.checkpointing == "selective":  # save-matmuls also keeps each adapter's A and B outputs
        out = {"q": S.q, "k": S.g, "v": S.g, "o": S.h, "gate": S.f, "up": S.f, "down": S.h}
        return layer(S, "selective") + S.T * (outputs + S.c * _sum(out[t] for t in lora.ALL if t in targets))
    reads = {"attention": sum(t in targets for t in ("q", "k", "v")), "mlp": sum(t in targets for t in ("gate", "up"))}
    inputs = [(n if mixed else min(n, 1)) * S.c * S.h for n in reads.values() if n]  # the normed stream
    inputs += [S.c * S.q] if mixed and "o" in targets else []  # (attention's output otherwise: SDPA keeps it)
    inputs += [S.c * S.f] if "down" in targets else []  # SiLU(gate) x up
    kept = 2 * (4 * S.h + ROW) + S.c * (2 * S.q + 2 * S.g) + LSE * S.a + 3 * S.c * S.f + outputs  # norms' fp32 input
    kept = kept + _sum(inputs) if inputs else kept  # and 1/rms; q, k, v, SDPA; gate, SiLU, up; what adapters read
    return S.T * kept + 2 * S.s * S.d * S.r  # + RoPE's cos, sin


def _sum(terms) -> Expr:
    out = ZERO
    for t in terms:
        out = t if out is ZERO else out + t
    return out


def gpt_layer(S, checkpointing: str) -> Expr:
    """Lab 01's GPT layer (Korthikanti et al. 2022), without dropout: ``activation_bytes_per_layer``."""
    if checkpointing == "full":
        return S.c * S.T * S.h
    kept = 16 * S.c * S.T * S.h
    return kept if checkpointing == "selective" else kept + S.c * S.a * S.s * S.T


def activations(x: Inputs, S) -> dict[str, Expr]:
    """What the forward keeps for backward, and autocast's bf16 weights, kept or cached."""
    if lora_step(x):
        return lora_activations(x, S)
    mixed = x.precision == "mixed" and not fsdp_mixed(x)  # autocast's casts; FSDP2 gathers bf16 weights instead
    per = gpt_layer(S, x.checkpointing) if x.spec().family == "gpt" else layer(S, x.checkpointing)
    head = S.c * S.V * S.h if mixed else ZERO  # the head's bf16 weight, kept by its matmul
    casts = S.c * S.Pm if mixed else ZERO  # every block's: kept without checkpointing, else cached
    kept = S.L * per + S.T * (norm(S, 1) + 4 * S.V)  # + the final norm and the loss's fp32 log-softmax
    kept = kept + head if mixed else kept
    kept = kept + casts if mixed and x.checkpointing == "none" else kept
    return {"kept": kept, "cache": casts if mixed and x.checkpointing != "none" else ZERO,
            "loss": 4 * S.T * S.V + head if mixed else 4 * S.T * S.V}


def lora_activations(x: Inputs, S) -> dict[str, Expr]:
    """Under LoRA the head and the final norm are frozen: the loss keeps its log-softmax and the final norm
    its fp32 input and 1/rms, as each block's norms do, but for the first block's attention norm, which reads
    the frozen embedding and is not in the graph. With fp32 adapters under autocast (PEFT's), each adapter's
    weight is kept as a bf16 cast too (but for those whose input needs no gradient)."""
    casts = S.c * S.Pt if x.precision == "mixed" else ZERO
    kept = S.L * lora_layer(S, x) + S.T * (4 * S.h + ROW + 4 * S.V)
    if x.checkpointing == "none":  # the first block's attention norm reads the frozen embedding: not in the graph
        kept = kept - S.T * (4 * S.h + ROW)
    if casts is not ZERO and x.checkpointing == "none":  # less the first block's q, k, v A casts: no gradient
        first = sum(t in x.lora_targets for t in ("q", "k", "v"))  # reaches their input, so none is kept
        kept = kept + (casts - first * S.c * S.R * S.h if first else casts)
    return {"kept": kept, "cache": casts if x.checkpointing != "none" else ZERO, "loss": 4 * S.T * S.V}
# --8<-- [end:activations]


# --8<-- [start:state]
def model_state(x: Inputs, S) -> dict[str, Expr]:
    """Parameters, gradients and optimizer state on the device: Lab 01's ``zero_model_state`` (the test
    holds them equal), a frozen LoRA base beside its adapters, and what an offload puts on the host."""
    def share(what: str, count: Expr, stage: int = x.zero_stage) -> Expr:
        return ceil_div(count, S.dp) if stage >= ZERO_SHARDS[what] else count

    kind = OPTIMIZERS[x.optimizer]
    fsdp = 3 if x.zero_stage == 2 else x.zero_stage  # FSDP2 keeps shards between steps at ZeRO-2 too
    state = MOMENTS[kind] * S.m * share("optimizer_state", S.Pt)
    if kind == "adamw":
        state = state + STEP_COUNTER * S.n
    if x.optimizer == "adamw8bit":  # Lab 15: a 1-byte code per moment and value, a float32 absmax per block
        state = 2 * S.Pk + 8 * S.Nk + 8 * S.Ps
    out = {"parameters": S.w * share("parameters", S.Pt, fsdp), "gradients": S.w * share("gradients", S.Pt),
           "optimizer_state": state}
    if lora_step(x):  # the frozen base beside the adapters: weights only (QLoRA: the blocks' linears in NF4)
        out["frozen_weights"] = S.b * S.P if x.method == "lora" else S.b * (S.P - S.Pm) + S.Pc
        if x.method == "qlora":
            out["quant_constants"] = S.Nb + 4 * S.Ns + 4 * S.Nq
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
    weights = S.P
    gathered = S.c if fsdp_mixed(x) else S.w  # MixedPrecisionPolicy gathers bf16 weights
    if x.dp > 1 and x.zero_stage <= 1:
        fwd = bwd = gather = opt = S.w * S.Pt
    elif x.zero_stage == 2:  # no resharding after forward: every weight stays gathered until backward ends
        fwd, bwd = gathered * (weights + S.Pb), gathered * weights
    elif x.zero_stage == 3:  # the root and one block gathered; backward gathers the root again (buffer + copy)
        fwd = bwd = gathered * (S.Pr + S.Pb)
        gather = 2 * gathered * S.Pr
    end = S.w * S.Pr if fsdp_mixed(x) else ZERO  # the root's fp32 reduce-scatter input; its bf16 weights resharded
    if x.offload == "params":  # two blocks' shards copied to the device first (Lab 13, derived)
        shards = 2 * S.w * ceil_div(ceil_div(S.P, S.L), S.dp)
        fwd, bwd, gather, opt, end = (shards if e is ZERO else e + shards for e in (fwd, bwd, gather, opt, end))
    out = {"forward_end": fwd, "backward_start": bwd, "head_gradient": bwd, "root_gathered": gather, "optimizer": opt,
           "backward_end": end}
    if fsdp_mixed(x) and x.zero_stage == 3:  # the root, this block, the next one's gather, the last block's fp32
        out["block_backward"] = S.c * (S.Pr + 2 * S.Pb) + S.w * S.Pb  # reduce-scatter input (kept until the next)
    return out
# --8<-- [end:state]


# --8<-- [start:moments]
def moments(x: Inputs) -> dict[str, dict[str, Expr]]:
    """The categories at each moment that can hold the step's peak, on one rank."""
    S = symbols(x, sizes(x))
    if x.task != "train":
        return {x.task: _full(inference(x, S))}
    state, comm, act = model_state(x, S), communication(x, S), activations(x, S)
    carried = state["gradients"] if x.accumulation > 1 else ZERO  # earlier micro-batches' gradients
    held = {k: v for k, v in state.items() if k != "gradients"} | {"gradients": carried}
    logits = (4 + S.c) * S.T * S.V if S.c.value < 4 else 4 * S.T * S.V  # the logits and their fp32 copy
    out = {
        "forward_end": held | {"activations": act["kept"],
                               "temporaries": logits if act["cache"] is ZERO else act["cache"] + logits},
        "backward_start": held | {"activations": act["kept"], "temporaries": 8 * S.T * S.V},  # fp32 gradients
        "optimizer": dict(state),
    }
    if x.optimizer in ("adamw", "adamw-foreach") and x.offload == "none":  # foreach copies a moment
        out["optimizer"]["temporaries"] = S.m * (ceil_div(S.Pt, S.dp) if x.zero_stage else S.Pt)
    if x.optimizer == "adamw8bit":  # Lab 15's chunk: its float32 working copies
        out["optimizer"]["temporaries"] = OPT8["working"][S.w.value] * S.Cw + 4 * ceil_div(S.Cw, OPT8["block"])
    if x.zero_stage <= 1 and not lora_step(x):  # the head's gradient arrives while the loss's are alive
        head = S.w * S.V * S.h
        out["head_gradient"] = held | {"gradients": head if carried is ZERO else carried,
                                       "activations": act["kept"] - act["loss"],
                                       "temporaries": 8 * S.T * S.V + 4 * S.T * S.h}
    if x.zero_stage == 3 and x.offload != "params":
        out["root_gathered"] = held | {"activations": act["kept"]}
    if "block_backward" in comm and x.checkpointing == "none" and not lora_step(x) and not S.E.value \
            and x.spec().family != "gpt" and x.offload == "none":
        out["block_backward"] = block_backward(x, S, held, act)
    if fsdp_mixed(x) and not lora_step(x):  # the root's backward done: its bf16 gradients, about to be reduced
        blocks = ZERO if x.offload == "params" else S.w * S.L * ceil_div(S.Pb, S.dp)  # every block's fp32 shard
        out["backward_end"] = held | {"gradients": blocks if carried is ZERO else carried, "temporaries": S.c * S.Pr}
    return {k: _full(v | {"communication": comm[k]}) for k, v in out.items()}


def block_backward(x: Inputs, S, held: dict, act: dict) -> dict[str, Expr]:
    """FSDP2's mixed precision at ZeRO-3 (Lab 13's trace): the second block's backward, at its MLP norm's
    backward. The last block's fp32 gradient shard is out, its fp32 reduce-scatter input still held; the
    head's bf16 gradient waits for the root's reduce-scatter; this block's MLP weights' bf16 gradients
    wait for its own. Gone: the loss's log-softmax, the final norm, the last block, this block's MLP."""
    done = S.T * norm(S, 1) + layer(S, "none") + S.T * (4 * S.c * S.f + 4 * S.h + ROW)
    grads = held["gradients"] if x.accumulation > 1 else S.w * ceil_div(S.Pb, S.dp)
    norm_backward = S.T * (5 * 4 * S.h + S.c * S.h + 2 * ROW)  # fp32 x, x², products; the stream's gradient
    return held | {"gradients": grads, "activations": act["kept"] - act["loss"] - done,
                   "temporaries": S.c * S.V * S.h + 3 * S.c * S.h * S.f + norm_backward}


def peak(x: Inputs) -> tuple[str, dict[str, Expr]]:
    """The moment with the most bytes, and its categories."""
    return max(moments(x).items(), key=lambda kv: sum(e.value for e in kv[1].values()))


def estimate(x: Inputs) -> dict[str, int]:
    """Bytes per category on one rank at the step's peak."""
    return {k: e.value for k, e in peak(x)[1].items()}
# --8<-- [end:moments]


# --8<-- [start:serve]
def kv_per_token(S, scale: int) -> Expr:
    """A key and a value per layer and KV head, and an fp32 scale per head when quantized (Lab 14)."""
    return 2 * S.L * S.k * (S.d * S.e + scale) if scale else 2 * S.L * S.k * S.d * S.e


def prefill(S) -> Expr:
    """The peak of a serving prefill beyond weights and KV pool (Lab 14's forward: the last token's
    logits only): p new tokens attending to C; the larger of an RMSNorm's and the MLP's moment."""
    alive = S.p * (S.c * (2 * S.h + S.q + 2 * S.g) + 2 * S.d * S.c + INDICES)  # stream, normed, q, k, v, cos, sin
    if S.E.value:  # Mixtral: the router's fp32 probabilities and the output, then one expert's tokens
        mlp = (S.p * (2 * S.c * S.h + 4 * S.E + SLOT * S.K)
               + ceil_div(S.p * S.K, S.E) * (2 * S.c * S.h + 3 * S.c * S.f + 4 * S.h))
    else:
        mlp = S.p * (S.c * S.h + 3 * S.c * S.f)  # the normed input, SiLU(gate), up, their product
    read = 2 * S.c * S.g * S.C  # the keys and values read from the pool
    if S.p.value < S.C.value:
        read = read + S.p * S.C  # a chunk's attention mask
    return alive + larger(8 * S.p * S.h, mlp) + read


def inference(x: Inputs, S) -> dict[str, Expr]:
    """``infer``: Lab 13's prefill of batch x seq (every position's logits, the K and V of those
    tokens); ``serve``: Lab 14's budget (weights, a prefill's peak, the requests' KV blocks)."""
    if x.task == "serve":
        kv = S.N * ceil_div(S.C, S.B) * S.B * kv_per_token(S, KV_DTYPES[x.kv_dtype][1])
        return {"parameters": S.w * S.P, "activations": prefill(S), "kv_cache": kv}
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
