"""Toy models and data for the labs: a GPT-style decoder and a deterministic synthetic dataset.

The model is deliberately plain (pre-norm blocks, learned positions, an untied head) so that its
parameter count has a closed form (:func:`gpt_param_count`) and every lab can quote it.
No downloads: the data is generated from a seed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.config import MAX_HEADS, MAX_LAYERS, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH, UsageError, option


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4
    dropout: float = 0.0
    attention: str = "sdpa"  # "sdpa" (F.scaled_dot_product_attention) or "math" (explicit softmax)

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "width", "layers", "heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"attention must be 'sdpa' or 'math', got {self.attention!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def gpt_param_count(cfg: GPTConfig) -> int:
    """Closed-form parameter count of :class:`TinyGPT` (derived, checked by a test)."""
    w, v, s, n = cfg.width, cfg.vocab, cfg.seq_len, cfg.layers
    per_block = (
        2 * 2 * w  # two LayerNorms (weight + bias)
        + w * 3 * w + 3 * w  # qkv projection
        + w * w + w  # attention output projection
        + w * 4 * w + 4 * w  # MLP up
        + 4 * w * w + w  # MLP down
    )
    return v * w + s * w + n * per_block + 2 * w + w * v  # embeddings, blocks, final norm, head


@dataclass
class TinyGPTShape:
    """TinyGPT's shape as a lab's flags: a lab's ``Config`` mixes it in
    (``class Config(TinyGPTShape, LabConfig)``), so the same names, help and rules hold in every lab;
    a lab with other defaults declares those fields again with its own."""

    seq_len: int = option(64, "tokens per sequence", min=1, max=MAX_TOKENS)
    width: int = option(128, "model width", min=1, max=MAX_WIDTH)
    layers: int = option(2, "transformer blocks", min=1, max=MAX_LAYERS)
    heads: int = option(4, "attention heads (must divide --width)", min=1, max=MAX_HEADS)
    vocab: int = option(256, "vocabulary size", min=1, max=MAX_VOCAB)

    def __post_init__(self) -> None:
        super().__post_init__()  # the types and bounds of every field first
        if self.width % self.heads:
            raise UsageError(f"--width {self.width} is not divisible by --heads {self.heads}")

    def model_config(self) -> GPTConfig:
        """The model these flags describe (with the lab's ``dropout``, if it has that flag)."""
        return GPTConfig(vocab=self.vocab, seq_len=self.seq_len, width=self.width, layers=self.layers,
                         heads=self.heads, dropout=getattr(self, "dropout", 0.0))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            y = self.attn_drop(scores.softmax(dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.width, 4 * cfg.width)
        self.down = nn.Linear(4 * cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder stack. ``forward(idx, targets, run_blocks=None)`` returns ``(logits, loss)``; ``run_blocks(blocks, x)`` replaces the loop over the blocks (:func:`run_in_order`)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, run_blocks=None):
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of length {t} is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = (run_blocks or run_in_order)(self.blocks, self.drop(self.tok(idx) + self.pos(pos)))
        # ^ the seam: a lab may pass its own block loop. The embedding output is handed over, never bound
        # here, so the loop can let go of it after the first block, as the loop written inline did.
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


class SyntheticTokens:
    """A deterministic, learnable token stream: batch ``i`` depends only on ``(seed, i)``.

    Each sequence follows a hidden permutation (token ``a`` is followed by ``perm[a]``); with
    probability ``noise`` a position restarts from a random token instead. A model can learn the
    rule, so the loss visibly falls. Because a batch is a pure function of its index, a resumed
    run sees exactly the batches it would have seen. Generation is vectorised (a dozen tensor ops
    per batch) so it barely shows in a memory timeline.
    """

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, noise: float = 0.1) -> None:
        self.vocab, self.seq_len, self.seed, self.noise = vocab, seq_len, seed, noise
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(vocab, generator=g)
        powers = [torch.arange(vocab)]  # powers[k][a] = perm applied k times to a
        for _ in range(seq_len):
            powers.append(perm[powers[-1]])
        self.perm = perm
        self.powers = torch.stack(powers)

    def batch(self, index: int, batch_size: int, device: torch.device | str = "cpu"):
        """Inputs and next-token targets, both ``(batch_size, seq_len)`` int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.seq_len + 1
        restart_token = torch.randint(self.vocab, (batch_size, n), generator=g)
        restart = torch.rand(batch_size, n, generator=g) < self.noise
        restart[:, 0] = True
        pos = torch.arange(n).expand(batch_size, n)
        last = torch.where(restart, pos, 0).cummax(dim=1).values  # most recent restart
        seq = self.powers[pos - last, restart_token.gather(1, last)]
        return seq[:, :-1].to(device), seq[:, 1:].to(device)


class RandomTokens:
    """Token ids drawn uniformly from ``vocab``; batch ``i`` depends only on ``(seed, i)``, with the
    ``batch`` signature of :class:`SyntheticTokens`. For a real model (``--model``): SyntheticTokens
    keeps a (seq_len + 1) x vocab table, 4.2 GB of int64 at Llama 3's 128,256 tokens and 4,096
    positions; random ids cost only the batch, the same (B, T) int64 tensors."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def batch(self, index: int, batch_size: int, device: torch.device | str = "cpu"):
        """Inputs and next-token targets, both ``(batch_size, seq_len)`` int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        seq = torch.randint(self.vocab, (batch_size, self.seq_len + 1), generator=g)
        return seq[:, :-1].to(device), seq[:, 1:].to(device)


# ---------------------------------------------------------------------- the seam of TinyGPT's forward
def run_in_order(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """TinyGPT's block loop: each block on the output of the one before. The default of
    ``TinyGPT.forward(..., run_blocks=...)``.

    A lab that runs the blocks its own way passes a function of the same shape: it receives the
    model's ``blocks`` (its ``nn.ModuleList``) and the hidden state ``x`` after the embeddings and
    returns the hidden state the final norm and the head read. Lab 04 wraps blocks and segments of
    blocks in ``torch.utils.checkpoint.checkpoint``; Lab 09 puts saved-tensor hooks around them.
    Everything else in ``forward`` (embeddings, head, loss) stays the model's, op for op.

    ``forward`` keeps no reference to ``x``: a plain function that rebinds ``x`` holds the only one,
    so the embedding output is freed as soon as no block needs it (saved-tensor hooks that move it
    off the device see it go). A ``functools.partial`` or a bound method keeps its arguments alive
    until it returns: fine where the first block keeps its input anyway (a checkpoint does).
    """
    for block in blocks:
        x = block(x)
    return x
