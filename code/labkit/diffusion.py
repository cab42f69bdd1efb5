"""A toy diffusion-style inference pipeline: text encoder -> denoiser run for T steps -> decoder.

Shaped like a real text-to-image or text-to-video pipeline, small enough for a laptop:

* ``TextEncoder``: token embeddings and a few transformer blocks; runs once per prompt.
* ``Denoiser``: N transformer blocks (self-attention over latent tokens, cross-attention to the
  text, an MLP), called once per denoising step. As in real pipelines it is by far the largest
  component, which is what makes it the thing to offload.
* ``Decoder``: a small MLP from latents to "pixels"; runs once at the end.

The scheduler is a plain Euler loop, ``x <- x - eps(x, t) / T``; it only has to call the denoiser
T times with the same weights. Inputs come from a seed (no downloads). Weights never need
gradients (inference), so the pipeline is created with ``requires_grad=False``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.config import MAX_HEADS, MAX_LAYERS, MAX_STEPS, MAX_TOKENS, MAX_WIDTH, UsageError, option

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DiffusionConfig:
    width: int = 128
    heads: int = 4
    vocab: int = 512
    text_len: int = 16
    text_layers: int = 2
    latent_tokens: int = 64
    latent_channels: int = 16
    denoiser_layers: int = 8
    decoder_layers: int = 2
    out_channels: int = 48
    steps: int = 3
    batch: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, int) and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class DiffusionShape:
    """The pipeline's shape as a lab's flags: a lab's ``Config`` mixes it in
    (``class Config(DiffusionShape, LabConfig)``), so Lab 08, Lab 11 and their benchmark share the
    names, help and rules; a lab with other defaults declares those fields again with its own."""

    width: int = option(128, "model width", min=1, max=MAX_WIDTH)
    heads: int = option(4, "attention heads (must divide --width)", min=1, max=MAX_HEADS)
    denoiser_layers: int = option(8, "denoiser blocks", min=1, max=MAX_LAYERS)
    text_layers: int = option(2, "text encoder blocks", min=1, max=MAX_LAYERS)
    decoder_layers: int = option(2, "decoder layers", min=1, max=MAX_LAYERS)
    latent_tokens: int = option(64, "latent tokens the denoiser works on", min=1, max=MAX_TOKENS)
    text_len: int = option(16, "prompt tokens", min=1, max=MAX_TOKENS)
    steps: int = option(3, "denoising steps", min=1, max=MAX_STEPS)
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "the weights' dtype")

    def __post_init__(self) -> None:
        super().__post_init__()  # the types and bounds of every field first
        if self.width % self.heads:
            raise UsageError(f"--width {self.width} is not divisible by --heads {self.heads}")

    def shape(self) -> dict:
        """These flags' values, by name (to make another lab's Config of the same pipeline)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DiffusionShape)}

    def pipeline(self) -> DiffusionConfig:
        """The pipeline these flags describe (with the lab's ``batch``, if it has that flag)."""
        return DiffusionConfig(**self.shape(), batch=getattr(self, "batch", 1))


class Attention(nn.Module):
    """Multi-head attention; attends to ``context`` (cross) or to ``x`` itself (self)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        ctx = x if context is None else context
        b, n, w = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, ctx.shape[1], self.heads, -1).transpose(1, 2) for t in self.kv(ctx).chunk(2, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, w))


class MLP(nn.Sequential):
    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class DenoiserBlock(nn.Module):
    """Self-attention over latent tokens, cross-attention to the text, then an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2, self.cross_attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln3, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.ln1(x))
        x = x + self.cross_attn(self.ln2(x), text)
        return x + self.mlp(self.ln3(x))


class TextEncoder(nn.Module):
    def __init__(self, cfg: DiffusionConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Parameter(torch.randn(cfg.text_len, cfg.width) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(cfg.width, cfg.heads) for _ in range(cfg.text_layers))
        self.ln = nn.LayerNorm(cfg.width)

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        x = self.tok(prompt) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


class Denoiser(nn.Module):
    def __init__(self, cfg: DiffusionConfig) -> None:
        super().__init__()
        w = cfg.width
        self.inp = nn.Linear(cfg.latent_channels, w)
        self.pos = nn.Parameter(torch.randn(cfg.latent_tokens, w) * 0.02)
        self.time = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.blocks = nn.ModuleList(DenoiserBlock(w, cfg.heads) for _ in range(cfg.denoiser_layers))
        self.ln = nn.LayerNorm(w)
        self.out = nn.Linear(w, cfg.latent_channels)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = self.inp(latents) + self.pos + self.time(timestep_embedding(t, self.pos.shape[1], latents.dtype))
        for block in self.blocks:
            x = block(x, text)
        return self.out(self.ln(x))


class Decoder(nn.Module):
    def __init__(self, cfg: DiffusionConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(cfg.latent_channels, cfg.width)]
        for _ in range(cfg.decoder_layers):
            layers += [nn.GELU(), nn.Linear(cfg.width, cfg.width)]
        layers += [nn.GELU(), nn.Linear(cfg.width, cfg.out_channels)]
        self.net = nn.Sequential(*layers)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.net(latents)


def timestep_embedding(t: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Sinusoidal embedding of the (batch of) timesteps ``t`` in [0, 1], shape (batch, 1, width)."""
    half = width // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float()[:, None] * 1000.0 * freqs[None, :]
    emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if width % 2:
        emb = F.pad(emb, (0, 1))
    return emb[:, None, :].to(dtype)


class ToyDiffusionPipeline(nn.Module):
    """``encode`` once, ``denoise_step`` T times, ``decode`` once."""

    def __init__(self, cfg: DiffusionConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.text_encoder = TextEncoder(cfg)
        self.denoiser = Denoiser(cfg)
        self.decoder = Decoder(cfg)
        self.requires_grad_(False)
        self.to(cfg.torch_dtype)

    def components(self) -> dict[str, nn.Module]:
        return {"text_encoder": self.text_encoder, "denoiser": self.denoiser, "decoder": self.decoder}

    def inputs(self, seed: int, device: torch.device | str):
        """A prompt (token ids) and the initial noise, both a pure function of ``seed``."""
        g = torch.Generator().manual_seed(seed)
        cfg = self.cfg
        prompt = torch.randint(cfg.vocab, (cfg.batch, cfg.text_len), generator=g)
        noise = torch.randn(cfg.batch, cfg.latent_tokens, cfg.latent_channels, generator=g)
        return prompt.to(device), noise.to(device=device, dtype=cfg.torch_dtype)

    def encode(self, prompt: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(prompt)

    def denoise_step(self, latents: torch.Tensor, text: torch.Tensor, step: int) -> torch.Tensor:
        steps = self.cfg.steps
        t = torch.full((latents.shape[0],), 1.0 - step / steps, device=latents.device)
        return latents - self.denoiser(latents, t, text) / steps

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(latents)

    @torch.no_grad()
    def forward(self, prompt: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        text = self.encode(prompt)
        latents = noise
        for step in range(self.cfg.steps):
            latents = self.denoise_step(latents, text, step)
        return self.decode(latents)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
