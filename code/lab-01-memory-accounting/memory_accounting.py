"""Lab 01 - where the bytes of a transformer go: the memory ledger as formulas, checked by measurement.

Model state is bytes per parameter x P (parameters, gradients, fp32 master weights, optimizer state).
Activations follow Korthikanti et al. 2022, layer by layer. The KV cache of inference is
2 x layers x batch x seq x kv_heads x head_dim elements. ZeRO (Rajbhandari et al. 2020) divides the
model state across N data-parallel ranks, stage by stage. ``--measure`` runs one training step of the
toy GPT of the same shape while the memory ledger watches, and sets measured bytes next to the formulas.

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from labkit import cli
from labkit.config import (
    MAX_BATCH, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_PARAMS, MAX_RANKS, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH,
    LabConfig, UsageError, flag, option,
)
from labkit.table import format_bytes
from accounting_tables import Result, report
from model_parallel import ONE_GPU, Layout, activation_formula, params_per_rank
from toy_gpt import Shape, measure_step


# --8<-- [start:recipes]
@dataclass(frozen=True)
class Recipe:
    param: int  # bytes of the working copy of one parameter (what forward reads)
    grad: int  # bytes of its gradient
    master: int  # bytes of an fp32 master copy kept for the optimizer (0: none)
    moment: int  # bytes of one optimizer moment (momentum, Adam's m or v)
    act: int  # bytes of one activation element


RECIPES = {
    "fp32": Recipe(param=4, grad=4, master=0, moment=4, act=4),  # (1)!
    "mixed": Recipe(param=2, grad=2, master=4, moment=4, act=2),  # (2)!
    "bf16": Recipe(param=2, grad=2, master=0, moment=2, act=2),  # (3)!
}
MOMENTS = {"sgd": 0, "momentum": 1, "adamw": 2}  # (4)!
STEP_COUNTER = 4  # Adam and AdamW keep one fp32 step count per parameter tensor
MASK = 1  # the paper's dropout mask: one byte per element
# --8<-- [end:recipes]


# --8<-- [start:model_state]
def model_state_bytes(params: int, precision: str = "fp32", optimizer: str = "adamw",
                      tensors: int = 0) -> dict[str, int]:
    """Parameters, gradients, master weights, optimizer state (ZeRO paper, section 3.1).

    params: parameter count P; precision: a key of RECIPES; optimizer: a key of MOMENTS;
    tensors: parameter tensors, for AdamW's step counters (0 leaves them out)."""
    r = RECIPES[precision]
    counters = STEP_COUNTER * tensors if optimizer == "adamw" else 0
    return {"parameters": r.param * params,
            "gradients": r.grad * params,
            "master_weights": r.master * params,  # (1)!
            "optimizer_state": MOMENTS[optimizer] * r.moment * params + counters}  # (2)!


ZERO_SHARDS = {"optimizer_state": 1, "master_weights": 1, "gradients": 2, "parameters": 3}  # (3)!


def zero_model_state(params: int, precision: str = "fp32", optimizer: str = "adamw",
                     zero_stage: int = 0, dp: int = 1, tensors: int = 0) -> dict[str, int]:
    """Model state on ONE of dp ranks under ZeRO stage 0-3 (ZeRO paper, section 5).

    params, precision, optimizer, tensors: as for model_state_bytes; zero_stage: 0 to 3;
    dp: data-parallel ranks the sharded categories are divided across."""
    full = model_state_bytes(params, precision, optimizer, tensors)
    shard = model_state_bytes(-(-params // dp), precision, optimizer, tensors)  # (4)!
    return {k: shard[k] if zero_stage >= ZERO_SHARDS[k] else full[k] for k in full}
# --8<-- [end:model_state]


# --8<-- [start:activations]
def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, act: int = 2,
                               mask: int | None = MASK, recompute: str = "none", tp: int = 1,
                               sp: bool = False, cp: int = 1) -> int:
    """Bytes one transformer layer keeps for backward on one GPU (Korthikanti et al. 2022, 4.1, 4.2, 5).

    seq, batch, hidden, heads: s, b, h, a; act: bytes per activation element; mask: bytes per
    dropout-mask element (None: no dropout at all); recompute: none, selective or full; tp: the
    tensor-parallel size t; sp: sequence parallelism; cp: the context-parallel size (s/cp tokens
    per GPU). act=2, mask=1: the paper's sbh(34 + 5as/h); with tp=t, sbh(10 + 24/t + 5as/(ht));
    with sp too, sbh/t(34 + 5as/h) (Table 2)."""
    sbh = seq // cp * batch * hidden
    whole = tp if sp else 1  # sequence parallelism splits, along s, what tensor parallelism keeps whole
    if recompute == "full":
        return act * sbh // whole  # (1)!
    drop = mask is not None
    per_layer = (4 * act + (2 * mask if drop else 0)) * sbh // whole + 12 * act * sbh // tp  # (2)!
    if recompute == "none":
        scores = heads * seq * seq * batch // cp  # one s x s matrix per head (s/cp rows of it per GPU)
        per_layer += (act + (act + mask if drop else 0)) * scores // tp  # (3)!
    return per_layer


def kv_cache_bytes(shape: Shape, act: int = 2, tp: int = 1, pp: int = 1) -> int:
    """Inference: a key and a value per layer, token and KV head (2 x L x b x s x kv x d), on one
    GPU: tensor parallelism gives it kv/tp heads (a copy of one when tp exceeds kv), a pipeline
    stage holds its L/pp layers."""
    kv_heads = max((shape.kv_heads or shape.heads) // tp, 1)
    head_dim = shape.hidden // shape.heads
    return 2 * shape.layers // pp * shape.batch * shape.seq * kv_heads * head_dim * act  # (4)!
# --8<-- [end:activations]


# --8<-- [start:estimate]
def estimate_bytes(params: int | None = None, shape: Shape | None = None,
                   precision: str = "fp32", optimizer: str = "adamw", zero_stage: int = 0,
                   dp: int = 1, recompute: str = "none", dropout: bool = True,
                   inference: bool = False, layout: Layout = ONE_GPU) -> dict[str, int]:
    """The ledger in one call: bytes per category held by ONE GPU.

    params: a parameter count, or shape: a model shape (only a shape has activations, a KV cache
    and a layout); precision, optimizer, zero_stage: as for zero_model_state; dp: data-parallel
    ranks; recompute: as for activation_bytes_per_layer; dropout: whether the layers keep dropout
    masks; inference: weights and KV cache instead of a training step; layout: the model-parallel
    split (parallelism.Layout), whose figures are pipeline stage 0's."""
    if (params is None) == (shape is None) or (inference and shape is None):
        raise ValueError("give params or a shape, not both (inference needs a shape)")
    r = RECIPES[precision]
    if shape is None:
        return zero_model_state(params, precision, optimizer, zero_stage, dp)
    mine = params_per_rank(shape, layout)
    if inference:  # (1)!
        return {"parameters": r.param * (mine["dense"] + mine["experts"]),
                "kv_cache": kv_cache_bytes(shape, r.act, layout.tp, layout.pp)}
    replicas = dp * layout.cp  # context-parallel GPUs hold the same weights: ZeRO shards across them too
    dense = zero_model_state(mine["dense"], precision, optimizer, zero_stage, replicas, mine["tensors"])
    experts = zero_model_state(mine["experts"], precision, optimizer, zero_stage, replicas // layout.ep)
    out = {k: dense[k] + experts[k] for k in dense}
    per_layer = activation_bytes_per_layer(shape.seq, shape.batch, shape.hidden, shape.heads, r.act,
                                           MASK if dropout else None, recompute, layout.tp, layout.sp, layout.cp)
    out["activations"] = shape.layers // layout.pp * layout.in_flight * per_layer  # (2)!
    return out
# --8<-- [end:estimate]


# --8<-- [start:config]
SHAPE_FLAGS = ("layers", "hidden", "heads", "seq", "batch", "vocab", "kv_heads")
TOY = Shape(layers=2, hidden=128, heads=4, seq=64, batch=8, vocab=256, kv_heads=None)
CPU_MEASURE_LIMIT = 2 * 2**30  # --measure on CPU refuses shapes whose formulas exceed this


def parameter_count(text: str) -> int:
    """``--params 7e9``: a count written as an integer or in scientific notation."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number such as 7e9, got {text!r}") from None
    if not (value >= 1 and value.is_integer()):
        raise ValueError(f"must be a whole number of parameters, 1 or more, got {text}")
    return int(value)


@dataclass
class Config(LabConfig):
    """The memory ledger of a transformer: formulas per category, per rank, checked by --measure."""

    params: int | None = option(None, "parameter count (7e9 works); instead of a shape", min=1, max=MAX_PARAMS,
                                parse=parameter_count)
    layers: int | None = option(None, f"model shape: transformer blocks (toy default {TOY.layers})",
                                min=1, max=MAX_LAYERS)
    hidden: int | None = option(None, f"model shape: hidden size (toy default {TOY.hidden})", min=1, max=MAX_WIDTH)
    heads: int | None = option(None, f"model shape: attention heads (toy default {TOY.heads})", min=1, max=MAX_HEADS)
    seq: int | None = option(None, f"model shape: tokens per sequence (toy default {TOY.seq})", min=1, max=MAX_TOKENS)
    batch: int | None = option(None, f"model shape: sequences per rank (toy default {TOY.batch})", min=1, max=MAX_BATCH)
    vocab: int | None = option(None, f"model shape: vocabulary (toy default {TOY.vocab})", min=1, max=MAX_VOCAB)
    kv_heads: int | None = option(None, "model shape: KV heads for the KV cache (default: one per head)",
                                  min=1, max=MAX_HEADS)
    precision: Literal["fp32", "mixed", "bf16"] = option(
        "fp32", "fp32; mixed: 16-bit weights and activations, fp32 master weights and states; "
        "bf16: pure bf16 (no fp32 master)")
    optimizer: Literal["sgd", "momentum", "adamw"] = option("adamw", "the optimizer whose state is counted")
    zero_stage: Literal[0, 1, 2, 3] = option(0, "ZeRO stage: 1 shards optimizer state, 2 gradients, 3 weights")
    dp: int = option(1, "data-parallel ranks; figures are per rank", min=1, max=MAX_RANKS)
    tp: int = option(1, "tensor-parallel size: each layer's matrices split across t GPUs (shape only)",
                     min=1, max=MAX_RANKS)
    sp: bool = option(False, "sequence parallelism, with --tp: norms and dropouts split along the sequence")
    pp: int = option(1, "pipeline stages, 1F1B: figures are stage 0's, which holds --pp micro-batches",
                     min=1, max=MAX_RANKS)
    cp: int = option(1, "context-parallel size: each GPU holds seq/cp tokens of every sequence", min=1, max=MAX_RANKS)
    experts: int | None = option(None, "MoE: experts per layer, each an MLP of the dense size (default: dense)",
                                 min=1, max=MAX_EXPERTS)
    ep: int = option(1, "expert-parallel size: each GPU holds experts/ep of every MoE layer", min=1, max=MAX_RANKS)
    recompute: Literal["none", "selective", "full"] = option("none", "activation recomputation (shape only)")
    dropout: float = option(0.1, "dropout probability; 0 removes the dropout masks", min=0, below=1)
    inference: bool = option(False, "weights and KV cache instead of a training step")
    measure: bool = option(False, "run one step of the toy GPT under the memory ledger")
    snapshot: Path | None = option(None, "CUDA only, with --measure: dump a memory-history pickle", path="write")

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [flag(n) for n in SHAPE_FLAGS if getattr(self, n) is not None]
        if self.params is not None and given:
            raise UsageError(f"--params and a model shape ({' '.join(given)}) exclude each other: --params gives "
                             "the model state only; activations need the whole shape")
        split = {"tp": self.tp > 1, "sp": self.sp, "pp": self.pp > 1, "cp": self.cp > 1,
                 "experts": self.experts is not None, "ep": self.ep > 1}
        for name, asked in (("recompute", self.recompute != "none"), ("inference", self.inference),
                            ("measure", self.measure), *split.items()):
            if self.params is not None and asked:
                raise UsageError(f"--{name} needs a model shape (--layers --hidden --heads --seq --batch --vocab), "
                                 "not --params")
        shape = self.shape or TOY
        if shape.hidden % shape.heads:
            raise UsageError(f"--heads {shape.heads} does not divide --hidden {shape.hidden}")
        if shape.kv_heads and shape.heads % shape.kv_heads:
            raise UsageError(f"--kv-heads {shape.kv_heads} does not divide --heads {shape.heads}")
        if self.inference and (self.zero_stage or self.measure):
            raise UsageError("--inference counts weights and KV cache; it takes no --zero-stage or --measure")
        if self.measure and (self.dp > 1 or self.zero_stage):
            raise UsageError("--measure runs one process: drop --dp and --zero-stage (ZeRO per rank is Lab 11)")
        if self.snapshot and not self.measure:
            raise UsageError("--snapshot records the --measure run: add --measure --device cuda")
        t, c, kv = self.tp, self.cp, shape.kv_heads or shape.heads
        if shape.heads % t or kv % t and t % kv:
            raise UsageError(f"--tp {t} must divide --heads {shape.heads}, and divide or be a multiple of the "
                             f"{kv} KV heads: each GPU computes whole heads")
        if shape.layers % self.pp:
            raise UsageError(f"--pp {self.pp} does not divide --layers {shape.layers}: each stage holds layers/pp")
        if shape.seq % c:
            raise UsageError(f"--cp {c} does not divide --seq {shape.seq}: each GPU holds seq/cp tokens")
        if self.sp and (t == 1 or shape.seq // c % t):
            raise UsageError(f"--sp splits the {shape.seq // c} tokens of a GPU's sequence across the --tp GPUs: "
                             "give a --tp of 2 or more that divides them")
        if self.experts is None and self.ep > 1 or self.experts and self.experts % self.ep:
            raise UsageError(f"--ep {self.ep} must divide --experts ({self.experts or 'none: a dense model'})")
        if self.dp * c % self.ep:
            raise UsageError(f"--ep {self.ep} must divide --dp x --cp = {self.dp * c}: expert-parallel GPUs are "
                             "data-parallel GPUs that hold different experts")
        if self.inference and (self.sp or c > 1):
            raise UsageError("--inference counts weights and the KV cache: --sp and --cp split training activations")
        if self.measure and any(split.values()):
            raise UsageError("--measure runs one process of TinyGPT: drop --tp, --sp, --pp, --cp, --experts, --ep")

    @property
    def shape(self) -> Shape | None:
        """The model shape, the toy's for every shape flag not given; None with --params."""
        if self.params is not None:
            return None
        return Shape(**{n: getattr(self, n) if getattr(self, n) is not None else getattr(TOY, n)
                        for n in SHAPE_FLAGS})

    @property
    def layout(self) -> Layout:
        """The model-parallel split (one GPU, no split, by default)."""
        return Layout(self.tp, self.sp, self.pp, self.cp, self.experts or 0, self.ep)
# --8<-- [end:config]


def run(config: Config) -> Result:
    t0 = time.perf_counter()
    shape = config.shape
    derived = estimate_bytes(config.params, shape, config.precision, config.optimizer, config.zero_stage,
                             config.dp, config.recompute, config.dropout > 0, config.inference, config.layout)
    device, measurement = torch.device("cpu"), None
    if config.measure:
        device = cli.pick_device(config.device)
        if config.snapshot and device.type != "cuda":
            raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA feature)")
        if device.type == "cpu" and sum(derived.values()) > CPU_MEASURE_LIMIT:
            raise UsageError(f"--measure on CPU is for toy shapes: the formulas give "
                             f"{format_bytes(sum(derived.values()))} (limit {format_bytes(CPU_MEASURE_LIMIT)}); "
                             "shrink the shape")
        recipe = RECIPES[config.precision]  # fp32: a 4-byte model; mixed and bf16: a 2-byte one
        measurement = measure_step(shape, dtype=torch.float32 if recipe.param == 4 else torch.bfloat16,
                                   fp32_masters=recipe.master > 0, optimizer=config.optimizer,
                                   dropout=config.dropout, device=device, seed=config.seed, snapshot=config.snapshot)
    formulas = {k: formula_text(k, config) for k in derived}
    per_parameter = sum(model_state_bytes(1, config.precision, config.optimizer).values())
    return Result(config, shape, derived, formulas, RECIPES[config.precision], per_parameter, measurement, device,
                  time.perf_counter() - t0)


# ---------------------------------------------------------------------- the formulas, as the report says them
def formula_text(category: str, config: Config) -> str:
    """The formula behind one category of the report, with this run's numbers in it."""
    r, lay = RECIPES[config.precision], config.layout
    units = f", e={r.act}" + ("" if config.recompute == "full" else f", m={MASK}" if config.dropout else ", no dropout")
    layers, kv = "L/p" if lay.pp > 1 else "L", "max(kv_heads/t, 1)" if lay.tp > 1 else "kv_heads"
    fixed = {"kv_cache": f"2 x {layers} x b x s x {kv} x head_dim x {r.act} B",
             "activations": activation_formula(config.recompute, config.dropout > 0, lay, units)}
    if category in fixed:
        return fixed[category]
    coeff = {"parameters": r.param, "gradients": r.grad, "master_weights": r.master,
             "optimizer_state": MOMENTS[config.optimizer] * r.moment}[category]
    groups = [("P" if lay == ONE_GPU else "P_gpu", config.dp * lay.cp)]  # P_gpu: the parameters on this GPU
    if lay.experts:  # ZeRO shards the experts across the GPUs that hold the same ones
        groups = [("P_dense", config.dp * lay.cp), ("P_experts", config.dp * lay.cp // lay.ep)]
    sharded = [name + (f" / {n}" if config.zero_stage >= ZERO_SHARDS[category] and n > 1 else "") for name, n in groups]
    body = sharded[0] if len(sharded) == 1 else f"({' + '.join(sharded)})"
    adam = category == "optimizer_state" and config.optimizer == "adamw" and config.shape is not None
    tensors = params_per_rank(config.shape, lay)["tensors"] if adam else 0
    return f"{coeff} B x {body}" + (f" + 4 B x {tensors} tensors" if adam else "")


if __name__ == "__main__":
    cli.main(Config, run, report)
