"""Lab 08 at real size: the zoo's Flux.1 transformer as the pipeline's denoiser.

Flux.1-dev's pipeline runs two text encoders (T5-XXL gives the prompt's 512 token embeddings of
4096 channels, CLIP a pooled vector of 768), the transformer once per denoising step, and a VAE
decoder. Only the transformer is modelled (``labkit.zoo``'s ``flux-dev``: 11.9 B parameters, 23.8 GB
in bf16; ``small-flux`` is the same code at toy size): the prompt's embeddings are the pipeline's
input, as if encoded ahead of time (diffusers' ``prompt_embeds``), and ``decode`` hands the latents
back unchanged. So the offload engines see one component, the denoiser, whose blocks are its 19
double-stream blocks and then its 38 single-stream blocks, the order they run.

A 1024 x 1024 image is 4096 latent tokens of 64 channels (the VAE's 128 x 128 x 16 latents packed in
2 x 2 patches): ``--latent-tokens 4096 --text-len 512``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from labkit import fake
from labkit.diffusion import DiffusionConfig, ToyDiffusionPipeline
from labkit.zoo import ModelSpec

GUIDANCE = 3.5  # Flux.1-dev's default guidance scale (it is guidance-distilled: the scale is an input)


class FluxPipeline(nn.Module):
    """``encode`` (the given embeddings), ``denoise_step`` T times with the Flux transformer, ``decode``
    (the latents as they are): the toy pipeline's interface, so ``install`` and ``run_pipeline`` run it.

    ``spec``: a ``flux`` entry of the zoo; ``cfg``: the lab's pipeline flags, of which this uses the
    steps, the batch, the latent tokens, the prompt tokens and the dtype (the shape is ``spec``'s);
    ``seed``: the weights' seed.
    """

    def __init__(self, spec: ModelSpec, cfg: DiffusionConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same weights at every build, as the toy pipeline's
        self.spec, self.cfg = spec, cfg
        self.denoiser = spec.build()
        self.requires_grad_(False)
        self.to(cfg.torch_dtype)

    def components(self) -> dict[str, nn.Module]:
        return {"denoiser": self.denoiser}

    def inputs(self, seed: int, device: torch.device | str):
        """The prompt's embeddings (T5 tokens, CLIP pooled vector) and the initial noise, from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        b, dtype = self.cfg.batch, self.cfg.torch_dtype
        text = torch.randn(b, self.cfg.text_len, self.spec.text_dim, generator=g)
        pooled = torch.randn(b, self.spec.pooled_dim, generator=g)
        noise = torch.randn(b, self.cfg.latent_tokens, self.spec.in_channels, generator=g)
        return tuple(t.to(device=device, dtype=dtype) for t in (text, pooled)), noise.to(device=device, dtype=dtype)

    def encode(self, prompt):
        return prompt  # T5 and CLIP ran ahead of time: not modelled

    def denoise_step(self, latents: torch.Tensor, text, step: int) -> torch.Tensor:
        steps, b = self.cfg.steps, latents.shape[0]
        t = torch.full((b,), 1.0 - step / steps, device=latents.device)
        guidance = torch.full((b,), GUIDANCE, device=latents.device)
        return latents - self.denoiser(latents, *text, t, guidance) / steps

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents  # the VAE decoder: not modelled


def build_pipeline(config) -> nn.Module:
    """The pipeline ``config`` names (``config.model``: toy, or a zoo Flux), built on the host as from
    a checkpoint: with real weights, or on fake tensors under ``config.fake`` (built on meta, then
    given fake storage: nothing is allocated)."""
    cfg = config.pipeline()
    build = (functools.partial(ToyDiffusionPipeline, cfg, seed=config.seed) if config.model == "toy"
             else functools.partial(FluxPipeline, config.model_spec(), cfg, seed=config.seed))
    return fake.materialize(build) if config.fake else build()
