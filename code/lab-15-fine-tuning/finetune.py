"""Lab 15 - fine-tuning on one GPU: LoRA, QLoRA's 4-bit base and 8-bit AdamW, every byte by what it is.

A full fine-tune trains every weight: a bf16 weight, its gradient and AdamW's two moments. LoRA
(``lora.py``) freezes the weights and trains thin adapters beside them; QLoRA (``nf4.py``) also
stores the frozen weights in 4 bits; the 8-bit AdamW (``adam8bit.py``) stores the moments in one byte
each. This file puts them together on a small Llama (the zoo's architecture, toy width) and trains
it while the memory ledger counts every storage in the categories a reader can name:

    frozen weights       the base a LoRA does not train (NF4 codes under QLoRA)    frozen_weights
    quantization consts  what NF4 needs to read its codes back (absmax, scales)    quant_constants
    adapters             LoRA's A and B (under --method full: every weight)        parameters
    adapter gradients    their gradients, from backward to zero_grad               gradients
    optimizer state      AdamW's moments (8-bit codes and absmax under adamw8bit)  optimizer_state
    activations          what forward keeps for backward                           activations
    dequantized weights  a layer's bf16 weight, read back from NF4 for one matmul  dequantized

The same pieces, applied to a real model at real size, are Lab 13's ``--method lora|qlora`` and
``--optimizer adamw8bit`` (traced on fake tensors): that is where the page's 24 GB answers come from.

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from adam8bit import AdamW8bit, state_bytes
from lora import ALL, adapters, inject
from nf4 import Linear4bit, constants, nf4_bytes, quantize_linears

from labkit import cli, labs, marks, provenance, zoo
from labkit.config import (
    MAX_BATCH, MAX_HEADS, MAX_LAYERS, MAX_LR, MAX_STEPS, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH, LabConfig, UsageError,
    option,
)
from labkit.ledger import Ledger
from labkit.models import SyntheticTokens
from labkit.table import Table, by_category, format_bytes

FineTuning = labs.load(1, "fit_inputs").FineTuning  # --method --lora-rank --lora-targets: Lab 13's and the calculator's too


# --8<-- [start:recipes]
PRECISIONS = {  # --precision: the frozen base's dtype, the trained weights' dtype, bf16 autocast
    "fp32": (torch.float32, torch.float32, False),
    "bf16": (torch.bfloat16, torch.bfloat16, False),  # (1)!
    "mixed": (torch.bfloat16, torch.float32, True),  # (2)!
}
OPTIMIZERS = {"adamw": torch.optim.AdamW, "adamw8bit": AdamW8bit}
# --8<-- [end:recipes]


# --8<-- [start:prepare]
def prepare(model, method: str, precision: str, rank: int, targets=ALL, alpha: float = 16.0, dropout: float = 0.0,
            nf4_block: int = 64) -> list[torch.nn.Parameter]:
    """Make ``model`` (built in ``weights_dtype(method, precision)``) what ``method`` trains; the trainable
    parameters. full: every weight. lora: adapters on the frozen weights. qlora: the same, the blocks'
    linears in NF4 first."""
    if method == "full":
        return list(model.parameters())
    if method == "qlora":
        quantize_linears(model.blocks, nf4_block)  # (1)!
    inject(model, targets, rank, alpha, dropout, dtype=PRECISIONS[precision][1])  # (2)!
    return [p for p in model.parameters() if p.requires_grad]  # (3)!


def frozen(model) -> dict[str, list[torch.Tensor]]:
    """What a fine-tune holds but does not train, by the ledger's category: the frozen weights (a
    quantized layer's codes among them) and the quantization constants."""
    quantized = [m for m in model.modules() if isinstance(m, Linear4bit)]
    weights = [p for p in model.parameters() if not p.requires_grad]
    weights += [m.codes for m in quantized] + [m.bias for m in quantized if m.bias is not None]
    return {"frozen_weights": weights, "quant_constants": [t for m in quantized for t in constants(m)]}
# --8<-- [end:prepare]


def weights_dtype(method: str, precision: str) -> torch.dtype:
    """The dtype a model is built in: its trained weights' under full, its frozen base's under LoRA."""
    base, trained, _ = PRECISIONS[precision]
    return trained if method == "full" else base


# --8<-- [start:step]
def train_step(model, optimizer, x, y, step: int, autocast: bool) -> float:
    with marks.phase("forward", step), torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        loss = model(x, y)[1]  # (1)!
    with marks.phase("backward", step):
        loss.backward()  # (2)!
    with marks.phase("optimizer", step):
        optimizer.step()  # (3)!
    with marks.phase("zero_grad", step):
        optimizer.zero_grad(set_to_none=True)
    return loss.item()
# --8<-- [end:step]


@dataclass
class Config(FineTuning, LabConfig):
    """Fine-tune a small Llama with LoRA, QLoRA or every weight, and count every byte by what it is."""

    method: Literal["full", "lora", "qlora"] = option(
        "qlora", "full: train every weight; lora: adapters on a frozen base; qlora: the frozen base in 4-bit NF4")
    lora_rank: int = option(8, "rank of each LoRA adapter (at most min(in, out) of every targeted projection)", min=1,
                            max=MAX_WIDTH)
    lora_alpha: float = option(16.0, "LoRA's alpha: the update is scaled by alpha / rank", above=0, max=1e6)
    lora_dropout: float = option(0.0, "dropout on each adapter's input", min=0, below=1)
    precision: Literal["fp32", "bf16", "mixed"] = option(
        "bf16", "fp32: everything fp32; bf16: everything bf16 (torchtune); mixed: bf16 base, fp32 adapters, bf16 "
        "autocast (PEFT with the Hugging Face Trainer); qlora needs bf16 or mixed")
    optimizer: Literal["adamw", "adamw8bit"] = option("adamw8bit", "adamw: torch's AdamW; adamw8bit: this lab's 8-bit one")
    nf4_block: int = option(64, "weights per absmax in NF4 (QLoRA: 64)", min=1, max=MAX_WIDTH)
    optimizer_block: int = option(2048, "values per absmax in the 8-bit optimizer state (the paper: 2,048)", min=1,
                                 max=MAX_WIDTH)
    steps: int = option(4, "training steps", min=1, max=MAX_STEPS)
    batch_size: int = option(4, "sequences per step", min=1, max=MAX_BATCH)
    seq_len: int = option(64, "tokens per sequence", min=1, max=MAX_TOKENS)
    lr: float = option(1e-3, "learning rate", above=0, max=MAX_LR)
    width: int = option(128, "hidden size of the toy Llama", min=1, max=MAX_WIDTH)
    layers: int = option(2, "its blocks", min=1, max=MAX_LAYERS)
    heads: int = option(4, "attention heads", min=1, max=MAX_HEADS)
    kv_heads: int = option(2, "key/value heads (they divide --heads)", min=1, max=MAX_HEADS)
    ffn: int = option(256, "MLP hidden size", min=1, max=MAX_WIDTH)
    vocab: int = option(256, "vocabulary", min=1, max=MAX_VOCAB)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.width % self.heads or self.heads % self.kv_heads:
            raise UsageError(f"--heads {self.heads} must divide --width {self.width} and be a multiple of "
                             f"--kv-heads {self.kv_heads}")
        self.check_fine_tuning(self.spec())
        for n in (self.width * self.ffn, self.vocab * self.width, self.batch_size * self.seq_len * self.vocab):
            if n * 4 > 2**31:
                raise UsageError("a toy's sizes: width x ffn, vocab x width and batch x seq x vocab at most 2**29")

    def spec(self) -> zoo.ModelSpec:
        """The toy: the zoo's Llama, at this width."""
        return zoo.ModelSpec("toy-llama", "llama", layers=self.layers, width=self.width, heads=self.heads,
                             kv_heads=self.kv_heads, ffn=self.ffn, vocab=self.vocab, context=self.seq_len,
                             rope_theta=10000.0, source="Lab 15: a Llama at toy size")


# --8<-- [start:run]
def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    torch.manual_seed(config.seed)
    model = config.spec().build().to(device, weights_dtype(config.method, config.precision)).train()
    trainable = prepare(model, config.method, config.precision, config.lora_rank, config.lora_targets,
                        config.lora_alpha, config.lora_dropout, config.nf4_block)
    extra = {"block": config.optimizer_block} if config.optimizer == "adamw8bit" else {}
    optimizer = OPTIMIZERS[config.optimizer](trainable, lr=config.lr, **extra)
    data = SyntheticTokens(config.vocab, config.seq_len, config.seed)
    ledger = Ledger(device).track_module(model).track_optimizer(optimizer)
    for category, tensors in frozen(model).items():
        ledger.track(tensors, category)  # (1)!
    losses, t0 = [], time.perf_counter()
    with ledger:
        for step in range(config.steps):
            x, y = data.batch(step, config.batch_size, device)
            losses.append(train_step(model, optimizer, x, y, step, PRECISIONS[config.precision][2]))
    return Result(config, device, model, optimizer, ledger, losses, time.perf_counter() - t0)
# --8<-- [end:run]


# ---------------------------------------------------------------------- what the lab derives
NAMES = {  # the ledger's categories in a reader's words
    "frozen_weights": "frozen weights", "quant_constants": "quantization constants", "parameters": "adapters",
    "gradients": "adapter gradients", "optimizer_state": "optimizer state", "activations": "activations",
    "dequantized": "dequantized weights", "temporaries": "temporaries", "other": "other (token ids, RoPE)"}


def element(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def model_state(model, optimizer: str, block: int = 2048) -> dict[str, tuple[str, int]]:
    """Each model-state category of ``model`` (prepared) and its ``optimizer``: the formula, and its bytes
    from the shapes. The ledger must agree to the byte on a CPU (Lab 13's trace rounds each tensor to 512 B)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    t, values = element(trained[0].dtype), sum(p.numel() for p in trained)
    out = {"parameters": (f"{t} B x P", t * values), "gradients": (f"{t} B x P", t * values)}
    if any(not p.requires_grad for p in model.parameters()) or any(isinstance(m, Linear4bit) for m in model.modules()):
        ranks = sum(a.rank * (a.in_features + a.out_features) for a in adapters(model))
        out["parameters"] = out["gradients"] = (f"{t} B x r x (in + out), over the adapters", t * ranks)
        quantized = [m for m in model.modules() if isinstance(m, Linear4bit)]
        nf4 = [nf4_bytes(m.in_features * m.out_features, m.block, m.double_block) for m in quantized]
        rest = [p for p in model.parameters() if not p.requires_grad]
        b = element(rest[0].dtype)
        out["frozen_weights"] = ((f"n / 2 B per NF4 linear + {b} B x the rest" if quantized else f"{b} B x P"),
                                 sum(q["codes"] for q in nf4) + b * sum(p.numel() for p in rest))
        if quantized:
            out["quant_constants"] = ("n / 64 B + 4 B x n / 64 / 256 + 4 B, per NF4 linear",
                                      sum(q["constants"] for q in nf4))
    if optimizer == "adamw8bit":
        out["optimizer_state"] = ("2 B x n + 8 B x n / block (8 B x n under 4,096)",
                                  sum(state_bytes(p.numel(), block) for p in trained))
    else:
        out["optimizer_state"] = (f"2 x {t} B x n + 4 B step, per tensor", sum(2 * t * p.numel() + 4 for p in trained))
    return out


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Result:
    config: Config
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ledger: Ledger
    losses: list[float]
    wall_time_s: float

    def checks(self) -> Table:
        """Each model-state category: its formula against the ledger's most of it (every one is alive
        from the first optimizer step on)."""
        most = self.ledger.timeline().device
        state = model_state(self.model, self.config.optimizer, self.config.optimizer_block)
        names = NAMES | ({"parameters": "trained weights", "gradients": "gradients"} if self.config.method == "full" else {})
        rows = [[names[k], formula, value, max(most[k])] for k, (formula, value) in state.items()]
        return Table(["category", "formula", ("derived", "B"), ("measured", "B")], rows)

    def summary(self) -> dict:
        tl = self.ledger.timeline()
        return {"lab": labs.slug(__file__), "device": str(self.device), "config": self.config.__dict__ | {
                    "lora_targets": list(self.config.lora_targets)},
                "losses": self.losses, "peak_bytes": tl.peak(), "peak_bytes_by_phase": tl.peaks_by_phase(),
                "model_state": {k: v for k, (_, v) in model_state(self.model, self.config.optimizer,
                                                                   self.config.optimizer_block).items()},
                "trained_values": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


def report(result: Result) -> None:
    c = result.config
    print(f"Lab 15 on {result.device}: a toy Llama ({c.layers} x {c.width}), --method {c.method}, rank "
          f"{c.lora_rank}, {c.precision}, {c.optimizer}; {c.steps} steps")
    print("  losses: " + "  ".join(f"{loss:.3f}" for loss in result.losses))
    peaks = result.ledger.timeline().peaks_by_phase()
    print("\nPeak live bytes in each phase, by category (ledger, measured):")
    print(by_category({k: v for k, v in peaks.items() if k != "zero_grad"}).text())
    print("\nThe model state: each category's formula against the ledger, to the byte:")
    print(result.checks().text())
    deq = max(result.ledger.timeline().device["dequantized"])
    if deq:
        print(f"\nDequantized weights at their most: {format_bytes(deq)}: one linear read back to bf16 at a time.")


if __name__ == "__main__":
    cli.main(Config, run, report)
