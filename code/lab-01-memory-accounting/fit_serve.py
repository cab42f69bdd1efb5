"""Lab 01 - will it fit? Serving's formulas (Lab 14's budget): the KV bytes of a token, the peak of a
prefill beyond weights and KV pool, and the weights as ``--weights`` stores them. ``fit_formula.inference``
adds them up; each is written in the symbols of ``fit_symbols.SYMBOLS``."""

from __future__ import annotations

from fit_expr import Expr, ceil_div, larger
from fit_inputs import Inputs
from fit_symbols import INDICES, SLOT


# --8<-- [start:serve-terms]
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


def weights(x: Inputs, S) -> Expr:
    """Lab 14's ``--weights``: each block's matrices as their format stores them (``quantize.FORMATS``),
    the embedding, head, norms and a router's weights in w bytes."""
    if x.weights == "bf16":
        return S.w * S.P
    Q = S.L * S.Pq
    rest = S.w * (S.P - Q)
    if x.weights == "fp8":  # a byte a weight, an fp32 scale a matrix
        return rest + Q + 4 * S.L * S.nq
    if x.weights == "int8":  # a byte a weight, an fp32 scale an output
        return rest + Q + 4 * S.L * S.so
    if x.weights == "nvfp4":  # half a byte a weight, an fp8 scale per 16, two fp32 scales a matrix
        return rest + ceil_div(Q, 2) + ceil_div(Q, 16) + 8 * S.L * S.nq
    groups = ceil_div(Q, 128)  # int4: half a byte a weight; per group of 128 an fp16 scale and a 4-bit zero
    int4 = rest + ceil_div(Q, 2) + 2 * groups + ceil_div(groups, 2)
    return int4 + 4 * S.L * S.si if x.weights == "int4-gptq" else int4  # GPTQ: an int32 g_idx per input
# --8<-- [end:serve-terms]
