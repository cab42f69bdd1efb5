"""Lab 13 - the levers that make a step fit, cheapest first, each re-traced.

A lever is one change to the configuration. ``LEVERS`` lists first the **exact** levers, which leave
the step's numbers what they were (the same loss and gradients, up to the order of a sum), in the
order of what they cost, stated for each: what costs nothing (a better kernel), then a little
recomputation or communication, then a slower step, then PCIe traffic every step. Then the levers
that **change the numerics** (bf16 matmuls, bf16 weights and moments), which a run should not get
silently while an exact one would do. That order is a judgement, written down once here; the savings
are not: :func:`search` traces the step with each lever pulled alone and reports the bytes it saved
at the per-rank peak.

One saving is derived rather than traced, and says so: a lever that changes only some phases
(fused AdamW only the optimizer step; checkpointing and the micro-batch only forward and backward)
cannot lower a peak that lies in another phase, which it leaves exactly as it was: it saves 0.

When no lever fits alone, the levers that saved bytes are pulled together, cheapest first (a
stronger lever of the same kind replacing a weaker one), re-traced after each, until the step fits.
A lever that halves something (the micro-batch) is pulled again while it applies and saves bytes:
batch 8 that needs batch 2 gets there.

Every-kth-block checkpointing (torchtitan's layer policy) is exact but not a lever: save-matmuls costs less
(pointwise ops recomputed, not every second block's forward) and keeps less (Llama-3-8B traced, on one GPU at
4,096 tokens and under ZeRO-3 at 8,192, every second block peaks higher), so the ladder never keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from labkit import cli
from labkit.config import UsageError

TRAIN, INFER = ("train",), ("train", "infer")


@dataclass(frozen=True)
class Lever:
    name: str
    kind: str  # levers of one kind replace each other when pulled together
    cost: str | Mapping[str, str]  # what it costs, in speed, numerics or complexity (per task where that differs)
    tasks: tuple[str, ...]
    phases: tuple[str, ...] | None  # the phases it changes (None: all of them)
    pull: Callable  # config -> the fields it changes, or None where it does not apply
    repeats: bool = False  # pulled again while it applies and saves bytes (a halving)
    exact: bool = True  # the same numbers (False: it changes the numerics, as bf16 weights do)

    @property
    def numerics(self) -> str:
        return "exact" if self.exact else "numerics-changing"

    def cost_for(self, task: str) -> str:
        """What pulling it costs for ``task`` (inference has no accumulation to make up a smaller batch)."""
        return self.cost if isinstance(self.cost, str) else self.cost[task]


def _adam(c) -> bool:
    return c.optimizer in ("adamw", "adamw-foreach")


def _free(c) -> bool:
    """Not stepping the optimizer in backward (``--optimizer-in-backward`` rules out accumulation, ZeRO, offload)."""
    return not getattr(c, "optimizer_in_backward", False)


def _offloadable(c) -> bool:
    """--offload-activations applies: not yet on, no FSDP2 (ZeRO-2/3); the calculator's formula counts a dense
    Llama block (its ``spec`` is a method; Lab 13 traces any model)."""
    if c.offload_activations or c.zero_stage >= 2:
        return False
    s = c.spec() if callable(c.spec) else None
    return s is None or s.family != "gpt" and not s.experts and c.method == "full" and s.layers >= 2


def _full_loss(c) -> bool:
    """The loss is the model's own (every logit at once), on a zoo model (a Hugging Face config's model has its
    own head and loss; the calculator's ``spec`` is a method, never a Hugging Face model's); under LoRA too."""
    return c.loss == "full" and getattr(c.spec, "family", None) != "hf"


# --8<-- [start:levers]
LEVERS = (  # exact first, cheapest first; then those that change the numerics
    Lever("fused AdamW", "optimizer", "none: the same update, one fused kernel per parameter group", TRAIN,
          ("optimizer",), lambda c: {"optimizer": "adamw-fused"} if _adam(c) and c.offload == "none" else None),
    Lever("embedding and head as FSDP units", "units", "none: the same all-gathers, the head's no longer repeated in "
          "backward (torchtitan's units)", TRAIN, None, lambda c: {"fsdp_units": "blocks-embed-head"}
          if c.zero_stage >= 2 and c.fsdp_units == "blocks" and c.offload != "params" and c.pp == 1 else None),
    Lever("optimizer step in backward", "gradients", "none in speed; no clipping by the global gradient norm, no "
          "accumulation: each gradient is gone once its parameter is stepped", TRAIN, None,
          lambda c: {"optimizer_in_backward": True} if _free(c) and c.accumulation == 1 and not c.zero_stage
          and c.offload == "none" and getattr(c, "method", "full") == "full" else None),
    Lever("save-matmuls checkpointing", "checkpointing", "recomputes the pointwise ops in backward: a few % of the step",
          TRAIN, ("forward", "backward"), lambda c: {"checkpointing": "save-matmuls"} if c.checkpointing == "none" else None),
    Lever("chunked loss", "loss", "one more head matmul per token, in backward (each chunk recomputed)",
          TRAIN, ("forward", "backward"), lambda c: {"loss": "chunked"} if _full_loss(c) else None),
    Lever("ZeRO-1", "zero", "no more communication than DDP: each rank updates its share of the state", TRAIN, None,
          lambda c: {"zero_stage": 1} if c.dp > 1 and c.zero_stage < 1 and c.offload == "none" and _free(c) else None),
    Lever("ZeRO-2", "zero", "DDP's communication volume, as reduce-scatter and all-gather", TRAIN, None,
          lambda c: {"zero_stage": 2} if c.dp > 1 and c.zero_stage < 2 and c.offload == "none" and _free(c) else None),
    Lever("half the micro-batch", "batch",
          {"train": "twice the steps of accumulation for the same tokens: smaller matmuls",
           "infer": "fewer sequences per forward: lower throughput"},
          INFER, ("forward", "backward", "prefill"),
          lambda c: {"batch": c.batch // 2, "accumulation": c.accumulation * 2 if c.task == "train" else 1}
          if c.batch > 1 and (_free(c) or c.task != "train") else None, repeats=True),
    Lever("ZeRO-3", "zero", "1.5x DDP's communication: parameters gathered in forward and again in backward", INFER,
          None, lambda c: {"zero_stage": 3} if c.dp > 1 and c.zero_stage < 3 and c.offload == "none" and _free(c) else None),
    Lever("full checkpointing", "checkpointing", "one more forward per step: about a third more compute", TRAIN,
          ("forward", "backward"), lambda c: {"checkpointing": "full"} if c.checkpointing != "full" else None),
    Lever("activation offload", "activation offload", "PCIe: what the blocks save goes to the host in forward and "
          "comes back in backward (Lab 09: hidden behind compute when the link keeps pace)", TRAIN,
          ("forward", "backward"), lambda c: {"offload_activations": True} if _offloadable(c) else None),
    Lever("optimizer offload", "offload", "PCIe: every gradient down and every parameter back, each step; AdamW on "
          "the CPU", TRAIN, None, lambda c: {"offload": "optimizer", "optimizer": "adamw" if c.optimizer in (
              "sgd", "adamw8bit") else c.optimizer} if c.offload == "none" and _free(c) and c.method == "full" else None),
    Lever("parameter offload", "offload", "PCIe: every parameter up in forward and again in backward", INFER, None,
          lambda c: {"offload": "params", "zero_stage": 3} if c.offload != "params" and c.dp > 1 and _free(c) else None),
    Lever("mixed precision", "precision", "numerics: bf16 matmuls under autocast (faster on tensor cores), fp32 "
          "weights", INFER, None, lambda c: {"precision": "mixed"} if c.precision == "fp32" else None, exact=False),
    Lever("bf16 weights and state", "precision", "numerics: bf16 weights and moments lose small updates "
          "(stochastic rounding or Kahan summation make up for it)", INFER, None,
          lambda c: {"precision": "bf16"} if c.precision != "bf16" else None, exact=False),
)
# --8<-- [end:levers]


def _traceable(config, changes: dict) -> bool:
    """The configuration a lever makes is one Lab 13 traces (``--compile`` refuses activation offload, for one)."""
    try:
        replace(config, **changes)
    except UsageError:
        return False
    return True


def search(base, trace: Callable, every: bool = False) -> list[dict]:
    """The levers for ``base`` (a traced step), cheapest first, as rows.

    When ``base`` does not fit, the ladder (:func:`climb`) pulls them one after another until it fits;
    a row then says what its lever saved on the ladder (``together``) and, where that costs no extra
    trace, what it saves alone (``alone``: the first rung is the lever alone; a lever that cannot
    touch the peak's phase saves 0, derived). ``every``: every lever, each also traced alone."""
    traces = {_key(base.config): base}

    def traced(changes: dict, known_only: bool = False):
        config = replace(base.config, levers="none", **changes)
        if _key(config) not in traces:
            if known_only:
                return None
            traces[_key(config)] = trace(config)
        same = traces[_key(config)]  # the same step; only what is derived from it may differ (0 s: not traced again)
        return same if same.config == config else type(same)(config, same.timeline, 0.0, same.ledger, same.keep)

    applicable = [(lv, ch) for lv in LEVERS if base.config.task in lv.tasks and (ch := lv.pull(base.config))
                  and _traceable(base.config, ch)]
    ladder = {} if base.fits else climb(base, applicable, traced)
    rows = []
    for lever, changes in applicable:
        if not every and lever.name not in ladder:
            continue
        alone, how = _pulled(lever, changes, base, lambda ch: traced(ch, known_only=not every))
        rows.append({"name": lever.name, "kind": lever.kind, "numerics": lever.numerics,
                     "cost": lever.cost_for(base.config.task), "changes": changes,
                     "flags": _flags(replace(base.config, **changes)),
                     "alone": None if alone is None else {**_bytes(base, alone), "how": how},
                     "together": ladder.get(lever.name)})
    return rows


def climb(base, applicable: list, traced: Callable) -> dict[str, dict]:
    """The ladder: pull the levers one after another, cheapest first, keeping each that saves bytes
    (one of a kind: full checkpointing replaces save-matmuls), until the step fits; a lever that
    ``repeats`` is pulled again while it applies and saves. Per lever: what it saved on top of those
    kept before it (every pull of it together), the times it was pulled, and the peak with every lever
    kept so far. ``fit_table.ladder`` and the page's ``climb`` (docs/assets/fit.js) do the same on the
    formulas."""
    out, kept, current = {}, {}, base
    for lever, _ in applicable:
        while not current.fits and (changes := lever.pull(current.config)):
            trial = {k: v for name, ch in kept.items() if LEVER[name].kind != lever.kind for k, v in ch.items()} | changes
            after, how = _pulled(lever, trial, current, traced)
            saved = current.per_rank_peak_bytes - after.per_rank_peak_bytes
            again = lever.name in out
            if saved > 0:
                for name in kept:
                    if LEVER[name].kind == lever.kind and name != lever.name:
                        out[name]["replaced_by"] = lever.name
                kept = {name: ch for name, ch in kept.items() if LEVER[name].kind != lever.kind} | {lever.name: changes}
                current = after
            if not again or saved > 0:  # a pull again that saves nothing leaves the lever as it was
                before = out[lever.name]["saves_bytes"] if again else 0
                out[lever.name] = {"kept": saved > 0 or again, "saves_bytes": before + max(saved, 0) if again else saved,
                                   "pulls": out[lever.name]["pulls"] + 1 if again else 1,
                                   "per_rank_peak_bytes": current.per_rank_peak_bytes, "fits": current.fits,
                                   "how": how, "flags": _flags(current.config)}
            if not (lever.repeats and saved > 0):
                break
        if current.fits:
            break
    return out


def _pulled(lever: Lever, changes: dict, current, traced: Callable):
    """The step with ``changes`` to the base configuration (a Trace), and how that was known: traced,
    or derived where ``lever`` cannot touch the phase of ``current``'s peak (it leaves that phase
    exactly as it was: the peak stays, it saves 0)."""
    phase = current.derived["peak_phase"]
    if lever.phases is not None and phase not in lever.phases:
        return current, f"derived: the peak is in {phase}, which this lever leaves as it is"
    after = traced(changes)
    if after is None or after.seconds:
        return after, None if after is None else "traced"
    moved = [why for why in after.derived["sources"].values() if why.startswith("derived")]
    return after, "derived from the traced step: " + "; ".join(moved)


def _bytes(base, after) -> dict:
    return {"saves_bytes": base.per_rank_peak_bytes - after.per_rank_peak_bytes,
            "per_rank_peak_bytes": after.per_rank_peak_bytes, "fits": after.fits}


def _flags(config) -> list[str]:
    """The command line of ``config`` (its ``--levers`` left at the default)."""
    return cli.argv(replace(config, levers="needed"))


def _key(config) -> tuple:
    """What decides the traced step: the flags, but for a derived offload (the optimizer state of a
    ZeRO stage moved to the host is derived from the step without it)."""
    derived_offload = config.offload == "optimizer" and config.zero_stage
    return tuple(_flags(replace(config, offload="none") if derived_offload else config))


LEVER = {lever.name: lever for lever in LEVERS}
