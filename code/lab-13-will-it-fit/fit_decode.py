"""Lab 13 - a decode step against a KV cache preallocated to its full length (``--task decode``).

A server that decodes without paging (Hugging Face's ``StaticCache``, CUDA-graph decoders) allocates
every layer's keys and values for ``--kv-len`` tokens per sequence once, before the first token, and
writes each new token's into its slot. One decode step runs ``--new-tokens`` tokens per sequence of
the batch (1: plain decoding; more: a speculative decoder verifying its drafted tokens) at the last
positions of the cache, each attending to every position up to its own, and returns their logits.
The zoo model's own modules run it (Lab 14's ``rotary_at`` places the rotary tables at any position);
the prompt's keys and values are the cache's contents (zeros here: only bytes matter). A prefill,
which fills the cache, stays ``--task infer``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit import labs, marks
from labkit.config import UsageError
from labkit.zoo import rotate_half

rotary_at = labs.load(14, "serving_model").rotary_at  # cos, sin of the zoo's rotary tables at given positions


# --8<-- [start:decode]
class StaticCache:
    """Every layer's keys and values, (batch, kv_heads, length, head_dim) each, allocated once."""

    def __init__(self, spec, batch: int, length: int, dtype: torch.dtype, device) -> None:
        shape = (batch, spec.kv_heads, length, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.layers)]


@torch.no_grad()
def decode_step(model, cache: StaticCache, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` (batch, new): the newest tokens of each sequence, at the cache's last ``new`` positions.
    Writes their keys and values there and returns their logits (batch, new, vocab)."""
    new, length = tokens.size(1), cache.keys[0].size(2)
    start = length - new
    positions = torch.arange(start, length, device=tokens.device).expand(tokens.size(0), new)
    cos, sin = rotary_at(model.blocks[0].attn, positions, model.embed.weight.dtype)
    mask = None if new == 1 else torch.ones(new, length, dtype=torch.bool, device=tokens.device).tril(start)
    x = model.embed(tokens)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        h = block.attn_norm(x)
        q, k, v = (proj(h).unflatten(-1, (-1, attn.head_dim)) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        cache.keys[layer][:, :, start:] = k.transpose(1, 2)
        cache.values[layer][:, :, start:] = v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), cache.keys[layer], cache.values[layer], attn_mask=mask,
                                           enable_gqa=attn.q_proj.out_features != attn.k_proj.out_features)
        x = x + attn.o_proj(y.transpose(1, 2).flatten(2))
        x = x + block.mlp(block.mlp_norm(x))
    return model.head(model.norm(x))


def decode(model, ledger, config, dtype: torch.dtype, device: str) -> None:
    """``fit.py --task decode``: the cache allocated for ``--kv-len`` tokens per sequence and labelled in
    ``ledger``, then one step of ``--new-tokens`` per sequence."""
    cache = StaticCache(config.spec, config.batch, config.kv_len or config.seq, dtype, device)
    ledger.track(cache.keys + cache.values, "kv_cache")
    with marks.phase("decode", 0):
        decode_step(model, cache, torch.zeros(config.batch, config.new_tokens, dtype=torch.long, device=device))
# --8<-- [end:decode]


def check_decode(config) -> None:
    """``--task decode``'s refusals, and its flags' without it (Lab 13's Config calls it): one line, exit 2."""
    if config.task != "decode":
        if config.kv_len is not None or config.new_tokens != 1:
            raise UsageError("--kv-len and --new-tokens size a decode step: give --task decode")
        return
    if config.spec.family not in ("llama", "mixtral"):
        raise UsageError(f"--task decode runs a zoo Llama or Mixtral's modules, not {config.model}'s")
    if config.precision == "mixed":
        raise UsageError("--task decode runs the weights' own dtype, as a server does: --precision bf16 or fp32")
    if config.dp > 1:
        raise UsageError("--task decode traces one GPU: Lab 14 sizes a server split over GPUs")
    if config.new_tokens > (config.kv_len or config.seq):
        raise UsageError(f"--new-tokens {config.new_tokens} is more than the cache holds, --kv-len "
                         f"{config.kv_len or config.seq}")
