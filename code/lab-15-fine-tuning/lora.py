"""Lab 15 - LoRA (Hu et al., 2021, https://arxiv.org/abs/2106.09685): train two thin matrices, not the weight.

A linear layer's weight W (out x in) stays frozen. Beside it sit A (r x in) and B (out x r), and the
layer computes ``W x + (alpha / r) * B A dropout(x)``: the update a full fine-tune would make to W is
replaced by a product of rank r. B starts at zero, so the model starts as the base model; only A
and B get gradients and optimizer state, r x (in + out) numbers instead of in x out.

The order of the operations is PEFT's (``peft/tuners/lora/layer.py``, ``Linear.forward``): the base
layer, then the input cast to the adapters' dtype, dropout, A, B, the scale, the sum, back to the
base output's dtype. Same operations, same saved tensors: a test holds this model's outputs,
gradients and ledger to PEFT's on the same base model.

``inject`` puts adapters on named projections (``q k v o gate up down``: Llama's ``q_proj`` ...
``down_proj``, in the zoo's models and in Hugging Face's); ``merge`` folds B A into W for inference
and ``unmerge`` takes it out again.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

#: The projections an adapter can go on: the short name a flag takes -> the module's name.
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
           "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ALL = tuple(TARGETS)


# --8<-- [start:lora]
class LoRALinear(nn.Module):
    """``base`` (an ``nn.Linear`` or ``nf4.Linear4bit``, frozen) plus a rank-``rank`` update B A."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)  # (1)!
        self.rank, self.scaling = rank, alpha / rank  # (2)!
        device, dtype = base_device(base), dtype or base_dtype(base)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init: A random, B zero
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()  # (3)!
        self.merged = False

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # (4)!
        if self.merged:
            return out
        h = x.to(self.lora_A.weight.dtype)  # a copy only when base and adapters differ in dtype
        return (out + self.lora_B(self.lora_A(self.dropout(h))) * self.scaling).to(out.dtype)  # (5)!

    def delta(self) -> torch.Tensor:
        """The update the adapters make to W: (alpha / r) B A, (out x in)."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        """W += (alpha / r) B A: one matmul per layer at inference, as if the model had been fine-tuned."""
        if not isinstance(self.base, nn.Linear):
            raise TypeError("merging into a quantized weight rounds it again: merge a LoRA of a full-precision base")
        if not self.merged:
            self.base.weight += self.delta().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W -= (alpha / r) B A: the base weight back (up to rounding), the adapters separate again."""
        if self.merged:
            self.base.weight -= self.delta().to(self.base.weight.dtype)
            self.merged = False
# --8<-- [end:lora]


# --8<-- [start:inject]
def inject(model: nn.Module, targets=ALL, rank: int = 16, alpha: float = 32.0, dropout: float = 0.0,
           dtype: torch.dtype | None = None) -> list[LoRALinear]:
    """Freeze every weight of ``model``, then wrap each module named by ``targets`` in a LoRALinear."""
    model.requires_grad_(False)
    names = {TARGETS[t] for t in targets}
    wrapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in names and hasattr(child, "in_features"):
                layer = LoRALinear(child, rank, alpha, dropout, dtype)
                setattr(parent, name, layer)
                wrapped.append(layer)
    return wrapped
# --8<-- [end:inject]


def base_device(module: nn.Module) -> torch.device:
    return next(t.device for t in (*module.parameters(), *module.buffers()))


def base_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the base computes in: a linear's weight's, a quantized one's compute dtype."""
    return getattr(module, "compute_dtype", None) or module.weight.dtype


def adapters(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def targeted(model: nn.Module, targets=ALL) -> list[nn.Module]:
    """The modules ``inject`` would wrap (a rank must fit each: r <= min(in, out))."""
    names = {TARGETS[t] for t in targets}
    return [child for parent in model.modules() for name, child in parent.named_children()
            if name in names and hasattr(child, "in_features")]


def adapter_numel(shapes, rank: int) -> int:
    """Parameters of the adapters on linears of (in, out) ``shapes``: r x (in + out) each."""
    return sum(rank * (i + o) for i, o in shapes)


def shapes(spec, targets=ALL) -> list[tuple[str, int, int]]:
    """(name, in, out) of each targeted projection of one block of a Llama-shaped ``spec`` (a
    ``labkit.zoo.ModelSpec``); a Mixtral block has one gate, up and down per expert."""
    h, q, g, f = spec.width, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.ffn
    dims = {"q": (h, q), "k": (h, g), "v": (h, g), "o": (q, h), "gate": (h, f), "up": (h, f), "down": (f, h)}
    per_expert = max(spec.experts, 1)
    return [(t, *dims[t]) for t in targets for _ in range(per_expert if t in ("gate", "up", "down") else 1)]
