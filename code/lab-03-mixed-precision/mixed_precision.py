"""Lab 03 - mixed precision: fp32 against fp16 + GradScaler against bf16 autocast, on a toy GPT.

The same training loop runs three recipes; only two objects change between them:

    fp32  no autocast                          no scaler
    fp16  torch.autocast(device, float16)      torch.amp.GradScaler(device): loss scaling
    bf16  torch.autocast(device, bfloat16)     no scaler (bf16 has fp32's exponent range)

A fourth, ``--recipe pure-bf16``, keeps no fp32 copy at all: the weights themselves are bf16 (and so
are their gradients and AdamW's moments), and no autocast is needed.

Each phase of a step is marked (``marks.phase``), so the memory ledger, when one watches, shows what
changes: parameters, gradients and AdamW state stay fp32 (the "master weights"), activations saved
for backward shrink, autocast adds 16-bit weight copies. ``--inject-inf-at STEP`` puts an inf in an
fp16 gradient: GradScaler skips the step and halves its scale.

With ``--model llama-3-8b --fake`` the same recipes run the zoo's Llama at real size on fake tensors
(the ledger counts every byte; nothing is allocated; Lab 02's ``scale_harness.py`` holds the harness).

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from labkit import cli, fake, labs, marks, provenance
from labkit.config import MAX_BATCH, MAX_LR, MAX_STEPS, MAX_TOKENS, MAX_WIDTH, LabConfig, UsageError, option
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import GPTConfig, TinyGPT, TinyGPTShape
from labkit.scale import RealScale
from precision_report import ACTIVATION_BAND, LOSS_RTOL, compare, forward_end, report

scale_harness = labs.load(2, "scale_harness")  # Lab 02's harness for --model/--fake: batches, the model, AdamW

RECIPES = ("fp32", "fp16", "bf16")  # what --recipe all trains
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "pure-bf16": torch.bfloat16}
WEIGHTS = {"pure-bf16": torch.bfloat16}  # the weights' dtype where it is not float32
FP32 = torch.finfo(torch.float32)


# --8<-- [start:recipes]
def autocast(recipe: str, device: torch.device):
    if recipe in ("fp32", "pure-bf16"):
        return contextlib.nullcontext()  # every op in the weights' own dtype
    return torch.autocast(device.type, dtype=DTYPES[recipe])  # (1)!


def make_scaler(recipe: str, device: torch.device, init_scale: float, growth_interval: int) -> torch.amp.GradScaler:
    """The loss scaler: enabled for fp16 only. ``init_scale``: the first scale S;
    ``growth_interval``: clean steps in a row before S doubles."""
    return torch.amp.GradScaler(
        device.type,
        init_scale=init_scale,  # (2)!
        growth_factor=2.0,
        backoff_factor=0.5,  # (3)!
        growth_interval=growth_interval,
        enabled=recipe == "fp16",  # (4)!
    )


def check_autocast(recipe: str, device: torch.device) -> None:
    """Ask this torch whether it can autocast to the recipe's dtype here, instead of assuming."""
    with autocast(recipe, device):
        dtype = WEIGHTS.get(recipe, torch.float32)
        got = (torch.ones(2, 2, device=device, dtype=dtype) @ torch.ones(2, 2, device=device, dtype=dtype)).dtype
    if got != DTYPES[recipe]:
        raise UsageError(f"torch {torch.__version__} does not autocast matmuls to {recipe} on {device.type}")
# --8<-- [end:recipes]


# --8<-- [start:step]
def train_step(model, optimizer, scaler, recipe: str, x, y, step: int, inject_inf: bool = False) -> dict:
    """One step in ``recipe`` (fp32, fp16, bf16) with ``scaler`` (:func:`make_scaler`) on the batch
    ``x, y``; ``step`` names the phases; ``inject_inf`` puts an inf in a gradient after backward."""
    with marks.phase("zero_grad", step):
        optimizer.zero_grad(set_to_none=True)
    with marks.phase("forward", step):
        with autocast(recipe, x.device):
            loss = model(x, y)[1]  # (1)!
    with marks.phase("backward", step):
        scaler.scale(loss).backward()  # (2)!
        if inject_inf:
            model.head.weight.grad[0, 0] = float("inf")  # (3)!
    scale_before, updates_before = scaler.get_scale(), updates(optimizer)
    with marks.phase("optimizer", step):
        scaler.step(optimizer)  # (4)!
        scaler.update()  # (5)!
    return {"step": step, "loss": loss.item(), "scale_before": scale_before, "scale_after": scaler.get_scale(),
            "skipped": updates(optimizer) == updates_before}  # (6)!


def updates(optimizer) -> int:
    """Updates AdamW has made: the step counter it keeps with each parameter (0 before the first)."""
    return int(optimizer.state.get(optimizer.param_groups[0]["params"][0], {}).get("step", 0))
# --8<-- [end:step]


# --8<-- [start:census]
def is_weight_copy(t: torch.Tensor) -> bool:
    """Autograd's graph says whether ``t`` is a (view of a) dtype cast of a parameter."""
    fn = t.grad_fn
    for _ in range(4):  # walk through views such as weight.t()
        if fn is None:
            return False
        if fn.name() == "ToCopyBackward0":  # (1)!
            return any(f is not None and "AccumulateGrad" in f.name() for f, _ in fn.next_functions)
        inputs = [f for f, _ in fn.next_functions if f is not None]
        fn = inputs[0] if len(inputs) == 1 else None
    return False


def saved_for_backward(model, recipe: str, x, y) -> dict[str, int]:
    """Bytes of the new tensors one forward of ``model`` on ``x, y`` in ``recipe`` saves for
    backward, by kind: the ledger's activations."""
    existing = {storage_id(t) for t in [*model.parameters(), x, y]}
    kinds: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = storage_id(t)
        if ptr not in existing and ptr not in kinds:  # (2)!
            kind = "16-bit weight copies" if is_weight_copy(t) else str(t.dtype).removeprefix("torch.")
            kinds[ptr] = (kind, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(recipe, x.device):
        model(x, y)  # (3)!
    return {k: sum(n for kind, n in kinds.values() if kind == k) for k in dict(kinds.values())}


def storage_id(t: torch.Tensor) -> int:
    """Which storage ``t`` views: its address, or for a fake tensor (which has none) the storage's identity."""
    return t.untyped_storage()._cdata if fake.is_fake(t) else t.untyped_storage().data_ptr()
# --8<-- [end:census]


# --8<-- [start:config]
@dataclass
class Config(RealScale, TinyGPTShape, LabConfig):
    """Train a toy GPT (or, with --model, a real one) in fp32, fp16 + GradScaler and bf16 autocast; compare."""

    seq_len: int = option(32, "tokens per sequence", min=1, max=MAX_TOKENS)
    width: int = option(64, "model width", min=1, max=MAX_WIDTH)
    recipe: Literal["fp32", "fp16", "bf16", "pure-bf16", "all"] = option(
        "all", "the recipe to train, or all three of fp32, fp16 and bf16 "
        "(pure-bf16: bf16 weights and state, no fp32 master)")
    steps: int = option(20, "training steps per recipe", min=1, max=MAX_STEPS)
    ledger_steps: int = option(2, "steps under the ledger; the rest are timed", min=1, max=MAX_STEPS)
    batch_size: int = option(8, "sequences per step", min=1, max=MAX_BATCH)
    lr: float = option(3e-3, "AdamW learning rate", above=0, max=MAX_LR)
    dropout: float = option(0.0, "dropout probability", min=0, below=1)
    init_scale: float = option(2.0**16, "GradScaler's first scale (a float32 number)", above=0, max=FP32.max)
    growth_interval: int = option(2000, "clean steps before the scale doubles", min=1, max=MAX_STEPS)
    inject_inf_at: int | None = option(None, "fp16: put an inf in a gradient at this step",
                                       min=0, max=MAX_STEPS, metavar="STEP")
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history pickle here", path="write")
    adamw: Literal["auto", "foreach", "for-loop", "fused"] = option(
        "auto", "AdamW's implementation; auto: PyTorch's choice (foreach on CUDA, for-loop on CPU; with --fake, CUDA's)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fake and self.inject_inf_at is not None:
            raise UsageError("--inject-inf-at needs values: a --fake run has none")
        if not FP32.tiny <= self.init_scale <= FP32.max:  # GradScaler keeps S, and uses 1/S, in float32
            raise UsageError(f"--init-scale {self.init_scale:g} does not fit float32, where GradScaler keeps the "
                             f"scale and its reciprocal: give a number in [{FP32.tiny:.3g}, {FP32.max:.3g}]")
        if self.inject_inf_at is not None and self.recipe not in ("fp16", "all"):
            raise UsageError("--inject-inf-at needs the fp16 recipe: only GradScaler skips a step on inf")
        if self.inject_inf_at is not None and self.inject_inf_at >= self.steps:
            raise UsageError(f"--inject-inf-at {self.inject_inf_at} is past the last step ({self.steps - 1})")
# --8<-- [end:config]


# --8<-- [start:train]
def train(config: Config, recipe: str) -> RecipeRun:
    device = cli.pick_device(config.device)
    check_autocast(recipe, device)
    torch.manual_seed(config.seed)
    model_config, weights = config.model_config(), WEIGHTS.get(recipe)
    scale_harness.require_memory(config, model_config, config.batch_size, device, weights)  # too big: refused
    model = scale_harness.build_model(config, lambda: TinyGPT(model_config), device, weights)  # (1)!
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  **scale_harness.adamw_options(config.adamw, config.fake))
    scaler = make_scaler(recipe, device, config.init_scale, config.growth_interval)
    data = scale_harness.token_source(config, model_config)
    ledger = Ledger(device).track_module(model).track_optimizer(optimizer)
    steps, times, inject = [], [], None

    def one_step(step: int) -> None:
        nonlocal inject
        x, y = data.batch(step, config.batch_size, device)
        hit = recipe == "fp16" and step == config.inject_inf_at
        before = [p.detach().clone() for p in model.parameters()] if hit else []
        t = time.perf_counter()
        record = train_step(model, optimizer, scaler, recipe, x, y, step, inject_inf=hit)
        times.append(time.perf_counter() - t)  # loss.item() in train_step waited for the device
        steps.append(record | {"growth_tracker": scaler.state_dict().get("_growth_tracker", 0)})
        if hit:  # (2)!
            inject = steps[-1] | {"params_unchanged": all(map(torch.equal, before, model.parameters()))}

    reset_peak(device)
    t0, n_ledger = time.perf_counter(), min(config.ledger_steps, config.steps)
    with ledger:  # (3)!
        for step in range(n_ledger):
            one_step(step)
    for step in cli.progress(range(n_ledger, config.steps), total=config.steps - n_ledger, desc=recipe):
        one_step(step)
    wall, cuda = time.perf_counter() - t0, ledger_vs_allocator(ledger.timeline(), allocator_stats(device))
    saved = saved_for_backward(model, recipe, *data.batch(0, config.batch_size, device))  # (4)!
    return RecipeRun(recipe, model_config, scaler, ledger, steps, times[n_ledger:], inject, saved, wall, cuda,
                     **parameter_counts(model))
# --8<-- [end:train]


def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    if config.fake:  # a fake step has no time to measure: only the ledger's steps run, and no value is read
        config = replace(config, steps=min(config.ledger_steps, config.steps))
    with record_snapshot(config.snapshot), config.tensors(), scale_harness.values_read_as_zero(config.fake):
        runs = {recipe: train(config, recipe) for recipe in (RECIPES if config.recipe == "all" else (config.recipe,))}
    if config.fake:  # the losses, scales and skips of a fake step read as zeros: none is kept
        runs = {name: replace(r, steps=[], traced=True) for name, r in runs.items()}
    return Result(config, device, runs)


def parameter_counts(model: torch.nn.Module) -> dict:
    """The parameters' dtypes (fp32 in every recipe: the master weights), their count, and the
    elements of every Linear weight: what autocast casts to 16 bits in every forward."""
    return {"param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
            "params": sum(p.numel() for p in model.parameters()),
            "linear_weights": sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))}


# ---------------------------------------------------------------------- the result and its report
@dataclass
class RecipeRun:
    """One recipe's run: a record per step, the ledger of the first --ledger-steps steps, the census."""

    recipe: str
    model_config: GPTConfig
    scaler: torch.amp.GradScaler
    ledger: Ledger
    steps: list[dict]  # loss, scale before and after, skipped, growth tracker
    step_times_s: list[float]  # the steps after the ledger's
    inject: dict | None  # the injected step's record, and whether the parameters stayed unchanged
    saved: dict[str, int]  # bytes one forward saves for backward, by kind
    wall_time_s: float
    cuda: dict | None
    param_dtypes: list[str]
    params: int
    linear_weights: int
    traced: bool = False  # on fake tensors: bytes only, no losses, scales or times

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    def forward_activations(self, step: int = 0) -> int:
        """The ledger's activation bytes at the end of ``step``'s forward."""
        tl = self.ledger.timeline()
        return tl.device["activations"][forward_end(tl, step)]

    def summary(self) -> dict:
        tl, scaler = self.ledger.timeline(), self.scaler
        # GradScaler keeps its state in two one-element tensors on the device (private names: read, not written)
        values = scaler.is_enabled() and not self.traced  # a fake scaler's state has no values
        tensors = {n: getattr(scaler, n, None) for n in ("_scale", "_growth_tracker")} if values else {}
        return {
            "autocast_dtype": None if self.recipe in ("fp32", "pure-bf16") else self.recipe,
            "grad_scaler": scaler.is_enabled(),
            "losses": self.losses, "steps": self.steps, "skipped_steps": [s["step"] for s in self.steps if s["skipped"]],
            "parameter_dtypes": self.param_dtypes, "activation_bytes": max(tl.device["activations"], default=0),
            "peak_bytes": tl.peak(), "peak_bytes_by_phase": tl.peaks_by_phase(), "saved_for_backward": self.saved,
            "weight_copy_bytes_derived": 0 if self.recipe in ("fp32", "pure-bf16") else 2 * self.linear_weights,
            "step_time_s": statistics.median(self.step_times_s) if self.step_times_s else None,
            "scaler_state": scaler.state_dict() if values else None,
            "scaler_tensors": {n: {"dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device), "value": t.item()}
                               for n, t in tensors.items() if isinstance(t, torch.Tensor)},
            "inject": self.inject, "cuda": self.cuda,
        }


@dataclass
class Result:
    """What :func:`run` returns: the config, the device, and one :class:`RecipeRun` per recipe."""

    config: Config
    device: torch.device
    runs: dict[str, RecipeRun]

    def vs_fp32(self) -> dict[str, dict]:
        """Each 16-bit recipe against fp32 (:func:`compare`); empty without an fp32 run."""
        if "fp32" not in self.runs or self.config.fake:  # a traced run has no losses to compare
            return {}
        base = self.runs["fp32"].summary()
        return {n: compare(base, r.summary()) for n, r in self.runs.items() if n != "fp32"}

    def summary(self) -> dict:
        first = next(iter(self.runs.values()))
        cpu = self.device.type == "cpu"
        spec = self.config.model_spec()
        return {
            "lab": labs.slug(__file__), "device": str(self.device), "model": self.config.model,
            "traced": scale_harness.TRACED if self.config.fake else None,
            "config": first.model_config.to_dict() if spec is None else asdict(spec) | {"seq_len": self.config.seq_len},
            "params": first.params, "recipes": {n: r.summary() for n, r in self.runs.items()}, "vs_fp32": self.vs_fp32(),
            "tolerances": {"loss_rtol": LOSS_RTOL, "activation_ratio_band": list(ACTIVATION_BAND)},
            "timing": "CPU timing, not a GPU figure" if cpu else "CUDA timing",
            "gpu_target": "bf16 step at least 1.8x faster than fp32 on an H100-class GPU: a target for the GPU run",
            "provenance": provenance.collect(__file__, self.device, sum(r.wall_time_s for r in self.runs.values())),
        }


if __name__ == "__main__":
    cli.main(Config, run, report)
