"""Lab 14 - a zoo Llama run the way a server runs it: only the new tokens, keys and values kept in a cache.

``labkit.zoo``'s Llama has a training forward: it takes the whole sequence every time. A server
computes each token once: a **prefill** runs the prompt's tokens (those not already cached) and
writes their keys and values into the cache; every **decode** step runs one new token per sequence,
writes its key and value, and attends to everything the cache holds for that sequence. This file
runs the zoo model's own modules (projections, rotary tables, norms, MLP: the weights are the same
objects) with that data flow, and takes the logits of the last token only, as serving engines do.
"""

from __future__ import annotations

import torch
from paged_kv import attend, batch_index

from labkit.zoo import rotate_half


def rotary_at(attn, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at explicit ``positions`` (B, T), (B, T, 1, head_dim) each: the zoo's rotary tables
    (``Attention.rotary``, positions 0..T-1) at any position, computed the same way in float32. Every
    layer has the same inverse frequencies, so one table serves them all."""
    freqs = positions.float()[..., None] * attn.inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


# --8<-- [start:forward]
class ServingLlama:
    """Prefill and decode of a zoo ``Llama`` over any of the lab's KV caches."""

    def __init__(self, model) -> None:
        self.model = model
        self.dtype = model.embed.weight.dtype
        self.attention = attend  # the attention over what the cache holds (a measurement may wrap it)

    @torch.no_grad()
    def forward(self, cache, seqs: list[int], tokens: torch.Tensor, logits: bool = True) -> torch.Tensor:
        """Run ``tokens`` (B, T), the newest T tokens of each sequence in ``seqs`` (the cache has
        already grown to hold them: one sequence's prompt, or one token for each of B sequences).
        Returns the logits of each sequence's last token, (B, vocab) (``logits=False``: the hidden states)."""
        b, t = tokens.shape
        device = tokens.device
        lengths = [cache.lengths[s] for s in seqs]
        positions = torch.tensor([[n - t + i for i in range(t)] for n in lengths], device=device)  # (B, T)
        rows = torch.tensor([r for s, n in zip(seqs, lengths) for r in cache.slots(s, n - t, n)], device=device)
        index, valid = batch_index(cache, seqs, t)  # (1)!
        index, valid = index.to(device), valid if valid is None else valid.to(device)
        cos, sin = rotary_at(self.model.blocks[0].attn, positions, self.dtype)
        x = self.model.embed(tokens)
        for layer, block in enumerate(self.model.blocks):
            attn = block.attn
            h = block.attn_norm(x)
            q = attn.q_proj(h).unflatten(-1, (-1, attn.head_dim))  # (B, T, heads, head_dim)
            k = attn.k_proj(h).unflatten(-1, (-1, attn.head_dim))  # (B, T, kv_heads, head_dim)
            v = attn.v_proj(h).unflatten(-1, (-1, attn.head_dim))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            cache.store.write(layer, rows, k.flatten(0, 1), v.flatten(0, 1))  # (2)!
            keys, values = cache.store.read(layer, index, x.dtype)  # (3)!
            x = x + attn.o_proj(self.attention(q, keys, values, valid))
            x = x + block.mlp(block.mlp_norm(x))
        return self.model.head(self.model.norm(x[:, -1])) if logits else x  # (4)!

    def prefill(self, cache, seq: int, tokens: list[int], cached: int = 0) -> int:
        """The prompt's tokens after the ``cached`` ones; returns the first new token (greedy)."""
        ids = torch.tensor([tokens[cached:]], device=self.model.embed.weight.device)
        return int(self.forward(cache, [seq], ids).argmax(-1))

    def decode(self, cache, seqs: list[int], last: list[int]) -> list[int]:
        """One new token for each sequence, from its last one (greedy)."""
        ids = torch.tensor(last, device=self.model.embed.weight.device)[:, None]
        return self.forward(cache, seqs, ids).argmax(-1).tolist()
# --8<-- [end:forward]
