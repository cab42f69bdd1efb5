"""Lab 01 - will it fit? ``--checkpointing every-kth-block`` (Lab 13's ``fit_every_kth.py``, torchtitan's layer
policy): every G-th block (counted from 1) is checkpointed whole and keeps its input; the others keep everything.
``fit_formula.py`` calls these where that flag is given; ``tests/test_fit_formula.py`` holds them to Lab 13's trace."""

from __future__ import annotations

from fit_expr import ZERO, Expr, ceil_div, lift


def floor_div(a, b) -> Expr:
    a, b = lift(a), lift(b)
    return Expr(f"⌊{a.text} / {b.text}⌋", f"⌊{a.filled} / {b.filled}⌋", a.value // b.value)


# --8<-- [start:every-kth]
def blocks(x, S, per: Expr, mixed: bool) -> Expr:
    """What the L blocks keep for backward, ``per`` each as ``fit_formula.layer`` counts it: every-k, a segment's
    input per segment; every-kth-block, its plain and checkpointed blocks (``kept``); otherwise L × ``per``."""
    from fit_formula import layer  # here: fit_formula imports this file
    if x.checkpointing == "every-k":
        return ceil_div(S.L, S.G) * per
    return kept(S, layer(S, "none"), layer(S, "full"), mixed) if x.checkpointing == "every-kth-block" else S.L * per


def checkpointed(S) -> Expr:
    """The blocks checkpointed: G, 2G, ... counted from 1, ⌊L / G⌋ of them; the last L mod G are not."""
    return floor_div(S.L, S.G)


def block_casts(S, mixed: bool) -> Expr:
    """One block's bf16 weight casts under autocast (the blocks' matmul weights, Pm, an L-th of them)."""
    return ceil_div(S.c * S.Pm, S.L) if mixed else ZERO


def kept(S, none: Expr, full: Expr, mixed: bool) -> Expr:
    """What the blocks keep for backward: a checkpointed block its input (``full``); a plain one everything
    (``none``) and, under autocast, its weights' bf16 casts, which its matmuls save."""
    n = checkpointed(S)
    plain = none + block_casts(S, mixed) if mixed else none
    return n * full + (S.L - n) * plain


def cached(S, mixed: bool) -> Expr:
    """Autocast's cache at the end of forward beyond what the blocks keep: the checkpointed blocks' casts."""
    return checkpointed(S) * block_casts(S, True) if mixed else ZERO
# --8<-- [end:every-kth]


def last_block(x, S, held: dict) -> dict[str, dict[str, Expr]]:
    """FSDP2 (ZeRO-2/3), where G divides L: the last block is checkpointed, and its backward comes first: the block
    recomputed whole, at the peak of its MLP's backward (``fit_moments.recomputed_mlp``), beside all the blocks keep
    (its own input among them), nothing reduced yet; the head's bf16 gradient waits for the root's reduce-scatter
    (under fused-linear, made in forward: an activation). FSDP2 holds the root and two blocks gathered
    (``recomputed_gathers``). Where L mod G is not 0 the last block is plain: the start of backward holds more."""
    from fit_formula import layer  # here: fit_formula imports this file
    from fit_moments import recomputed_mlp
    if S.L.value % S.G.value:
        return {}
    if x.zero_stage < 2:
        return one_rank(x, S, held)
    blocks, head = kept(S, layer(S, "none"), layer(S, "full"), False), S.c * S.V * S.h
    fused, work = x.loss == "fused-linear", recomputed_mlp(x, S, 1)
    return {"recomputed_last": held | {"gradients": held["gradients"] if x.accumulation > 1 else ZERO,
                                       "activations": blocks + head if fused else blocks,
                                       "temporaries": work if fused else work + head}}


def one_rank(x, S, held: dict) -> dict[str, dict[str, Expr]]:
    """Without FSDP2, where G divides L: the last block's backward, the block recomputed whole (under autocast, its
    weights' casts again) beside all the blocks keep, at its MLP's gate × up product's backward
    (``fit_moments.recompute_tail``). Alive: the gradients of the head, the final norm and the down projection
    (with accumulation: every gradient, carried)."""
    from fit_formula import layer  # here: fit_formula imports this file
    from fit_moments import recompute_tail
    mixed = x.precision == "mixed"
    blocks = kept(S, layer(S, "none"), layer(S, "full"), mixed)
    head = S.Pr if x.spec().tied else S.Pr - S.V * S.h  # the embedding's gradient comes last (tied: the head's)
    grads = held["gradients"] if x.accumulation > 1 else S.w * (head + S.f * S.h)
    recomputed = layer(S, "none") + block_casts(S, mixed) if mixed else layer(S, "none")
    return {"recomputed_last": held | {"gradients": grads, "activations": blocks,
                                       "temporaries": recomputed + recompute_tail(x, S)}}
