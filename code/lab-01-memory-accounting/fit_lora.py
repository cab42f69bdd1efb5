"""Lab 01 - will it fit? A fine-tune's formulas (Lab 15): LoRA adapters on a frozen base, QLoRA's NF4
base with its quantization constants, and the 8-bit AdamW's state. ``fit_formula.py`` calls them for
``--method lora|qlora`` and ``--optimizer adamw8bit``; each is written in the symbols of
``fit_symbols.SYMBOLS``, and ``tests/test_fit_formula.py`` holds them to Lab 13's traces of Lab 15's code.
"""

from __future__ import annotations

from fit_expr import ZERO, Expr, ceil_div, total
from fit_inputs import Inputs
from fit_symbols import LSE, ROW

from labkit import labs

lora, nf4, adam8bit = labs.load(15, "lora"), labs.load(15, "nf4"), labs.load(15, "adam8bit")  # Lab 15's facts

FROZEN = {"fp32": 4, "bf16": 2, "mixed": 2}  # --method lora|qlora: bytes of a frozen weight (PEFT loads the base in bf16)
#: Lab 15's block sizes: NF4 (weights per absmax, absmax per scale); the 8-bit AdamW (values per absmax,
#: the smallest tensor in 8 bits, values updated at once, bytes of its working copies per value)
NF4_BLOCKS = (nf4.BLOCK, nf4.DOUBLE_BLOCK, nf4.chunk_of(nf4.BLOCK))  # and the values read back at once
OPT8 = {"block": adam8bit.BLOCK, "min_8bit": adam8bit.MIN_8BIT, "chunk": adam8bit.BLOCK * adam8bit.CHUNK_BLOCKS,
        "working": adam8bit.WORKING_BYTES}


def lora_step(x: Inputs) -> bool:
    """A LoRA or QLoRA training step (Lab 15): adapters on a frozen base."""
    return x.method != "full" and x.task == "train"


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


def counts(x: Inputs, s, P: int, n: int) -> tuple[int, int, tuple, tuple]:
    """Trainable values and tensors (P and n under --method full), QLoRA's (code bytes, absmax codes, their
    scales, linears) and the 8-bit AdamW's (8-bit values, their blocks, float32 values, values at once)."""
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
    return Pt, n, codes, state


# --8<-- [start:lora]
def lora_layer(S, x: Inputs, layer, checkpointing: str | None = None) -> Expr:
    """Bytes one Llama block keeps for backward under LoRA (Lab 15, PEFT's order of operations): its frozen
    weights need no input kept for a gradient, so a matmul's input is kept only where an adapter reads it;
    each adapter keeps its A output, and, under autocast, its own bf16 cast of its input. ``layer``: the
    full fine-tune's block (``fit_formula.layer``), which checkpointing (``x``'s unless given) keeps whole or in part."""
    targets, mixed, checkpointing = set(x.lora_targets), x.precision == "mixed", checkpointing or x.checkpointing
    outputs = len(targets) * S.c * S.R  # each adapter's A output, for B's gradient
    if checkpointing == "full":
        return layer(S, "full")
    if checkpointing == "save-matmuls":  # it also keeps each adapter's A and B outputs
        out = {"q": S.q, "k": S.g, "v": S.g, "o": S.h, "gate": S.f, "up": S.f, "down": S.h}
        return layer(S, "save-matmuls") + S.T * (outputs + S.c * total(*(out[t] for t in lora.ALL if t in targets)))
    reads = {"attention": sum(t in targets for t in ("q", "k", "v")), "mlp": sum(t in targets for t in ("gate", "up"))}
    inputs = [(n if mixed else min(n, 1)) * S.c * S.h for n in reads.values() if n]  # the normed stream
    inputs += [S.c * S.q] if mixed and "o" in targets else []  # (attention's output otherwise: SDPA keeps it)
    inputs += [S.c * S.f] if "down" in targets else []  # SiLU(gate) x up
    kept = 2 * (4 * S.h + ROW) + S.c * (2 * S.q + 2 * S.g) + LSE * S.a + 3 * S.c * S.f + outputs  # norms' fp32 input
    kept = kept + total(*inputs) if inputs else kept  # and 1/rms; q, k, v, SDPA; gate, SiLU, up; what adapters read
    return S.T * kept + 2 * S.s * S.d * S.r  # + RoPE's cos, sin


def lora_activations(x: Inputs, S, layer) -> dict[str, Expr]:
    """Under LoRA the head and the final norm are frozen: the loss keeps its log-softmax and the final norm
    its fp32 input and 1/rms, as each block's norms do, but for the first block's attention norm, which reads
    the frozen embedding and is not in the graph. With fp32 adapters under autocast (PEFT's), each adapter's
    weight is kept as a bf16 cast too (but for those whose input needs no gradient)."""
    casts = S.c * S.Pt if x.precision == "mixed" else ZERO
    loss = 4 * S.T * S.V if x.loss == "full" else ZERO  # chunked, fused-linear: the loss keeps the head's input
    kept = S.L * lora_layer(S, x, layer) + S.T * (4 * S.h + ROW) + (loss if x.loss == "full" else S.T * S.c * S.h)
    if x.checkpointing == "none":  # the first block's attention norm reads the frozen embedding: not in the graph
        kept = kept - S.T * (4 * S.h + ROW)
    if casts is not ZERO and x.checkpointing == "none":  # less the first block's q, k, v A casts: no gradient
        first = sum(t in x.lora_targets for t in ("q", "k", "v"))  # reaches their input, so none is kept
        kept = kept + (casts - first * S.c * S.R * S.h if first else casts)
    return {"kept": kept, "cache": casts if x.checkpointing != "none" else ZERO, "loss": loss, "autocast": False}


def lora_recomputed(x: Inputs, S, held: dict, layer) -> dict[str, dict[str, Expr]]:
    """The moments of a LoRA step's last block that can hold its peak once the loss no longer does (Lab 13's trace).
    --checkpointing full: its backward, the block recomputed, at its MLP's product's gradient: every checkpointed
    input (L x T x h) and the recomputed block's tensors, less the product and the down adapter's A output (freed by
    the down projection's backward); beside them the stream's gradient and, with an adapter on down, the product's
    gradient by the frozen weight, by the adapter and their sum (one without), and the down adapter's gradients;
    with fp32 adapters, the recompute at the down adapter; under QLoRA, the recompute at the down projection's NF4
    weight read back (short sequences). No checkpointing, QLoRA in bf16: that read-back in forward."""
    if not lora_step(x) or x.checkpointing not in ("none", "full") or S.E.value:
        return {}
    down, none = "down" in x.lora_targets, lora_layer(S, x, layer, "none")
    fh = S.f * S.h  # QLoRA: a linear's NF4 weight read back in bf16, a float32 absmax per block and, chunk by chunk,
    work = 12 * fh if fh.value < NF4_BLOCKS[2] else 12 * NF4_BLOCKS[2]  # float32 working copies (a chunk's values
    read = total(S.c * fh, 4 * ceil_div(fh, NF4_BLOCKS[0]), work)  # twice, its codes)
    if x.checkpointing == "none":  # QLoRA in bf16: the last block's down projection read back in forward, every block
        kept = S.L * none - S.T * (4 * S.h + ROW)  # kept but the first's attention norm and the last's down A output
        kept = kept - S.T * S.c * S.R if down else kept
        return {"lora_dequantized": held | {"activations": kept, "temporaries": 3 * S.T * S.c * S.h, "dequantized": read}
                } if x.method == "qlora" and x.precision == "bf16" else {}
    block = none - S.T * S.c * S.f - (S.T * S.c * S.R if down else ZERO)
    grads = held["gradients"] if held["gradients"] is not ZERO else S.w * S.R * (S.f + S.h) if down else ZERO
    out = {"lora_recomputed": held | {"gradients": grads, "activations": S.L * S.T * S.r * S.h,
                                      "temporaries": block + S.T * S.c * S.h + (3 if down else 1) * S.T * S.c * S.f}}
    if x.precision == "mixed" and down:  # the recompute's down adapter: PEFT casts the product to the fp32 adapter's
        # dtype, autocast back to bf16 (kept); beside them the product, the base's output, the block's input, the MLP
        # norm's output and two stream gradients, and the block's adapter weights cast to bf16
        out["lora_recompute_down"] = held | {"activations": S.L * S.T * S.r * S.h, "temporaries": total(
            none, ceil_div(S.c * S.Pt, S.L), 5 * S.T * S.c * S.h, S.T * S.c * S.f, 4 * S.T * S.f)}
    if x.method == "qlora" and (x.precision == "bf16" or down):  # the recompute's down projection read back
        alive = none + 3 * S.T * S.c * S.h  # the block's input and two stream gradients beside; not down's A output
        alive = alive - S.T * S.c * S.R if down else alive
        if x.precision == "mixed":  # the product for its bf16 cast, not down's weights cast; the others', the MLP norm's
            alive = total(alive, ceil_div(S.c * S.Pt, S.L), S.T * S.c * S.h) - S.c * S.R * (S.f + S.h)  # output
        out["lora_dequantized"] = held | {"activations": S.L * S.T * S.r * S.h, "temporaries": alive, "dequantized": read}
    return out


def frozen_state(x: Inputs, S) -> dict[str, Expr]:
    """The frozen base beside the adapters: weights only (QLoRA: the blocks' linears as NF4 codes, with an
    8-bit absmax per 64 weights, a float32 scale per 256 absmax and a float32 offset per linear)."""
    if x.method == "lora":
        return {"frozen_weights": S.wb * S.P}
    return {"frozen_weights": S.wb * (S.P - S.Pm) + S.Pc, "quant_constants": S.Nb + 4 * S.Ns + 4 * S.Nq}


def fine_tune_symbols(x: Inputs, z) -> dict[str, int]:
    """Lab 15's symbols' values: a frozen weight's bytes, QLoRA's NF4 counts, the 8-bit AdamW's (``z``: the Sizes)."""
    return dict(wb=FROZEN[x.precision], Pc=z.nf4[0], Nb=z.nf4[1], Ns=z.nf4[2], Nq=z.nf4[3], Pk=z.opt8[0],
                Nk=z.opt8[1], Ps=z.opt8[2], Cw=z.opt8[3])


def fine_tune_state(x: Inputs, S, out: dict[str, Expr]) -> dict[str, Expr]:
    """``out``, the model state, with the 8-bit AdamW's codes in blocks for its state and, under LoRA, the
    frozen base beside the adapters: weights only (QLoRA: the blocks' linears in NF4)."""
    if x.optimizer == "adamw8bit":
        out["optimizer_state"] = adam8bit_state(S)
    return out | frozen_state(x, S) if lora_step(x) else out


def adam8bit_chunk(x: Inputs, S) -> dict[str, Expr]:
    """The 8-bit AdamW's chunk at the optimizer step: its float32 working copies (nothing for another optimizer)."""
    if x.optimizer != "adamw8bit":
        return {}
    return {"temporaries": OPT8["working"][S.w.value] * S.Cw + 4 * ceil_div(S.Cw, OPT8["block"])}


def adam8bit_state(S) -> Expr:
    """Lab 15's 8-bit AdamW: a 1-byte code per moment and value, a float32 absmax per block and moment; float32
    moments for tensors under 4,096 values."""
    return 2 * S.Pk + 8 * S.Nk + 8 * S.Ps
# --8<-- [end:lora]
