"""The model zoo: real architectures at their published sizes, in plain PyTorch.

The handbook traces training and inference steps of real models on fake tensors (no memory is
allocated; :mod:`labkit.fake` does that). This module holds the models: each written plainly,
built from its published configuration, with the published parameter count to the parameter
(a test holds every count, and each architecture's parameter names and shapes, against Hugging
Face's own implementation built from the same configuration). GPT-3 is the exception: its paper
publishes "175.0B" (Table 2.1), a rounded figure, and no checkpoint; its count here,
174,604,259,328, is computed from the paper's shape (96 layers, width 12,288, 2,048 positions,
GPT-2's 50,257-token vocabulary), 0.23 % under the rounded figure::

    from labkit import zoo
    spec = zoo.get("llama-3-8b")          # a ModelSpec: the published configuration
    spec.param_count()                    # 8_030_261_248, from a closed form
    with torch.device("meta"):            # no memory: the caller picks the device (or a fake mode)
        model = spec.build()
    logits, loss = model(idx, targets)    # the causal LMs share TinyGPT's forward and its run_blocks seam

Families: ``llama`` (Llama 3, 3.1, 3.2), ``mixtral`` (Mixtral's sparse mixture of experts on the
same decoder), ``deepseek`` (DeepSeek-V2's multi-head latent attention and DeepSeekMoE), ``gpt`` (GPT-2/GPT-3 shape), ``flux`` (the Flux.1 diffusion transformer) and ``hf``
(any Hugging Face causal-LM ``config.json``: ``zoo.get("path/to/config.json")`` builds
transformers' own model behind the same forward). ``small-*`` entries are the same code at toy
size, for tests and CPU runs.

What the zoo follows, and where it does not:

* Weights are built in torch's default dtype (float32); cast with ``.to(torch.bfloat16)`` (or
  ``labkit.fake.materialize(..., dtype=...)``) as a real run would load them.
* RoPE: each attention computes its own cos/sin tables from a non-persistent buffer of inverse
  frequencies, (T, head_dim) each, the size Hugging Face computes once per forward; so a block needs
  nothing but ``x`` (the ``run_blocks`` seam stays ``run_blocks(blocks, x)``) at the price of a
  copy of the two tables per layer, saved for backward (4 MiB a layer at 4k tokens and head_dim 128:
  0.25 % of Llama-3-8B's activations; a test holds the difference to Hugging Face's to the byte). Llama 3.1/3.2's "llama3" frequency scaling is left out: it changes
  the values of those tables, not their sizes; so is DeepSeek-V2-Lite's YaRN scaling. After ``to_empty`` the buffer holds garbage, like the
  weights: a real run fills both.
* MoE routing on fake or meta tensors has no data to route by: every expert then gets an equal
  share of the tokens (the balance the router's auxiliary loss aims at). On real tensors it routes.
* GPT-3's alternating locally banded sparse attention is dense here (no parameters, same
  activations up to the attention kernel); its blocks are :class:`labkit.models.Block`, TinyGPT's,
  whose GELU is the exact one rather than GPT-2's tanh approximation (same memory).
* Flux follows Black Forest Labs' reference code (fused qkv; the single blocks' fused
  ``linear1``/``linear2``); diffusers splits those matmuls but holds the same parameters.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit import files
from labkit.config import MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, UsageError
from labkit.models import Block as GPTBlock
from labkit.models import GPTConfig, _init_weights, gpt_param_count, run_in_order

FAMILIES = ("llama", "mixtral", "deepseek", "gpt", "flux", "hf")


# ============================================================================ the specification
@dataclass(frozen=True)
class ModelSpec:
    """A published model configuration. ``build()`` makes the model, ``param_count()`` counts it."""

    name: str
    family: str  # one of FAMILIES
    layers: int  # decoder blocks (flux: double-stream blocks)
    width: int  # hidden size
    heads: int  # attention heads
    kv_heads: int  # key/value heads (grouped-query attention when fewer than heads)
    ffn: int  # MLP hidden size (mixtral: per expert)
    vocab: int = 0
    context: int = 0  # the longest sequence the published model takes, in tokens
    tied: bool = False  # the output head shares the token embedding's weight
    experts: int = 0  # mixtral: experts per layer
    top_k: int = 0  # mixtral: experts each token is routed to
    norm_eps: float = 1e-5
    rope_theta: float = 0.0
    source: str = ""  # where the configuration is published
    head_dim: int = 0  # 0: width // heads
    # deepseek only (multi-head latent attention, DeepSeekMoE); head_dim is the per-head size without RoPE
    kv_lora_rank: int = 0  # the compressed KV (the latent) each token caches, per layer
    q_lora_rank: int = 0  # 0: queries are not compressed (DeepSeek-V2-Lite)
    rope_dim: int = 0  # the per-head query/key part that carries RoPE (shared by all heads for the key)
    v_head_dim: int = 0  # the per-head size of a value
    shared_experts: int = 0  # experts every token goes through
    dense_layers: int = 0  # the first blocks keep a dense MLP of width ffn
    moe_ffn: int = 0  # each expert's hidden size
    # flux only
    single_layers: int = 0  # single-stream blocks
    in_channels: int = 0  # packed latent channels (in and out)
    text_dim: int = 0  # T5 text embedding width (joint_attention_dim)
    pooled_dim: int = 0  # CLIP pooled embedding width (pooled_projection_dim)
    guidance: bool = False  # a guidance-distilled model embeds the guidance scale
    axes_dims: tuple[int, ...] = ()  # rotary dimensions per position axis (text/time, row, column)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if not self.head_dim and self.heads:  # (a Hugging Face model may have no attention heads)
            if self.width % self.heads:
                raise ValueError(f"{self.name}: width {self.width} is not divisible by heads {self.heads}")
            object.__setattr__(self, "head_dim", self.width // self.heads)
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of KV cache per token: a key and a value per layer, per KV head."""
        if self.family == "flux":
            raise ValueError(f"{self.name} is a diffusion transformer: it keeps no KV cache")
        if self.kv_lora_rank:  # latent attention caches one compressed vector and the RoPE key, per layer
            return self.layers * (self.kv_lora_rank + self.rope_dim) * dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def param_count(self) -> int:
        """Parameters of ``build()``'s model, from the closed form of its family (``hf``: counted on meta)."""
        if self.family in ("llama", "mixtral"):
            return llama_param_count(self)
        if self.family == "deepseek":
            return deepseek_param_count(self)
        if self.family == "gpt":
            return gpt_param_count(_gpt_config(self)) - self.vocab * self.width  # the head is tied
        if self.family == "flux":
            return flux_param_count(self)
        with torch.device("meta"):
            return sum(p.numel() for p in self.build().parameters())

    def build(self) -> nn.Module:
        """The model, on the current default device (build under ``torch.device("meta")`` for no memory)."""
        if self.family in ("llama", "mixtral"):
            return Llama(self)
        if self.family == "deepseek":
            return DeepSeek(self)
        if self.family == "gpt":
            return GPT(self)
        if self.family == "flux":
            return Flux(self)
        return HFCausalLM(_read_hf_config(self.source))


def _linear(fan_in: int, fan_out: int, bias: bool = True) -> int:
    """Parameters of ``nn.Linear(fan_in, fan_out, bias)``."""
    return fan_in * fan_out + (fan_out if bias else 0)


# ============================================================================ the causal LMs
class CausalLM(nn.Module):
    """What the causal LMs share: token embedding, blocks, final norm, head, loss.

    ``forward(idx, targets=None, run_blocks=None) -> (logits, loss)`` exactly as
    :class:`labkit.models.TinyGPT`: ``run_blocks(blocks, x)`` replaces the loop over the blocks
    (default :func:`labkit.models.run_in_order`), and the model keeps no reference to the embedding
    output. Subclasses set ``embed``, ``blocks``, ``norm`` and ``head`` and then call ``finish``.
    """

    def finish(self, spec: ModelSpec) -> None:
        self.spec = spec
        if spec.tied:
            self.head.weight = self.embed.weight
        self.apply(_init_weights)  # N(0, 0.02) weights, zero biases: instant on meta

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, run_blocks=None, head_loss=None):
        """``head_loss(hidden, head, targets) -> loss``, with targets: a loss that applies the head itself
        (chunked, fused with it) and returns no logits; the default is the head, then the loss."""
        x = (run_blocks or run_in_order)(self.blocks, self.embed_tokens(idx))
        if head_loss is not None and targets is not None:
            return None, head_loss(self.norm(x), self.head, targets)
        logits = self.head(self.norm(x))
        return logits, causal_lm_loss(logits, targets)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    """Cross-entropy of next-token ``targets``, with the logits upcast to float32 first.

    The upcast is what Hugging Face's ``ForCausalLMLoss`` and torchtitan do, for the loss's
    precision; at a 128k vocabulary that float32 copy of the logits is one of the largest tensors of
    a bf16 step, so it is kept: it is real-world memory behaviour. (A float32 run copies nothing.)
    """
    if targets is None:
        return None
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# ---------------------------------------------------------------------------- Llama and Mixtral
class RMSNorm(nn.Module):
    """RMSNorm as Hugging Face's LlamaRMSNorm: normalise in float32, cast back, scale."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inverse_frequencies(dim: int, theta: float, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies, theta ** (-2i / dim) for i < dim / 2, in float32."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions (Llama, Mistral/Mixtral); no biases."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.gqa = spec.heads != spec.kv_heads
        self.q_proj = nn.Linear(spec.width, spec.heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.width, spec.kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.width, spec.kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.heads * spec.head_dim, spec.width, bias=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(spec.head_dim, spec.rope_theta), persistent=False)

    def rotary(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions 0..T-1, (T, head_dim) each in x's dtype, computed in float32
        as Hugging Face's LlamaRotaryEmbedding does (HF makes them once per forward, here each block does)."""
        positions = torch.arange(x.size(1), device=x.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.float())
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, kv_heads, T, head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # enable_gqa: each KV head serves heads // kv_heads query heads without copying K and V out to
        # every query head, as Hugging Face's sdpa path does when there is no padding mask.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """Llama's MLP (and each Mixtral expert): down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, ffn, bias=False)
        self.up_proj = nn.Linear(width, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Mixtral's sparse feed-forward: a router picks ``top_k`` of ``experts`` SwiGLU MLPs per token.

    As Hugging Face's MixtralSparseMoeBlock: softmax over the router logits in float32, keep the
    top k and renormalise them, then for each expert run the tokens routed to it
    (``index_select``), weight them and add them back in place (``index_add_``). That loop is
    transformers' ``eager`` experts implementation; 5.24 defaults to a ``grouped_mm`` kernel (same
    parameters and result, other temporaries).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k, self.normalize = spec.top_k, spec.family != "deepseek"  # DeepSeek-V2 keeps the raw top-k weights
        self.router = nn.Linear(spec.width, spec.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(spec.width, spec.moe_ffn or spec.ffn) for _ in range(spec.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        x = x.reshape(-1, c)
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (tokens, top_k)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = self.routed_to(e, chosen)
            if _has_data(token) and token.numel() == 0:
                continue  # no token chose this expert (HF skips it too)
            y = expert(x.index_select(0, token)) * weights[token, slot, None]  # float32, as HF's
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(b, t, c)

    def routed_to(self, e: int, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens that chose expert ``e`` and in which of their top-k slots. Without data (fake or
        meta tensors) every expert gets an equal share, tokens * top_k // experts rows."""
        if _has_data(chosen):
            return torch.where(chosen == e)
        n = chosen.size(0) * self.top_k // len(self.experts)
        token = torch.arange(n, device=chosen.device)
        return token, torch.zeros_like(token)


def _has_data(t: torch.Tensor) -> bool:
    """False for a meta or a fake tensor, whose values cannot be read."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type != "meta" and not isinstance(t, FakeTensor)


class LlamaBlock(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a MoE when the spec has experts."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.width, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.width, spec.norm_eps)
        self.mlp = MoE(spec) if spec.experts else SwiGLU(spec.width, spec.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(CausalLM):
    """Llama 3 (https://arxiv.org/abs/2407.21783) and, with ``spec.experts``, Mixtral
    (https://arxiv.org/abs/2401.04088): Mistral's Llama-shaped decoder with a sparse MoE MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = nn.Embedding(spec.vocab, spec.width)
        self.blocks = nn.ModuleList(LlamaBlock(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.width, spec.norm_eps)
        self.head = nn.Linear(spec.width, spec.vocab, bias=False)
        self.finish(spec)


def llama_param_count(spec: ModelSpec) -> int:
    w, hd = spec.width, spec.head_dim
    attention = _linear(w, spec.heads * hd, False) + 2 * _linear(w, spec.kv_heads * hd, False) \
        + _linear(spec.heads * hd, w, False)
    mlp = 3 * w * spec.ffn  # gate, up, down
    if spec.experts:
        mlp = spec.experts * mlp + _linear(w, spec.experts, False)  # the experts and the router
    per_block = attention + mlp + 2 * w  # two RMSNorms
    embeddings = spec.vocab * w * (1 if spec.tied else 2)
    return embeddings + spec.layers * per_block + w  # + the final norm


# ---------------------------------------------------------------------------- DeepSeek-V2 (latent attention)
class LatentAttention(nn.Module):
    """DeepSeek-V2's multi-head latent attention (https://arxiv.org/abs/2405.04434, section 2.1), as Hugging
    Face's DeepseekV2Attention: each token's keys and values come from one compressed vector of
    ``kv_lora_rank`` (the *latent*, what a server caches) and a ``rope_dim`` key shared by all heads, which
    carries the position (RoPE on interleaved pairs); ``kv_b_proj`` expands the latent to each head's key
    (without position) and value. This training-style forward expands them for every token, as a prefill does,
    and pads each value to the key's size so that one flash-attention kernel takes them (vLLM's
    ``vllm/v1/attention/backends/mla/common.py``, ``_flash_attn_varlen_diff_headdims``; unpadded, PyTorch's
    CPU attention falls back to the math kernel and holds every score)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim, self.rank = (spec.heads, spec.head_dim, spec.rope_dim,
                                                                    spec.v_head_dim, spec.kv_lora_rank)
        q_out = spec.heads * (spec.head_dim + spec.rope_dim)
        if spec.q_lora_rank:  # DeepSeek-V2 compresses the queries too; V2-Lite does not
            self.q_a_proj = nn.Linear(spec.width, spec.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(spec.width, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(spec.width, spec.kv_lora_rank + spec.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(spec.kv_lora_rank, spec.heads * (spec.head_dim + spec.v_head_dim), bias=False)
        self.o_proj = nn.Linear(spec.heads * spec.v_head_dim, spec.width, bias=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(spec.rope_dim, spec.rope_theta), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE on interleaved pairs (x[2i], x[2i+1]) of x (B, T, H, rope_dim), in float32, as HF's apply_rotary_emb."""
        angles = torch.arange(x.size(1), device=x.device, dtype=torch.float32)[:, None] * self.inv_freq.float()
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # (T, 1, rope_dim / 2)
        even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(b, t, self.heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = self.rotate(k_pe[:, :, None, :]).expand(-1, -1, self.heads, -1)
        q, k = torch.cat((q_nope, self.rotate(q_pe)), -1), torch.cat((k_nope, k_pe), -1)
        v = F.pad(v, [0, q.size(-1) - self.v_dim])  # one flash kernel takes all three: V zero-padded, as vLLM's MLA prefill
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(y[..., :self.v_dim].transpose(1, 2).reshape(b, t, -1))


class DeepSeekMoE(MoE):
    """DeepSeekMoE: the routed experts (top-k of a softmax, weights not renormalised) plus shared experts
    every token goes through, one SwiGLU of ``shared_experts`` x ``moe_ffn``, as HF's DeepseekV2Moe."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.shared_experts = SwiGLU(spec.width, spec.shared_experts * spec.moe_ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class DeepSeekBlock(LlamaBlock):
    """A Llama block with latent attention; the MLP is dense in the first ``dense_layers`` blocks."""

    def __init__(self, spec: ModelSpec, index: int) -> None:
        nn.Module.__init__(self)
        self.attn_norm = RMSNorm(spec.width, spec.norm_eps)
        self.attn = LatentAttention(spec)
        self.mlp_norm = RMSNorm(spec.width, spec.norm_eps)
        self.mlp = SwiGLU(spec.width, spec.ffn) if index < spec.dense_layers else DeepSeekMoE(spec)


class DeepSeek(CausalLM):
    """DeepSeek-V2 (https://arxiv.org/abs/2405.04434): latent attention, DeepSeekMoE after ``dense_layers``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = nn.Embedding(spec.vocab, spec.width)
        self.blocks = nn.ModuleList(DeepSeekBlock(spec, i) for i in range(spec.layers))
        self.norm = RMSNorm(spec.width, spec.norm_eps)
        self.head = nn.Linear(spec.width, spec.vocab, bias=False)
        self.finish(spec)


def deepseek_param_count(spec: ModelSpec) -> int:
    w, h, r, rope = spec.width, spec.heads, spec.kv_lora_rank, spec.rope_dim
    q_out = h * (spec.head_dim + rope)
    q = (w * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * q_out) if spec.q_lora_rank else w * q_out
    attention = q + w * (r + rope) + r + r * h * (spec.head_dim + spec.v_head_dim) + h * spec.v_head_dim * w
    moe = spec.experts * 3 * w * spec.moe_ffn + w * spec.experts + 3 * w * spec.shared_experts * spec.moe_ffn
    blocks = spec.layers * (attention + 2 * w) + spec.dense_layers * 3 * w * spec.ffn + (spec.layers - spec.dense_layers) * moe
    return blocks + spec.vocab * w * (1 if spec.tied else 2) + w


# ---------------------------------------------------------------------------- GPT-2 / GPT-3
def _gpt_config(spec: ModelSpec) -> GPTConfig:
    if spec.ffn != 4 * spec.width or spec.kv_heads != spec.heads:
        raise ValueError(f"{spec.name}: a GPT block has ffn = 4 * width and one KV head per head")
    return GPTConfig(vocab=spec.vocab, seq_len=spec.context, width=spec.width, layers=spec.layers, heads=spec.heads)


class GPT(CausalLM):
    """GPT-2/GPT-3 (https://arxiv.org/abs/2005.14165, Table 2.1): learned positions, pre-norm
    LayerNorm blocks with biases, a GELU MLP of 4 * width, the head tied to the token embedding.
    The blocks are :class:`labkit.models.Block`, TinyGPT's own."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        cfg = _gpt_config(spec)
        self.embed = nn.Embedding(spec.vocab, spec.width)
        self.pos = nn.Embedding(spec.context, spec.width)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(spec.width, eps=spec.norm_eps)
        self.head = nn.Linear(spec.width, spec.vocab, bias=False)
        self.finish(spec)

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        from labkit import fake

        t = idx.size(1)
        positions = torch.arange(t, device=idx.device)
        if t > self.spec.context:
            if not fake.is_fake(idx):  # a real model has no learned position past its table
                raise ValueError(f"sequence of length {t} is longer than {self.spec.name}'s context, "
                                 f"{self.spec.context}: only a trace on fake tensors can run it")
            # A trace (bytes, no values) reads position p from row p mod context. The gather is
            # still (t, width), the saved indices still t int64s, the table and its gradient still
            # the published model's: the same bytes in every category as a run whose table had t
            # rows, less the extra rows themselves. In place, so no extra tensor either.
            positions.remainder_(self.spec.context)
        return self.embed(idx) + self.pos(positions)


# ============================================================================ Flux
# Black Forest Labs' reference: https://github.com/black-forest-labs/flux/blob/main/src/flux/model.py
# (and modules/layers.py). A double-stream block gives image and text tokens their own weights and
# attends over both jointly; a single-stream block runs one set of weights over the concatenation.
def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (1 + scale) * x + shift


class Modulation(nn.Module):
    """adaLN: ``n`` (B, 1, width) shift/scale/gate vectors from the conditioning vector."""

    def __init__(self, width: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(width, n * width)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.n, dim=-1)


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """(B, L, 3 * width) -> q, k, v, each (B, heads, L, head_dim)."""
    return qkv.unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate interleaved pairs of x by the angles in ``rope`` (cos, sin (L, head_dim) float32), as diffusers."""
    cos, sin = rope
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((-imag, real), dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def joint_attention(q, k, v, rope) -> torch.Tensor:
    """Full (not causal) attention over text and image tokens together; (B, L, width) out."""
    y = F.scaled_dot_product_attention(apply_rope(q, rope), apply_rope(k, rope), v)
    return y.transpose(1, 2).flatten(2)


class FluxAttention(nn.Module):
    """One stream's attention weights: fused qkv (with bias), RMSNorm on q and k per head, output proj."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads = spec.heads
        self.qkv = nn.Linear(spec.width, 3 * spec.width)
        self.q_norm = RMSNorm(spec.head_dim, 1e-6)
        self.k_norm = RMSNorm(spec.head_dim, 1e-6)
        self.proj = nn.Linear(spec.width, spec.width)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = split_heads(self.qkv(x), self.heads)
        return self.q_norm(q), self.k_norm(k), v


class Stream(nn.Module):
    """The image (or the text) half of a double-stream block."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.mod = Modulation(spec.width, 6)  # shift, scale, gate before attention; the same before the MLP
        self.norm1 = nn.LayerNorm(spec.width, elementwise_affine=False, eps=spec.norm_eps)
        self.attn = FluxAttention(spec)
        self.norm2 = nn.LayerNorm(spec.width, elementwise_affine=False, eps=spec.norm_eps)
        self.mlp = nn.Sequential(nn.Linear(spec.width, spec.ffn), nn.GELU(approximate="tanh"),
                                 nn.Linear(spec.ffn, spec.width))

    def qkv(self, x: torch.Tensor, mod) -> tuple[torch.Tensor, ...]:
        return self.attn.qkv_heads(modulate(self.norm1(x), mod[0], mod[1]))

    def residual(self, x: torch.Tensor, attn_out: torch.Tensor, mod) -> torch.Tensor:
        x = x + mod[2] * self.attn.proj(attn_out)
        return x + mod[5] * self.mlp(modulate(self.norm2(x), mod[3], mod[4]))


class DoubleBlock(nn.Module):
    """MMDiT block: image and text keep their own weights and attend jointly (text first)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.img = Stream(spec)
        self.txt = Stream(spec)

    def forward(self, img, txt, vec, rope):
        img_mod, txt_mod = self.img.mod(vec), self.txt.mod(vec)
        img_q, img_k, img_v = self.img.qkv(img, img_mod)
        txt_q, txt_k, txt_v = self.txt.qkv(txt, txt_mod)
        y = joint_attention(torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2),
                            torch.cat((txt_v, img_v), dim=2), rope)
        n_txt = txt.size(1)
        return self.img.residual(img, y[:, n_txt:], img_mod), self.txt.residual(txt, y[:, :n_txt], txt_mod)


class SingleBlock(nn.Module):
    """Parallel attention and MLP over the joined sequence: one matmul in (q, k, v and the MLP's
    input), one out (attention output and MLP hidden, concatenated)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.width, self.ffn = spec.heads, spec.width, spec.ffn
        self.mod = Modulation(spec.width, 3)
        self.norm = nn.LayerNorm(spec.width, elementwise_affine=False, eps=spec.norm_eps)
        self.linear1 = nn.Linear(spec.width, 3 * spec.width + spec.ffn)
        self.q_norm = RMSNorm(spec.head_dim, 1e-6)
        self.k_norm = RMSNorm(spec.head_dim, 1e-6)
        self.linear2 = nn.Linear(spec.width + spec.ffn, spec.width)

    def forward(self, x, vec, rope):
        shift, scale, gate = self.mod(vec)
        qkv, mlp = self.linear1(modulate(self.norm(x), shift, scale)).split([3 * self.width, self.ffn], dim=-1)
        q, k, v = split_heads(qkv, self.heads)
        y = joint_attention(self.q_norm(q), self.k_norm(k), v, rope)
        return x + gate * self.linear2(torch.cat((y, F.gelu(mlp, approximate="tanh")), dim=2))


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10_000.0) -> torch.Tensor:
    """Flux's sinusoidal embedding of t in [0, 1] (scaled by 1000): (B, dim) float32, cos first."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = 1000.0 * t.float()[:, None] * freqs[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def mlp_embedder(fan_in: int, width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(fan_in, width), nn.SiLU(), nn.Linear(width, width))


class Flux(nn.Module):
    """The Flux.1 transformer. ``forward(latents (B, N_img, in_channels), text (B, N_txt, text_dim),
    pooled (B, pooled_dim), timestep (B,), guidance (B,)) -> (B, N_img, in_channels)``.

    Its blocks are the ``nn.ModuleList``s ``double_blocks`` and ``single_blocks``, so a layerwise
    offload engine can walk them. RoPE positions: text tokens at (0, 0, 0), image tokens at
    (0, row, column) on a grid ``isqrt(N_img)`` wide (a square image's layout; the real pipeline
    passes the image's own ids); the tables are (N_txt + N_img, head_dim) float32, the real sizes.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        w = spec.width
        self.img_in = nn.Linear(spec.in_channels, w)
        self.txt_in = nn.Linear(spec.text_dim, w)
        self.time_in = mlp_embedder(256, w)
        self.guidance_in = mlp_embedder(256, w) if spec.guidance else None
        self.vector_in = mlp_embedder(spec.pooled_dim, w)
        self.double_blocks = nn.ModuleList(DoubleBlock(spec) for _ in range(spec.layers))
        self.single_blocks = nn.ModuleList(SingleBlock(spec) for _ in range(spec.single_layers))
        self.final_mod = Modulation(w, 2)  # shift, scale
        self.final_norm = nn.LayerNorm(w, elementwise_affine=False, eps=spec.norm_eps)
        self.final = nn.Linear(w, spec.in_channels)

    def rope(self, n_txt: int, n_img: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        grid = max(1, math.isqrt(n_img))
        i = torch.arange(n_img, device=device)
        img_ids = torch.stack((torch.zeros_like(i), i // grid, i % grid), dim=-1)
        ids = torch.cat((torch.zeros(n_txt, 3, dtype=i.dtype, device=device), img_ids)).float()  # (L, 3)
        cos, sin = [], []
        for axis, dim in enumerate(self.spec.axes_dims):
            freqs = torch.outer(ids[:, axis], rope_inverse_frequencies(dim, self.spec.rope_theta, device))
            cos.append(freqs.cos().repeat_interleave(2, dim=1))  # interleaved pairs, as the reference
            sin.append(freqs.sin().repeat_interleave(2, dim=1))
        return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)

    def forward(self, latents, text, pooled, timestep, guidance=None):
        vec = self.time_in(timestep_embedding(timestep).to(latents.dtype))
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError(f"{self.spec.name} is guidance-distilled: pass the guidance scale")
            vec = vec + self.guidance_in(timestep_embedding(guidance).to(latents.dtype))
        vec = vec + self.vector_in(pooled)
        img, txt = self.img_in(latents), self.txt_in(text)
        rope = self.rope(txt.size(1), img.size(1), latents.device)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, rope)
        img = torch.cat((txt, img), dim=1)  # the reference's names and lifetimes: txt stays alive
        for block in self.single_blocks:
            img = block(img, vec, rope)
        shift, scale = self.final_mod(vec)
        return self.final(modulate(self.final_norm(img[:, txt.size(1):]), shift, scale))


def flux_param_count(spec: ModelSpec) -> int:
    w, f, hd = spec.width, spec.ffn, spec.head_dim
    attention = _linear(w, 3 * w) + _linear(w, w) + 2 * hd  # qkv, proj, q and k norms
    stream = _linear(w, 6 * w) + attention + _linear(w, f) + _linear(f, w)
    single = _linear(w, 3 * w) + _linear(w, 3 * w + f) + _linear(w + f, w) + 2 * hd
    embedder = _linear(w, w)  # each MLP embedder's second layer
    embedders = (_linear(spec.in_channels, w) + _linear(spec.text_dim, w)
                 + _linear(256, w) + embedder + _linear(spec.pooled_dim, w) + embedder
                 + (_linear(256, w) + embedder if spec.guidance else 0))
    final = _linear(w, 2 * w) + _linear(w, spec.in_channels)
    return embedders + spec.layers * 2 * stream + spec.single_layers * single + final


# ============================================================================ any Hugging Face causal LM
def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


#: A Hugging Face config.json's keys for each dimension, first found wins (``hf_spec`` reads them so;
#: the calculator's Lab 01 inputs too).
HF_KEYS = {
    "layers": ("num_hidden_layers", "n_layer"), "hidden": ("hidden_size", "n_embd"),
    "heads": ("num_attention_heads", "n_head"), "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",), "ffn": ("intermediate_size", "n_inner"), "vocab": ("vocab_size",),
    "experts": ("num_local_experts", "num_experts"), "top_k": ("num_experts_per_tok",),
    "tied": ("tie_word_embeddings",),
}
#: each dimension's range in a config.json: a model beyond them is not one anybody trains (see labkit.config)
HF_BOUNDS = {"layers": (1, MAX_LAYERS), "hidden": (1, MAX_WIDTH), "heads": (1, MAX_HEADS), "kv_heads": (1, MAX_HEADS),
             "head_dim": (1, MAX_WIDTH), "ffn": (1, MAX_WIDTH), "vocab": (1, MAX_VOCAB), "experts": (1, MAX_EXPERTS),
             "top_k": (1, MAX_EXPERTS)}
#: a config.json's size (real ones have a few KiB) and nesting depth (a multimodal one nests 3 or 4 deep)
CONFIG_BYTES, CONFIG_DEPTH = 1 << 20, 32
#: the parameters a config may describe (the largest published models have about 10**12), and the MLPs
#: (layers x experts) it may ask transformers to build, one module each (DeepSeek-V3: 61 x 256)
HF_MAX_PARAMS, HF_MAX_MLPS = 1 << 44, 1 << 17


def check_hf_fields(data: dict, where: str) -> None:
    """UsageError, before transformers sees the config, for a dimension of the wrong type (a list, a
    bool, a float), out of its range (``vocab_size: 0``, 10**6 layers or experts), a padding token
    outside the vocabulary (the embedding would refuse it), a router that picks more experts than
    there are, or a model too large to be one (:data:`HF_MAX_PARAMS`). The text model of a
    multimodal config (``text_config``) is checked too."""
    for part in (data, data.get("text_config")):
        if not isinstance(part, dict):
            continue
        dims = {}
        for dim, keys in HF_KEYS.items():
            key = next((k for k in keys if part.get(k) is not None), None)
            if key is None:
                continue
            value = part[key]
            if dim == "tied":
                if not isinstance(value, bool):
                    raise UsageError(f"{where}: {key} must be true or false, got {_short(value)}")
                continue
            lo, hi = HF_BOUNDS[dim]
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"{where}: {key} must be a whole number, got {_short(value)}")
            if not lo <= value <= hi:
                raise UsageError(f"{where}: {key} must be in [{lo:,}, {hi:,}], got {value:,}")
            dims[dim] = value
        pad, vocab = part.get("pad_token_id"), dims.get("vocab")
        if pad is not None and vocab and (isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab):
            raise UsageError(f"{where}: pad_token_id {_short(pad)} is not a token of the {vocab:,}-token vocabulary")
        if dims.get("top_k", 0) > dims.get("experts", 0):
            raise UsageError(f"{where}: num_experts_per_tok {dims['top_k']} is more than the {dims.get('experts', 0)} "
                             f"experts each layer has")
        layers, width, experts = dims.get("layers", 1), dims.get("hidden", 1), dims.get("experts", 1)
        params = layers * (4 * width * width + 3 * width * dims.get("ffn", 4 * width) * experts) \
            + 2 * dims.get("vocab", 1) * width
        if params > HF_MAX_PARAMS or layers * experts > HF_MAX_MLPS:
            raise UsageError(f"{where}: {layers:,} layers of width {width:,} with {experts:,} MLP(s) of "
                             f"{dims.get('ffn', 4 * width):,} is about {params:.2g} parameters in {layers * experts:,} "
                             f"MLPs: more than the {HF_MAX_PARAMS:.2g} and {HF_MAX_MLPS:,} a model here may have")


def _short(value) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict, str)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@contextlib.contextmanager
def _library_quiet():
    """transformers' warnings and log lines held back: a refusal is one line, and a run's output is the lab's."""
    import logging
    import warnings

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _read_hf_config(path: str):
    """transformers' config object for a causal-LM ``config.json`` (or a folder holding one), or UsageError.

    The file is read with limits (a regular file of at most :data:`CONFIG_BYTES`, nested at most
    :data:`CONFIG_DEPTH` deep: :func:`labkit.files.read_json`), and the fields the zoo reads are
    checked (:func:`check_hf_fields`) before transformers builds anything from it."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto as auto

    file = Path(path)
    try:
        if file.is_dir():
            file = file / "config.json"
        exists = file.exists()
    except OSError as exc:
        raise UsageError(f"--model {files.shown(path)}: {_one_line(exc)}") from None
    if not exists:
        raise UsageError(f"--model {files.shown(path)}: no such file (give a zoo name, one of {', '.join(names())}, "
                         "or the path of a Hugging Face config.json)")
    data = files.read_json(file, "--model", CONFIG_BYTES, CONFIG_DEPTH)
    where = f"--model {files.shown(file)}"
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if not model_type:
        raise UsageError(f"{where}: not a Hugging Face model config (no model_type)")
    if not isinstance(model_type, str):
        raise UsageError(f"{where}: model_type must be a name, got {_short(model_type)}")
    # Encoders (BERT, RoBERTa, ...) and encoder-decoders also have a causal-LM head class; a decoder-only
    # model is in the causal-LM table and in neither of theirs.
    if (model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
            or model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES):
        raise UsageError(f"{where}: model_type {_short(model_type)} is not a decoder-only causal language model")
    check_hf_fields(data, where)
    try:
        with _library_quiet():
            return AutoConfig.from_pretrained(str(file))
    except Exception as exc:  # transformers raises many kinds for a config it cannot read
        raise UsageError(f"{where}: transformers cannot read this config ({_one_line(exc)[:200]})") from None


def hf_spec(path: str) -> ModelSpec:
    """A ``family="hf"`` spec read from a Hugging Face causal-LM config (its ``source`` is the path)."""
    config = _read_hf_config(path)
    text = config.get_text_config()  # the language model's config (itself, but for multimodal models)

    def read(*names, default=0):
        return next((getattr(text, n) for n in names if getattr(text, n, None) is not None), default)

    heads, file = read(*HF_KEYS["heads"]), Path(path)
    try:
        spec = ModelSpec(
            name=file.parent.name if file.name == "config.json" else file.name, family="hf",
            layers=read(*HF_KEYS["layers"]), width=read(*HF_KEYS["hidden"]), heads=heads,
            kv_heads=read(*HF_KEYS["kv_heads"], default=heads), ffn=read(*HF_KEYS["ffn"]),
            vocab=read(*HF_KEYS["vocab"]), context=read("max_position_embeddings"),
            tied=bool(read(*HF_KEYS["tied"], default=False)), experts=read(*HF_KEYS["experts"]),
            top_k=read(*HF_KEYS["top_k"]), norm_eps=read("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"),
            rope_theta=(read("rope_parameters", default=None) or {}).get("rope_theta", 0.0),
            head_dim=read(*HF_KEYS["head_dim"]), source=str(path))
        # what transformers filled in from its defaults, held to the same ranges as the file's own fields
        check_hf_fields({keys[0]: getattr(spec, f) for keys, f in (
            (HF_KEYS["layers"], "layers"), (HF_KEYS["hidden"], "width"), (HF_KEYS["vocab"], "vocab"),
            (HF_KEYS["experts"], "experts")) if getattr(spec, f)}, f"--model {files.shown(path)}")
    except (TypeError, ValueError, AttributeError) as exc:  # a field of the wrong type, say
        raise UsageError(f"--model {files.shown(path)}: not a usable model config ({_one_line(exc)[:200]})") from None
    info = Path(path).stat()
    _builds(str(path), info.st_mtime_ns, info.st_size)
    return spec


@functools.lru_cache(maxsize=16)
def _builds(path: str, mtime_ns: int, size: int) -> None:
    """transformers' model for the config at ``path``, built once on the meta device (nothing is
    allocated): what transformers refuses only when it builds (an unknown RoPE type, a padding index
    it asserts on) is a UsageError when the config is read, not a failure in the middle of a run.
    Cached by the file's modification time and size."""
    with torch.device("meta"):
        HFCausalLM(_read_hf_config(path))


class HFCausalLM(nn.Module):
    """transformers' own model for a config, behind the zoo's ``forward(idx, targets, run_blocks)``.

    ``hf`` is the ``AutoModelForCausalLM`` (built in torch's default dtype, like the zoo's models,
    whatever dtype the config names). The loss is :func:`causal_lm_loss` on its logits. ``run_blocks``
    works for models whose decoder layers are one ``nn.ModuleList`` (``layers`` or ``h``) that take and
    return the hidden state (Llama, Mistral, Qwen, GPT-2 ...): for that forward the list is swapped for
    one module that hands ``run_blocks`` the layers, each with the arguments HF's loop passed bound.
    HF's forward keeps its own reference to the embedding output (``inputs_embeds``) for the whole
    loop: that is HF's real memory behaviour, unlike the zoo's models.
    """

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        try:
            with _library_quiet():
                self.hf = AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype())
        except Exception as exc:
            raise UsageError(f"transformers cannot build {config.model_type!r} from this config "
                             f"({_one_line(exc)[:200]})") from None

    def _stack(self) -> tuple[nn.Module, str]:
        decoder = self.hf.get_decoder()
        for name in ("layers", "h"):
            if isinstance(getattr(decoder, name, None), nn.ModuleList):
                return decoder, name
        raise ValueError(f"{type(self.hf).__name__}: no decoder layer list found for run_blocks")

    @property
    def blocks(self) -> nn.ModuleList:
        owner, name = self._stack()
        return getattr(owner, name)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, run_blocks=None, head_loss=None):
        if head_loss is not None:  # transformers' model applies its own head and loss
            raise ValueError("a Hugging Face model computes its own loss: head_loss must be None")
        with _one_sequence_per_row(idx):
            if run_blocks is None:
                logits = self.hf(input_ids=idx, use_cache=False).logits
            else:
                owner, name = self._stack()
                layers = getattr(owner, name)
                setattr(owner, name, nn.ModuleList([_RunBlocks(layers, run_blocks)]))
                try:
                    logits = self.hf(input_ids=idx, use_cache=False).logits
                finally:
                    setattr(owner, name, layers)
        return logits, causal_lm_loss(logits, targets)


@contextlib.contextmanager
def _one_sequence_per_row(idx: torch.Tensor):
    """transformers run as on real tensors, on fake ones too.

    With no attention mask and no cache (a training step), transformers reads the position ids to
    find packed sequences. On real tensors it finds none (the ids are its own 0..T-1) and lets SDPA
    mask causally itself, with grouped-query attention (``is_causal``, ``enable_gqa``). On fake
    tensors it cannot read them, so it assumes packing: it builds a (B, 1, T, T) mask, and with a
    mask it copies K and V up to the query heads (``repeat_kv``), which SDPA then saves for
    backward. This forward passes no position ids, so its rows are single sequences: for its length,
    the search answers "none", as on real tensors. Guarded: another transformers may lack the hook.
    """
    from labkit import fake

    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is pinned
        masking_utils = None
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is None or not fake.is_fake(idx):
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


class _RunBlocks(nn.Module):
    """Stands in for HF's layer list for one forward: HF's loop calls it once; it calls ``run_blocks``."""

    def __init__(self, layers: nn.ModuleList, run_blocks) -> None:
        super().__init__()
        self.layers, self.run_blocks = layers, run_blocks

    def forward(self, x, *args, **kwargs):
        return self.run_blocks(nn.ModuleList(_BoundLayer(layer, args, kwargs) for layer in self.layers), x)


class _BoundLayer(nn.Module):
    """An HF decoder layer with the arguments HF's loop passes it bound, so that it takes x alone."""

    def __init__(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.layer, self.args, self.kwargs = layer, args, kwargs

    def forward(self, x):
        return self.layer(x, *self.args, **self.kwargs)


# ---------------------------------------------------------------------------- Hugging Face weights
# Hugging Face's parameter names -> the zoo's, as plain substring replacements applied in order.
_HF_NAMES = {
    "llama": (("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.norm.", "norm."),
              ("lm_head.", "head."), (".self_attn.", ".attn."), (".input_layernorm.", ".attn_norm."),
              (".post_attention_layernorm.", ".mlp_norm."), (".block_sparse_moe.", ".mlp."),
              (".mlp.gate.", ".mlp.router."), (".w1.", ".gate_proj."), (".w2.", ".down_proj."),
              (".w3.", ".up_proj.")),
    "gpt": (("transformer.wte.", "embed."), ("transformer.wpe.", "pos."), ("transformer.h.", "blocks."),
            ("transformer.ln_f.", "norm."), ("lm_head.", "head."), (".ln_1.", ".ln1."), (".ln_2.", ".ln2."),
            (".c_attn.", ".qkv."), (".attn.c_proj.", ".attn.proj."), (".c_fc.", ".up."), (".mlp.c_proj.", ".mlp.down.")),
}
_HF_NAMES["mixtral"] = _HF_NAMES["deepseek"] = _HF_NAMES["llama"]


def from_hf_state_dict(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict (Llama, Mixtral or GPT-2 layout) renamed and reshaped for ``spec.build()``.

    Mixtral's experts come either as transformers 5 holds them (``experts.gate_up_proj`` (E, 2F, W),
    ``experts.down_proj`` (E, W, F)) or per expert as published (``experts.<e>.w1/w2/w3``). GPT-2's
    ``Conv1D`` weights are stored (in, out): they are transposed to ``nn.Linear``'s (out, in).
    Works on meta tensors too (the tests compare shapes that way).
    """
    if spec.family not in _HF_NAMES:
        raise ValueError(f"no Hugging Face name mapping for family {spec.family!r}")
    out = {}
    for key, tensor in state.items():
        for old, new in _HF_NAMES[spec.family]:
            key = key.replace(old, new)
        if key.endswith(".experts.gate_up_proj"):  # (E, 2F, W): gate rows then up rows, per expert
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{key[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{key[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif key.endswith(".experts.down_proj"):
            for e, down in enumerate(tensor):
                out[f"{key[:-len('down_proj')]}{e}.down_proj.weight"] = down
        elif spec.family == "gpt" and key.startswith("blocks.") and key.endswith(".weight") and tensor.dim() == 2:
            out[key] = tensor.t()  # Conv1D (in, out) -> Linear (out, in)
        else:
            out[key] = tensor
    if spec.tied and "head.weight" not in out and "embed.weight" in out:
        out["head.weight"] = out["embed.weight"]
    return out


# ============================================================================ the registry
def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


def _llama3(name: str, repo: str, layers: int, width: int, heads: int, ffn: int, context: int,
            tied: bool = False) -> ModelSpec:
    """Llama 3, 3.1 and 3.2 share 8 KV heads, a 128,256-token vocabulary, RMSNorm eps 1e-5 and rope_theta 5e5."""
    return ModelSpec(name, "llama", layers=layers, width=width, heads=heads, kv_heads=8, ffn=ffn, vocab=128256,
                     context=context, tied=tied, norm_eps=1e-5, rope_theta=500000.0, source=_hf(repo))


_ZOO = {spec.name: spec for spec in (
    _llama3("llama-3-8b", "meta-llama/Meta-Llama-3-8B", 32, 4096, 32, 14336, 8192),
    _llama3("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 4096, 32, 14336, 131072),
    _llama3("llama-3-70b", "meta-llama/Meta-Llama-3-70B", 80, 8192, 64, 28672, 8192),
    _llama3("llama-3.1-405b", "meta-llama/Llama-3.1-405B", 126, 16384, 128, 53248, 131072),
    _llama3("llama-3.2-1b", "meta-llama/Llama-3.2-1B", 16, 2048, 32, 8192, 131072, tied=True),
    _llama3("llama-3.2-3b", "meta-llama/Llama-3.2-3B", 28, 3072, 24, 8192, 131072, tied=True),
    ModelSpec("mixtral-8x7b", "mixtral", layers=32, width=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
              context=32768, experts=8, top_k=2, norm_eps=1e-5, rope_theta=1e6,
              source=_hf("mistralai/Mixtral-8x7B-v0.1")),
    ModelSpec("deepseek-v2-lite", "deepseek", layers=27, width=2048, heads=16, kv_heads=16, head_dim=128, ffn=10944,
              vocab=102400, context=163840, experts=64, top_k=6, kv_lora_rank=512, rope_dim=64, v_head_dim=128,
              shared_experts=2, dense_layers=1, moe_ffn=1408, norm_eps=1e-6, rope_theta=10000.0,
              source=_hf("deepseek-ai/DeepSeek-V2-Lite")),
    ModelSpec("gpt-3-175b", "gpt", layers=96, width=12288, heads=96, kv_heads=96, ffn=4 * 12288, vocab=50257,
              context=2048, tied=True, norm_eps=1e-5, source="https://arxiv.org/abs/2005.14165"),
    ModelSpec("flux-dev", "flux", layers=19, single_layers=38, width=3072, heads=24, kv_heads=24, ffn=4 * 3072,
              in_channels=64, text_dim=4096, pooled_dim=768, guidance=True, axes_dims=(16, 56, 56),
              norm_eps=1e-6, rope_theta=10000.0,
              source="https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/transformer/config.json"),
    # The same code at toy size: for tests and CPU runs.
    ModelSpec("small-llama", "llama", layers=2, width=64, heads=4, kv_heads=2, ffn=128, vocab=256, context=128,
              norm_eps=1e-5, rope_theta=10000.0, source="labkit: a Llama at toy size"),
    ModelSpec("small-mixtral", "mixtral", layers=2, width=64, heads=4, kv_heads=2, ffn=128, vocab=256, context=128,
              experts=4, top_k=2, norm_eps=1e-5, rope_theta=10000.0, source="labkit: a Mixtral at toy size"),
    ModelSpec("small-deepseek", "deepseek", layers=2, width=64, heads=4, kv_heads=4, head_dim=16, ffn=128, vocab=256,
              context=128, experts=4, top_k=2, kv_lora_rank=32, rope_dim=8, v_head_dim=16, shared_experts=2,
              dense_layers=1, moe_ffn=32, norm_eps=1e-6, rope_theta=10000.0, source="labkit: a DeepSeek-V2 at toy size"),
    ModelSpec("small-gpt", "gpt", layers=2, width=64, heads=4, kv_heads=4, ffn=256, vocab=256, context=128,
              tied=True, norm_eps=1e-5, source="labkit: a GPT-3 at toy size"),
    ModelSpec("small-flux", "flux", layers=2, single_layers=2, width=64, heads=4, kv_heads=4, ffn=256,
              in_channels=16, text_dim=32, pooled_dim=16, guidance=True, axes_dims=(4, 6, 6), norm_eps=1e-6,
              rope_theta=10000.0, source="labkit: a Flux at toy size"),
)}


def names() -> list[str]:
    """The zoo's model names, in registry order."""
    return list(_ZOO)


def get(name_or_path: str) -> ModelSpec:
    """A zoo entry by name, or a ``family="hf"`` spec from the path of a Hugging Face causal-LM config.

    An unknown name, a missing or malformed file, or a config that is not a decoder-only causal LM
    raises :class:`labkit.config.UsageError` with one line.
    """
    if name_or_path in _ZOO:
        return _ZOO[name_or_path]
    text = str(name_or_path)
    if why := files.path_problem(text):
        raise UsageError(f"--model {files.shown(text)}: {why}")
    if "/" in text or "\\" in text or text.endswith(".json") or os.path.lexists(text):
        return hf_spec(text)
    raise UsageError(f"unknown model {text!r}: the zoo has {', '.join(names())} "
                     "(or give the path of a Hugging Face config.json)")
