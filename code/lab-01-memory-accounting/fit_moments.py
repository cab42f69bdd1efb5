"""Lab 01 - will it fit? What only some of Lab 13's flags add to the formulas: what activation offload leaves on
the device, the head's own optimizer step in backward, every-k's recomputed segment, and FSDP2's second
block's backward at ZeRO-3 (a MoE block's too; with full or every-k checkpointing, a block recomputed, at ZeRO-2 too), and the
embedding and the head as FSDP2 units of their own. ``fit_formula.py``
calls each where its flag is given; the "Will it fit?" page quotes them beside its other sections, and
``tests/test_fit_formula.py`` holds each to Lab 13's trace at real size."""

from __future__ import annotations

import fit_kth
from fit_expr import ZERO, Expr, ceil_div, larger, total
from fit_inputs import Inputs
from fit_symbols import ROW, SLOT


# --8<-- [start:flags]
def offloaded(x: Inputs, S, per: Expr, mixed: bool) -> Expr:
    """--offload-activations (Lab 13's fit_offload.py, Lab 09's hooks): what the blocks keep on the device. Every
    tensor they save waits on the host but the last two saved: the last block's gate × up product and (autocast)
    the down projection's bf16 weight, or (no autocast) its up projection's output. With checkpointing, the
    hooks see only each checkpoint's input (the last two stay); a policy's saved matmul outputs stay too."""
    if x.checkpointing == "none":
        return S.T * S.c * S.f + S.c * S.f * S.h if mixed else 2 * S.T * S.c * S.f
    inputs = ceil_div(S.L, S.G) if x.checkpointing == "every-k" else S.L
    if x.checkpointing in ("full", "every-k"):
        return 2 * S.T * S.r * S.h if inputs.value >= 2 else S.T * S.r * S.h
    return S.L * per - (S.L - 2) * S.T * S.r * S.h


def autocast_cache(x: Inputs, S, casts: Expr) -> Expr:
    """Autocast's cache of the blocks' bf16 weight casts, alive until forward ends: with checkpointing (the saved
    casts are recomputed), and with offload (they are saved on the host; the last block's down cast is one of the
    two kept on the device, counted by :func:`offloaded`); without either, the casts are kept activations."""
    if x.checkpointing == "none":
        return casts - S.c * S.f * S.h if x.offload_activations else ZERO
    return fit_kth.cached(S, True) if x.checkpointing == "every-kth-block" else casts  # (its plain blocks keep theirs)


def head_step(S, held: dict, act: dict) -> dict[str, Expr]:
    """--optimizer-in-backward (Lab 13's fit_backward.py) with foreach AdamW: the head's own step, as soon as its
    gradient is accumulated: foreach's copy of a moment the head's size, beside the head's gradient and the
    gradient of its input (the stream's dtype); the loss's tensors and the head's input already freed."""
    return held | {"gradients": S.w * S.V * S.h, "activations": act["kept"] - act["loss"] - S.T * S.c * S.h,
                   "temporaries": S.m * S.V * S.h + S.T * S.r * S.h}


def segment_backward(x: Inputs, S, held: dict, carried: Expr, none: Expr) -> dict[str, dict[str, Expr]]:
    """--checkpointing every-k or full without FSDP2 (one rank, DDP, ZeRO-1; Lab 13's trace): the backward of the last
    segment to come back, the first G blocks (full: the first block), recomputed whole (each block's activations and,
    under autocast, its weights' bf16 casts), at its last MLP's gate × up product's backward: the down projection's
    gradient is made, its input freed. Every gradient but the embedding's and the segment's is alive (with
    accumulation: all of them, carried, and the segment that comes back first, the last: every segment's input kept,
    L − G × (⌈L / G⌉ − 1) blocks). Full checkpointing: also the last block's (``recompute_last``). Empty where it is
    not traced: FSDP2, offload, LoRA, a MoE or a GPT block; every-k with data parallelism; full with --sp, --cp,
    --float8 or --compile."""
    full = x.checkpointing == "full" and not (x.sp or x.cp > 1 or x.float8 != "none" or x.compile)
    if not (full or x.checkpointing == "every-k" and x.dp == 1) or x.zero_stage > 1 or x.offload != "none" \
            or x.method != "full" or S.E.value or x.spec().family == "gpt":
        return {}
    n, mixed = ceil_div(S.L, S.G), x.precision == "mixed"
    blocks = S.L - S.G * (n - 1) if carried is not ZERO else S.G
    others = S.Pt - S.G * S.Pb if x.spec().tied else S.Pt - S.V * S.h - S.G * S.Pb  # not the embedding's
    grads = carried if carried is not ZERO else ZERO if x.optimizer_in_backward else S.w * (others + S.f * S.h)
    kept = n * S.T * S.r * S.h if carried is not ZERO else ZERO if x.offload_activations else S.T * S.r * S.h
    recomputed = blocks * (none + ceil_div(S.c * S.Pm, S.L) if mixed else none)  # none: a block's, kept whole
    out = {"segment_backward": held | {"gradients": grads, "activations": kept,
                                       "temporaries": recomputed + recompute_tail(x, S)}}
    return out | recompute_last(x, S, held, carried, none) if full else out


def recompute_last(x: Inputs, S, held: dict, carried: Expr, none: Expr) -> dict[str, dict[str, Expr]]:
    """Full checkpointing under autocast without FSDP2: the last block's backward, the first to come back, at the end of
    its recompute (Lab 13's trace: under --tp, where a rank's MLP is f / t wide, it overtakes the first block's).
    Alive: every block's checkpointed input; the head's and the final norm's gradients (tied: the embedding's too); the
    block recomputed whole (``layer`` with nothing checkpointed and, under autocast, its weights' bf16 casts, the down
    projection's just made); the stream's gradient from the final norm's backward (T × r × h) and, under autocast,
    the bf16 copy of a T × h tensor the recompute makes before its first norm. (In bf16 and fp32 under --tp the peak
    is later, in the MLP's backward: not formulated here.)"""
    if x.offload_activations or x.optimizer_in_backward or x.precision != "mixed":
        return {}
    head = S.Pr if x.spec().tied else S.Pr - S.V * S.h
    work = total(none, ceil_div(S.c * S.Pm, S.L), S.T * S.r * S.h, S.T * S.c * S.h)
    return {"recomputed_last": held | {"gradients": S.w * head if carried is ZERO else carried,
                                       "activations": S.L * S.T * S.r * S.h, "temporaries": work}}


def recompute_tail(x: Inputs, S) -> Expr:
    """Beside a block recomputed on one rank (every-k's segment, every-kth-block's last block), at its MLP's gate × up
    product's backward, read op by op off the trace: the product's gradient and one factor's (2 c T f: the product
    freed); in bf16 one more T × h stream tensor; under autocast two, less the fp32 one the norm's backward
    freed, and less the down projection's bf16 weight cast, which the recompute stops before remaking."""
    tail = 2 * S.T * S.c * S.f
    if x.precision == "mixed":
        return tail + 2 * S.T * S.c * S.h - 4 * S.T * S.h - S.c * S.f * S.h
    return tail + S.T * S.c * S.h if x.precision == "bf16" else tail


def experts(S) -> Expr:
    """Bytes per token a MoE block's MLP keeps past its norm: the router's logits and fp32 probabilities; per routed
    token its rows, its expert's SwiGLU (gate, SiLU(gate), up, their product) and output (``layer`` reads it)."""
    rows = S.r * S.h + (S.c * S.h if S.c.value == S.r.value else 2 * S.c * S.h) + S.c * S.h + SLOT
    return (S.c + 4) * S.E + S.K * (4 * S.c * S.f + rows)


def block_backward(x: Inputs, S, held: dict, act: dict) -> dict[str, dict[str, Expr]]:
    """FSDP2 at ZeRO-3 (under --float8, ZeRO-2 too; Lab 13's trace): the second block's backward, at its MLP norm's
    backward (a MoE block's experts' gradients as its MLP's). The last block's gradient shard is out, its reduce-scatter
    input (under FSDP2's mixed precision, fp32) still held; the
    head's bf16 gradient waits for the root's reduce-scatter; this block's MLP weights' bf16 gradients
    wait for its own. Gone: the loss's log-softmax, the final norm, the last block, this block's MLP.
    With --fsdp-units blocks-embed-head, the last block's: the head unit's gradient shard out, its fp32
    reduce-scatter input held (``fsdp_units``), no head gradient waiting; the last block not yet gone; and, before
    it, the head's reduce-scatter: its bf16 gradient not yet freed as the first block is gathered (head_reduced)."""
    from fit_formula import fit_split, layer, norm  # here: fit_formula imports this file
    units = x.fsdp_units != "blocks"
    mlp, weight_grads = (experts(S), S.E * (3 * S.c * S.h * S.f + S.c * S.h)) if S.E.value else (4 * S.c * S.f, 3 * S.c * S.h * S.f)
    last = ZERO if units else layer(S, "none", False)  # the last block's activations, gone
    mlp_done = S.T * (mlp + 4 * S.h + ROW)  # float8 TP styles: its float8 copies, the norm's fp32 input still read
    mlp_done = fit_split.float8_mlp(S, x.sp) - 4 * (ceil_div(S.T, S.t) if x.sp else S.T) * S.h if S.f8tp else mlp_done
    done = total(S.T * norm(S, 1), last, mlp_done)
    grads = held["gradients"] if x.accumulation > 1 else S.w * ceil_div(S.Pr - S.V * S.h if units else S.Pb, S.dp)
    norm_backward = S.T * (5 * 4 * S.h + S.c * S.h + 2 * ROW)  # fp32 x, x², products; the stream's gradient
    out = {"block_backward": held | {"gradients": grads, "activations": act["kept"] - act["loss"] - done, "temporaries":
                                     total(ZERO if units else S.c * S.V * S.h, weight_grads, norm_backward)}}
    if x.float8 == "tensorwise" and not units and not S.f8tp:  # or earlier (float8, no --tp): the gate weight cast to
        cast = held | {"gradients": grads, "activations": act["kept"] - act["loss"] - total(S.T * norm(S, 1), last, S.T * mlp),
                       "temporaries": total(S.c * S.V * S.h, 2 * S.c * S.f * S.h, 5 * S.f * S.h, S.c * S.T * S.f, S.T * S.f,
                                            2 * S.T * S.c * S.h)}  # e4m3 for its input's gradient, as recomputed_mlp's
        # (5), the MLP norm's tensors not yet freed
        out["block_backward"] = max(out["block_backward"], cast, key=lambda m: sum(e.value for e in m.values()))
    if units:  # the second block's, as without its own units but for the head's gradient (reduced) and its shard
        out["second_block_backward"] = held | {"gradients": held["gradients"] if x.accumulation > 1 else
                                               grads + S.w * ceil_div(S.Pb, S.dp), "activations": act["kept"] -
                                               act["loss"] - done - layer(S, "none", False), "temporaries":
                                               total(weight_grads, norm_backward)}
    if units:  # the final norm gone; the head's gradient and the stream's beside its reduce-scatter
        out["head_reduced"] = held | {"gradients": grads, "activations": act["kept"] - act["loss"] - S.T * norm(S, 1),
                                      "temporaries": S.c * S.V * S.h + S.T * S.c * S.h}
    return out


def segmented(x: Inputs, S) -> bool:
    """--checkpointing every-k with segments of more than one block (of one: full checkpointing's moments)."""
    return x.checkpointing == "every-k" and S.G.value > 1


def last_segment(S) -> Expr:
    """Blocks in every-k's last segment, the first to come back: what the others leave, L − G × (⌈L / G⌉ − 1)."""
    return S.L - S.G * (ceil_div(S.L, S.G) - 1)


def recomputed_blocks(x: Inputs, S, at: str = "front") -> Expr | int:
    """Blocks FSDP2 holds gathered in a recomputed block's backward (``recomputed_block``'s moment ``at``: front, end,
    second or last): this one and the next one's gather (at the first block, no next one), or a segment, all gathered
    by its recompute (G blocks, or the last segment's). At ZeRO-2 (no resharding after forward, but each unit's
    post-backward reshards it), past the front: every block whose backward is not done (all but the last segment's at
    the second segment from the end, or at the end without its own head unit; else all of them)."""
    units, every = x.fsdp_units != "blocks", segmented(x, S)
    if x.zero_stage == 2 and at != "front":
        done = at == "second" or (at == "end" and not units)
        return S.L - (last_segment(S) if every else 1) if done else S.L
    if not every:  # the moment's block: the front's is the second, the end's the second from the end (its own units: last)
        first = {"end": S.L.value - (1 if units else 2), "last": S.L.value - 1}.get(at, 1) == 0
        return 1 if first else 2
    blocks = last_segment(S) if at == "last" or (at == "end" and units) else S.G
    return blocks if blocks.value > 1 else 2


def recomputed_gathers(x: Inputs, S, gathered: Expr) -> dict[str, Expr]:
    """What FSDP2 holds in a block's backward (ZeRO-3; recomputed, ZeRO-2 too): the root, the blocks
    ``recomputed_blocks`` says, and the block after's reduce-scatter input (under FSDP2's mixed, in fp32; kept until
    the next), at the end of backward and at its front; at the last block's, no reduce-scatter yet."""
    if x.zero_stage < 2:
        return {}
    out = {moment: gathered * (S.Pr + recomputed_blocks(x, S, at) * S.Pb) + S.w * S.Pb
           for moment, at in (("recomputed_backward", "end"), ("recomputed_front", "front"))}
    out["recomputed_last"] = gathered * (S.Pr + recomputed_blocks(x, S, "last") * S.Pb)
    zero2 = x.fsdp_units == "blocks" and x.float8 != "none"  # ZeRO-2 (float8): the second block's backward, every
    return out | ({"block_backward": out["recomputed_backward"]} if x.zero_stage == 3 or zero2 else {})  # block gathered


def recomputed_block(x: Inputs, S, held: dict) -> dict[str, dict[str, Expr]]:
    """--checkpointing full or every-k under FSDP2 at ZeRO-3 or ZeRO-2 (Lab 13's trace): a block's backward, the block
    (every-k: its segment) recomputed whole, at the peak of its MLP's backward (``recomputed_mlp``; under --tp a TP rank's block, its
    checkpointed inputs on T / t tokens under --sp). FSDP2 holds the root, the
    blocks ``recomputed_blocks`` says and the block after's reduce-scatter input (``recomputed_gathers``). Each block
    done frees its checkpointed input and leaves its gradient shard, so the peak is near one end: the second block
    (segment) from the end (with --fsdp-units blocks-embed-head, the last: the head unit's shard out; and the second,
    where the last segment is shorter), or the second from the front (at the first, no next block is gathered; every-k:
    the first segment), or with its own units the first (the embedding's gather, larger than a block's, in flight:
    ``fsdp_units``); the front one counted where it is another block; without its own units the last block's (segment's)
    too, nothing reduced yet (recomputed_last: larger in bf16 at 2 blocks, or at ZeRO-2, where FSDP2 holds every block
    whose backward is not done, for a last segment of more than one block). Alive beside, but under its own head unit
    (reduced before the blocks' backward), the head's bf16 gradient waiting for the root's reduce-scatter: under
    fused-linear the one made in forward (an activation), else backward's. The final norm's tensors, the loss's and the
    later blocks' recomputes are gone. Segments of one block are full checkpointing's moments (``segmented``). Under
    --float8 (Lab 13's fit_float8.py) the block's peak can come earlier, at its down projection's weight gradient: the
    gradient of its input made (c × T × f) beside the output's e5m2 gradient (T × h) and its saved input cast again,
    an fp32 copy and its e4m3 bits (5 × T × f); the gate × up product's gradients not yet made."""
    from fit_formula import layer  # here: fit_formula imports this file
    units = x.fsdp_units != "blocks"
    head = ZERO if units else S.c * S.V * S.h
    stream = layer(S, x.checkpointing, x.sp)  # a checkpointed input (--sp: on T / t tokens)
    shard = ceil_div(S.Pb, S.dp)  # a block's fp32 gradient shard
    ends = {}  # per moment, alive: this block's input and those before it; the shards of the blocks after it
    if segmented(x, S):  # a segment recomputed, at its last block's backward: the second from the end (under its
        segments, left = ceil_div(S.L, S.G), last_segment(S)  # own units, the last: L − G × (⌈L / G⌉ − 1) blocks)
        if units:  # and the first (G blocks each); under its own units the second from the end too
            ends["recomputed_backward"] = (segments * stream, ZERO, left)
            if segments.value >= 3:  # (larger where the last segment is shorter, at ZeRO-2: every block gathered)
                ends["recomputed_second"] = ((segments - 1) * stream, left * shard, S.G)
        elif segments.value >= 3:  # the last segment's shards out, the inputs of the segments before it alive
            ends["recomputed_backward"] = ((segments - 1) * stream, left * shard, S.G)
        if segments.value >= 2:
            ends["recomputed_front"] = (stream, (S.L - S.G) * shard, S.G)
        last = (segments * stream, ZERO, left)
    else:
        if S.L.value >= (1 if units else 2):
            ends["recomputed_backward"] = (S.L * stream, ZERO, 1) if units else ((S.L - 1) * stream, shard, 1)
        if S.L.value >= (2 if units else 4):  # the front: another block
            ends["recomputed_front"] = (stream, (S.L - 1) * shard, 1) if units else (2 * stream, (S.L - 2) * shard, 1)
        last = (S.L * stream, ZERO, 1)
    if not units:  # the last block's (segment's): nothing reduced yet (in bf16, a last segment of more blocks, ZeRO-2)
        ends["recomputed_last"] = last
    fused, out = x.loss == "fused-linear", {}
    for moment, (inputs, done, blocks) in ends.items():
        work = recomputed_mlp(x, S, blocks)
        if x.float8 != "none":  # or, earlier, at the down projection's weight gradient: its input's gradient made, the
            cast = S.c * S.T * S.f + S.T * S.h + 5 * S.T * S.f  # e5m2 gradient, its saved input's fp32 copy and e4m3 cast
            recomputed = layer(S, "none", False) if blocks == 1 else blocks * layer(S, "none", False)
            work = larger(work, total(recomputed, cast, S.T * S.c * S.h))  # (float8: bf16 or mixed, the stream's c)
        own = ceil_div(S.Pr - S.V * S.h, S.dp) if units else ZERO  # the head unit's shard
        out[moment] = held | {"gradients": held["gradients"] if x.accumulation > 1 else S.w * total(own, done),
                              "activations": total(inputs, head) if fused else inputs,
                              "temporaries": work if fused else total(work, head)}
    return out


def recomputed_mlp(x: Inputs, S, n=None) -> Expr:
    """What a recomputed block's backward holds at its peak (FSDP2 at ZeRO-3, Lab 13's trace), beside what FSDP2 and
    the blocks before it hold: the block recomputed whole (``layer`` with nothing checkpointed; every-k: its segment),
    then its MLP's backward, op by op. Each MLP weight's bf16 gradient stays until the block is done (FSDP2 reduces
    them together), so the peak is the largest of four points: (1) the gate × up product's backward, its two factors'
    gradients made (the product freed, its gradient made by the down projection); (2) under --sp, just before that,
    the product and its gradient alive beside the block output's gradient, all-gathered to T tokens for the down
    projection; (3) the MLP's last matmul backward, its four T × f tensors freed: the gradients of its input from the
    up and the gate projections (T × h each, not yet summed: all-reduced, or reduce-scattered under --sp) and SiLU's
    backward; (4) the MLP norm's backward, the norm's other tensors and the MLP's input gradients freed: its fp32
    input and five fp32 products (in fp32, four: nothing to cast), and a sum per token; --sp: on T / t tokens. Under
    tensor parallelism the MLP is f / t wide while the norm and the stream are not, so (3) or (4) overtakes (1). All
    along, the stream's gradient (--sp: T / t tokens). In fp32 the block's first norm reads its checkpointed input
    itself: no float32 copy of it (``layer`` counts one). Under --float8 tensorwise without --tp (5): the gate weight's cast to
    e4m3 for its input's gradient, its fp32 copy and bits (5 × f × h) beside the down and up weights' gradients, the
    gate output's gradient and its e5m2 bits, and up's input gradient (at short sequences the weights' copies win).
    ``n``: the blocks recomputed together (every-k: a segment, its last shorter; default G, or 1 under full
    checkpointing). One block alone (6): its attention norm's backward, the block's other tensors freed, the norm's six
    fp32 tensors (five in fp32) beside all seven weights' bf16 gradients (at short sequences the attention's win)."""
    from fit_formula import fit_split, layer, norm, own  # here: fit_formula imports this file
    tokens, fp32 = ceil_div(S.T, S.t) if x.sp else S.T, S.r.value == 4  # the norms' and the stream's tokens
    n = (S.G if x.checkpointing == "every-k" else 1) if n is None else n  # the blocks recomputed together
    blocks = layer(S, "none", x.sp) if n == 1 else n * layer(S, "none", x.sp)
    blocks = blocks - 4 * tokens * S.h if fp32 else blocks
    mlp_norm = S.T * norm(S, 2, x.sp) + tokens * own(S) if x.sp else S.T * norm(S, 2)  # all the MLP's norm keeps
    before = blocks - 4 * S.T * S.c * S.f - mlp_norm  # alive through the MLP's backward: all but the MLP's own
    before = blocks - fit_split.float8_mlp(S, x.sp) if S.f8tp else before  # (its float8 copies, float8 TP styles)
    mlp_norm = S.T * S.h + tokens * own(S) if S.f8tp else mlp_norm  # (there: its own tensors, its float8 output)
    weight = S.c * S.f * S.h  # one MLP weight's bf16 gradient
    product = mlp_norm + total(6 * S.T * S.c * S.f, weight)  # (1): gate, SiLU(gate), up; three T × f gradients
    if x.sp:  # (2): the four, the product's gradient and the gathered gradient of the block's output
        product = larger(product, mlp_norm + total(5 * S.T * S.c * S.f, S.T * S.c * S.h, weight))
    inputs = mlp_norm + total(S.T * S.c * S.f, 2 * S.T * S.c * S.h, 3 * weight)  # (3)
    norm_backward = tokens * ((20 if fp32 else 24) * S.h + ROW) + 3 * weight  # (4): 5 or 6 fp32 tensors
    attention = norm_backward + S.c * (2 * S.q + 2 * S.g) * S.h  # (6): the same at the first norm; seven gradients
    if x.float8 == "tensorwise" and not S.f8tp:  # (5) float8: the gate weight cast to e4m3 for its input's gradient, its fp32
        cast = mlp_norm + total(S.c * S.T * S.f, S.T * S.f, S.T * S.c * S.h, 2 * weight, 5 * S.f * S.h)  # copy and bits
        norm_backward = larger(norm_backward, cast)  # beside: down's and up's weight gradients, the gate output's
    peak = total(before, larger(larger(product, inputs), norm_backward))  # gradient and e5m2 bits
    peak = larger(peak, attention) if getattr(n, "value", n) == 1 else peak  # (6): one block, its other tensors freed
    return total(peak, tokens * S.c * S.h)


def fsdp_units(x: Inputs, S, gathered: Expr, comm: dict) -> dict:
    """--fsdp-units blocks-embed-head (Lab 13's fit_units.py): the embedding a unit, the final norm and the head
    another, kept gathered from forward to backward. At the end of forward FSDP2 holds the head unit's gathered
    weights and, until the next gather, the buffer they were gathered into; in backward the weights alone. The
    embedding is gathered only around its own forward and backward: no root to gather again in backward. Under
    ZeRO-3 a chunked or fused-linear loss reads the head's weight without calling the head, so FSDP2 (torch 2.13's
    ``_force_complete_incomplete_states``) hooks the head unit's pre-backward on the model's output, the loss: it
    runs as backward starts and prefetches the last block, gathered beside the loss's backward (its chunks)."""
    if x.fsdp_units == "blocks":
        return comm
    head = S.Pr - S.V * S.h  # the final norm and the head
    fwd, bwd = (gathered * (S.P + head), gathered * S.P) if x.zero_stage == 2 else (2 * gathered * head, gathered * head)
    bwd = gathered * (head + S.Pb) if x.zero_stage == 3 and x.loss != "full" else bwd  # the last block prefetched
    out = comm | {"forward_end": fwd, "backward_start": bwd, "head_gradient": bwd, "root_gathered": ZERO,
                  "backward_end": ZERO if comm["backward_end"] is ZERO else S.w * S.V * S.h}  # the embedding's fp32
    if "recomputed_backward" in comm:  # the last block's backward: it and the next gathered (ZeRO-2: every block and
        embed = S.V * S.h if x.zero_stage == 2 else ZERO  # the embedding), the head's gradient (reduce-scatter input)
        out["recomputed_backward"] = gathered * total(recomputed_blocks(x, S, "end") * S.Pb, embed) + S.w * head
        out["recomputed_front"] = gathered * total(recomputed_blocks(x, S) * S.Pb, embed) + S.w * S.Pb if segmented(x, S) \
            else gathered * (S.Pb + S.V * S.h) + S.w * S.Pb  # the first segment's; the first block's: the embedding's gather
        out["recomputed_second"] = gathered * total(recomputed_blocks(x, S, "second") * S.Pb, embed) + S.w * S.Pb
    if "block_backward" in comm:  # and the second block's: it and the next gathered, the last block's reduce-scatter
        out["block_backward"], out["second_block_backward"] = out["recomputed_backward"], 2 * gathered * S.Pb + S.w * S.Pb
        out["head_reduced"] = gathered * S.Pb + S.w * head  # the first block gathered
    return out


def float8_gather(x: Inputs, S, gathered: Expr, comm: dict) -> dict:
    """--float8 tensorwise-all-gather (Lab 13's fit_float8_gather.py): each block's linears gathered as float8,
    1 byte per weight, not ``gathered``; the norms as before. Per moment, the blocks it holds gathered: under
    ZeRO-3 one (two in a block's backward), under ZeRO-2 all of them (and, at the end of forward, the last
    block's buffer once more, unless the head's is the last gathered); in a recomputed block's backward, as many as
    ``recomputed_blocks`` says."""
    if x.float8 != "tensorwise-all-gather":
        return comm
    less = (gathered - 1) * ceil_div(S.Pm, S.L)  # one block's linears, gathered in 1 byte instead
    if x.zero_stage == 2:
        ends = S.L if x.fsdp_units != "blocks" else S.L + 1
        counts = {"forward_end": ends, "backward_start": S.L, "head_gradient": S.L, "block_backward": S.L - 1}  # (the last done)
    else:
        counts = {"backward_start": 1, "head_gradient": 1, "block_backward": 2, "head_reduced": 1, "second_block_backward": 2} | (
            {"forward_end": 1} if x.fsdp_units == "blocks" else {})
    counts |= {m: recomputed_blocks(x, S, at) for m, at in (("recomputed_backward", "end"), ("recomputed_front", "front"),
                                                             ("recomputed_last", "last"), ("recomputed_second", "second"))}
    if x.fsdp_units != "blocks" and not segmented(x, S):  # the first block's: it and the embedding
        counts["recomputed_front"] = 1
    return comm | {k: comm[k] - n * less for k, n in counts.items() if k in comm}


def backward_end(x: Inputs, S, held: dict, gradients: Expr, carried: Expr) -> dict[str, Expr]:
    """FSDP2's mixed precision: the root's backward done, its bf16 gradients about to be reduced (the root's fp32
    reduce-scatter input is communication), every block's fp32 shard out. With --fsdp-units blocks-embed-head the
    embedding's, the last unit: every other shard out (``gradients``: all of them, the embedding's made first)."""
    if x.fsdp_units != "blocks":
        return held | {"gradients": gradients if carried is ZERO else carried, "temporaries": S.c * S.V * S.h}
    blocks = ZERO if x.offload == "params" else S.w * S.L * ceil_div(S.Pb, S.dp)  # every block's fp32 shard
    return held | {"gradients": blocks if carried is ZERO else carried, "temporaries": S.c * S.Pr}
# --8<-- [end:flags]
