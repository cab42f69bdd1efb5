"""The "Will it fit?" page's data, written by the Python that holds its formulas.

    .venv/bin/python scripts/fit_table.py                  # results/fit/calculator.json and table.json
    .venv/bin/python scripts/fit_table.py --count 800      # more checked configurations

``calculator.json`` is what ``docs/fit.md`` loads: the inputs with their bounds (``fit_inputs``),
the zoo's presets, Lab 13's GPU table, the constants the formulas use and the legend of every name in
the formula code the page quotes (the build hook renders it there), the levers in Lab 13's order
of cost, and every traced figure the labs have published for a preset configuration (Lab 13's
steps and prefills; Lab 14's serving budgets and Lab 15's fine-tunes once their results exist), each beside the formula's
bytes and the gap. ``table.json`` is what the browser test loads: ``--count`` configurations, each
with Python's bytes per category, moment, verdict and levers, that the page's JavaScript must
reproduce within 0.1 %, and inputs the page must refuse next to the field that is wrong.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from labkit import cli, files, labs, provenance, zoo
from labkit.config import UsageError, check_fields, choices_of, fields_of, flag, option

ROOT = Path(__file__).resolve().parents[1]
lab01_fit = labs.load(1, "fit_formula")
lab01_inputs = labs.load(1, "fit_inputs")
lab13_gpus = labs.load(13, "fit_gpus")
lab13_levers = labs.load(13, "fit_levers")
lora_targets = labs.load(15, "lora")
Inputs, Lever, CUSTOM = lab01_inputs.Inputs, lab13_levers.Lever, lab01_inputs.CUSTOM

SERVE = ("serve",)
#: Serving levers, cheapest first (a judgement, as Lab 13's LEVERS): numerics, then scheduling, then GPUs. Unlike
#: training's ladder, fp8 keys and values (labelled numerics-changing) come first: serving's exact levers cost the
#: first token's latency (chunked prefill) or twice the GPUs (tensor parallelism).
SERVING_LEVERS = (
    Lever("fp8 KV cache", "kv", "numerics: keys and values as scaled 8-bit floats (Lab 14 measures the error)", SERVE,
          None, lambda c: {"kv_dtype": "fp8"} if c.kv_dtype in ("bf16", "fp32") else None, exact=False),
    Lever("int4 weights", "weights", "numerics: 4-bit weights in groups of 128 (AWQ); their accuracy is the model's "
          "to check", SERVE, None, lambda c: {"weights": "int4-awq"} if c.weights in ("bf16", "fp8", "int8") else None,
          exact=False),
    Lever("chunked prefill", "prefill", "a long prompt takes several steps: its first token comes later", SERVE, None,
          lambda c: {"prefill_chunk": 2048} if c.context > 2048 and not c.prefill_chunk else None),
    Lever("tensor parallelism x2", "tp", "twice the GPUs, an all-reduce per layer", SERVE, None,
          lambda c: {"tp": c.tp * 2} if c.tp < 64 else None, repeats=True),
)
LEVERS = lab13_levers.LEVERS + SERVING_LEVERS

#: The lab that measures each category, for each task, and the lab behind each lever (linked from the page).
TRAIN_LABS = {"parameters": 2, "frozen_weights": 15, "quant_constants": 15, "gradients": 2, "optimizer_state": 2,
              "activations": 4, "temporaries": 13, "communication": 11, "kv_cache": 14, "dequantized": 15}
MEASURED_BY = {"train": TRAIN_LABS, "infer": TRAIN_LABS | {"parameters": 13, "kv_cache": 13},
               "decode": TRAIN_LABS | {"parameters": 13, "kv_cache": 13},
               "serve": TRAIN_LABS | {"parameters": 14, "activations": 14},
               # a LoRA step's adapters, their gradients and state, and 8-bit AdamW's state: Lab 15, to the byte
               "lora": TRAIN_LABS | {"parameters": 15, "gradients": 15, "optimizer_state": 15}}
#: Keyed by lever, not kind: fused AdamW is Lab 02's (foreach against fused), optimizer offload Lab 07's,
#: parameter offload (FSDP2's CPUOffloadPolicy) the sharded-inference page of Lab 11; a smaller micro-batch
#: is Lab 06's accumulation in training, Lab 13's traced prefills in inference.
LEVER_LAB = {"fused AdamW": 2, "mixed precision": 3, "save-matmuls checkpointing": 4, "chunked loss": 13, "optimizer step in backward": 13, "activation offload": 9, "ZeRO-1": 11, "ZeRO-2": 11,
             "half the micro-batch": {"train": 6, "infer": 13}, "ZeRO-3": 11, "full checkpointing": 4, "bf16 weights and state": 3,
             "optimizer offload": 7, "parameter offload": (11, "more/lab-11-sharded-inference"), "fp8 KV cache": 14,
             "int4 weights": 14, "chunked prefill": 14, "tensor parallelism x2": 14,
             "embedding and head as FSDP units": (13, "more/lab-13-runs-people-launch")}
CHECKPOINTING = ("none", "save-matmuls", "save-alternate-matmuls", "full", "every-k", "every-kth-block")
#: Runs people launch whose moment a random draw may miss: each is checked against the page's JavaScript like every
#: row (Llama-3-8B at 8k, a chunked or fused-linear loss, full checkpointing, FSDP2's mixed precision (or bf16) at ZeRO-3 over
#: 16 or 64 ranks, or every-k's segments: a block's recomputed backward, fit_moments.recomputed_block)
NAMED = [{"model": "llama-3-8b", "seq": 8192, "loss": "fused-linear", "checkpointing": "full", "zero_stage": 3, "dp": 16},
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "full", "zero_stage": 3, "dp": 64,
          "fsdp_units": "blocks-embed-head"},
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "every-k", "checkpoint_every": 4,
          "zero_stage": 3, "dp": 64},
         {"model": "llama-3-8b", "seq": 8192, "loss": "fused-linear", "checkpointing": "full", "zero_stage": 3, "dp": 16,
          "precision": "bf16"},
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "full", "zero_stage": 3, "dp": 16,
          "precision": "bf16", "fsdp_units": "blocks-embed-head"},  # the last block prefetched as backward starts
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "full", "zero_stage": 2, "dp": 16},
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "every-k", "checkpoint_every": 4,
          "zero_stage": 2, "dp": 16, "precision": "bf16"},  # ZeRO-2: the last segment's backward (recomputed_last)
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "every-k", "checkpoint_every": 5,
          "zero_stage": 2, "dp": 16, "precision": "bf16", "fsdp_units": "blocks-embed-head"},  # recomputed_second
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "every-k", "checkpoint_every": 3,
          "zero_stage": 3, "dp": 16, "precision": "bf16", "fsdp_units": "blocks-embed-head"},  # the first segment
         {"model": "llama-3-8b", "loss": "chunked", "checkpointing": "every-k", "checkpoint_every": 1, "zero_stage": 3,
          "dp": 8, "precision": "fp32"},  # one block a segment: full checkpointing's moments
         {"model": "llama-3-8b", "layers": 2, "seq": 8192, "loss": "chunked", "checkpointing": "full", "zero_stage": 3,
          "dp": 16, "precision": "bf16"},  # two blocks: the last block's backward (recomputed_last)
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "full", "zero_stage": 3, "dp": 16,
          "float8": "tensorwise-all-gather"},  # float8: the down projection's input cast again in a recomputed backward
         {"model": "mixtral-8x7b", "zero_stage": 3, "dp": 8},  # the second block's backward: its experts' gradients
         {"model": "mixtral-8x7b", "zero_stage": 3, "dp": 8, "fsdp_units": "blocks-embed-head"},
         {"model": "mixtral-8x7b", "zero_stage": 3, "dp": 8, "precision": "bf16"},
         {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "every-kth-block", "checkpoint_every": 2,
          "zero_stage": 3, "dp": 16},  # every-kth-block: the last block recomputed beside what the others keep
         {"model": "llama-3-8b", "seq": 8192, "loss": "fused-linear", "checkpointing": "every-kth-block",
          "checkpoint_every": 4, "precision": "bf16"}]  # the same on one rank (fit_kth.one_rank)
NAMED += [{"model": "llama-3-8b", "seq": 16384, "cp": 4, "tp": 2, "dp": 2, "zero_stage": 3},  # --cp beside --tp, --sp
          {"model": "llama-3-8b", "seq": 32768, "cp": 4, "tp": 8, "sp": True, "zero_stage": 3},  # and HSDP (Lab 13)
          {"model": "llama-3-8b", "seq": 16384, "cp": 2, "tp": 4, "sp": True, "dp": 4, "replicate": 2, "zero_stage": 2,
           "precision": "bf16"}]
NAMED += [{"model": "llama-3-8b", "seq": 8192, "tp": 8, "sp": True, "dp": 8, "zero_stage": 3, "checkpointing": "full"},
          {"model": "llama-3-70b", "seq": 8192, "tp": 8, "dp": 8, "zero_stage": 3, "checkpointing": "full"},  # a TP rank's
          {"model": "llama-3-70b", "seq": 32768, "cp": 4, "tp": 8, "sp": True, "dp": 2, "zero_stage": 3,  # recomputed
           "checkpointing": "full"},  # block (fit_moments.recomputed_mlp), with --sp and --cp; and tests/
          {"model": "llama-3-8b", "layers": 4, "vocab": 32000, "seq": 16384, "cp": 2, "tp": 8, "sp": True, "dp": 2,
           "zero_stage": 3, "checkpointing": "full"},  # test_fit_formula.py's twins, where it holds the peak
          {"model": "llama-3-8b", "layers": 4, "vocab": 32000, "seq": 2048, "tp": 4, "dp": 4, "zero_stage": 3,
           "checkpointing": "full", "precision": "fp32"},
          {"model": "llama-3-8b", "seq": 2048, "tp": 8, "sp": True, "dp": 8, "zero_stage": 3, "checkpointing": "full"},
          {"model": "llama-3-8b", "layers": 4, "seq": 1024, "tp": 4, "dp": 4, "zero_stage": 2, "accumulation": 2}]  # the
# embedding's rows copied out of DTensor's whole gradient under FSDP2 (fit_split.embedding)
NAMED += [{"model": "llama-3-8b", "seq": 8192, "tp": 8, "sp": True, "float8": "tensorwise"},  # torchao's float8 TP
          {"model": "llama-3-8b", "seq": 8192, "tp": 2, "dp": 4, "zero_stage": 3, "precision": "bf16",  # styles
           "float8": "tensorwise"},  # (fit_split.float8_layer), at real size and as tests/test_fit_formula.py's twins
          {"model": "llama-3-70b", "seq": 8192, "tp": 8, "sp": True, "dp": 8, "zero_stage": 3, "float8": "tensorwise"},
          {"model": "llama-3-70b", "seq": 8192, "tp": 8, "dp": 8, "zero_stage": 3, "checkpointing": "full",
           "float8": "tensorwise"},  # a recomputed block's MLP norm backward (fit_split.float8_mlp)
          {"model": "llama-3-8b", "layers": 4, "seq": 4096, "tp": 4, "sp": True, "dp": 4, "zero_stage": 3,
           "float8": "tensorwise"},
          {"model": "llama-3-8b", "layers": 4, "seq": 4096, "tp": 8, "sp": True, "precision": "bf16", "float8": "tensorwise"},
          # float8 at a short sequence: a gate weight's fp32 copy and e4m3 bits in a recomputed backward
          {"model": "llama-3-8b", "seq": 1024, "dp": 8, "zero_stage": 3, "checkpointing": "full", "precision": "bf16",
           "float8": "tensorwise"}]
NAMED += [{"model": "llama-3-8b", "pp": 4, "accumulation": 8, "float8": "tensorwise"},  # float8 on 1F1B's first stage
          {"model": "llama-3-8b", "pp": 4, "accumulation": 8, "float8": "tensorwise", "tp": 4},  # (fit_split.float8_backward)
          {"model": "llama-3-8b", "pp": 4, "accumulation": 8, "float8": "tensorwise", "tp": 4, "sp": True, "precision": "bf16"},
          {"model": "llama-3-8b", "seq": 8192, "pp": 4, "accumulation": 8, "float8": "tensorwise", "tp": 8, "sp": True},
          {"model": "llama-3-70b", "pp": 4, "accumulation": 8, "float8": "tensorwise", "tp": 8, "sp": True, "dp": 2}]
NAMED += [{"model": "llama-3-8b", "seq": 8192, "optimizer": "adamw-fused", "checkpointing": "full"},  # one GPU: the
          {"model": "llama-3-8b", "seq": 32768, "vocab": 32000, "tp": 8, "checkpointing": "full"}]  # first block's, last's
NAMED += [{"model": "llama-3-8b", "seq": 8192, "tp": 8, "checkpointing": "full"},  # --tp: loss_parallel's shifted logits
          {"model": "llama-3-8b", "seq": 8192, "tp": 8, "sp": True, "checkpointing": "save-matmuls"}]  # --sp's T / t input
NAMED += [{"model": "llama-3-8b", "seq": 1024, "dp": 8, "zero_stage": 3, "float8": "tensorwise"},  # a gate weight's cast
          {"model": "llama-3-8b", "seq": 1024, "dp": 8, "zero_stage": 2, "float8": "tensorwise-all-gather"},  # (ZeRO-2)
          {"model": "llama-3-8b", "seq": 1024, "dp": 8, "zero_stage": 3, "float8": "tensorwise-all-gather",
           "checkpointing": "full", "precision": "bf16"},  # the embedding's backward (fit_split.embedding_end)
          {"model": "llama-3-8b", "seq": 1024, "dp": 8, "zero_stage": 3, "checkpointing": "full", "precision": "bf16"},  # (6)
          {"model": "llama-3-8b", "seq": 1024, "tp": 8, "dp": 4, "zero_stage": 3, "float8": "tensorwise"},  # float8 TP
          {"model": "llama-3-8b", "seq": 8192, "pp": 2, "accumulation": 4, "tp": 2, "precision": "bf16"},  # 1F1B
          {"model": "llama-3-8b", "pp": 4, "accumulation": 8, "checkpointing": "full", "dp": 2, "zero_stage": 1},
          {"model": "llama-3-70b", "seq": 8192, "pp": 2, "accumulation": 4, "tp": 8, "precision": "bf16"}]  # MLP norm
NAMED += [{"model": "llama-3-8b", "seq": 8192, "pp": 4, "accumulation": 8, "tp": 8, "checkpointing": "full"},  # 1F1B's
          {"model": "llama-3-8b", "seq": 8192, "pp": 4, "accumulation": 8, "tp": 4, "checkpointing": "full"},  # last
          {"model": "llama-3-8b", "seq": 16384, "pp": 4, "accumulation": 8, "tp": 2, "checkpointing": "full",  # block
           "precision": "bf16"},  # recomputed (fit_split.recomputed_norm, last_block_recomputed)
          {"model": "llama-3-8b", "seq": 8192, "pp": 4, "accumulation": 8, "tp": 8},  # MLP norm, an fp32 stream
          {"model": "llama-3-8b", "pp": 4, "accumulation": 8, "tp": 4, "sp": True, "precision": "bf16"}]  # frames
NAMED += [{"model": "llama-3-8b", "seq": 8192, "method": "qlora", "precision": "bf16", "loss": chunked,  # a 24 GB
           "checkpointing": checkpointing} for chunked in ("chunked", "fused-linear") for checkpointing in ("none", "full")]
NAMED += [{"model": "llama-3-8b", "seq": 8192, "method": "qlora", "precision": "mixed", "loss": "chunked",
           "checkpointing": "full"}]  # fp32 adapters: the recompute's down adapter casts the product to fp32 and back
# card's fine-tune: the loss in chunks, the last block recomputed (fit_lora.lora_recomputed)
# --compile: the partitioner's saved set at real size, at the start of backward (ZeRO-0, 3) and, on four blocks
# in pure bf16 under ZeRO-3, in the second block's compiled backward (fit_compiled.block_backward)
NAMED += [{"model": "llama-3-8b", "seq": 4096, "optimizer": "adamw-fused", "compile": True},
          {"model": "llama-3-8b", "seq": 4096, "dp": 8, "zero_stage": 3, "compile": True},
          {"model": "llama-3-8b", "layers": 4, "seq": 1024, "dp": 8, "zero_stage": 3, "precision": "bf16", "compile": True},
          # checkpointed inside each compiled block: the embedding's backward (one GPU), the second block's from the front
          {"model": "llama-3-8b", "seq": 8192, "optimizer": "adamw-fused", "checkpointing": "full", "compile": True},
          {"model": "llama-3-8b", "layers": 4, "seq": 1024, "dp": 8, "zero_stage": 3, "precision": "bf16",
           "checkpointing": "full", "compile": True},
          # torchtitan's run: a chunked loss, each block checkpointed and compiled, FSDP2 over 16 ranks: the recomputed
          # MLP's backward in the second block from the end (fit_compiled.recomputed_mlp); and a fused-linear loss
          {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "full", "zero_stage": 3, "dp": 16,
           "compile": True},
          {"model": "llama-3-8b", "seq": 8192, "loss": "fused-linear", "checkpointing": "full", "zero_stage": 3,
           "dp": 16, "compile": True},
          {"model": "llama-3-8b", "seq": 16384, "loss": "chunked", "checkpointing": "full", "zero_stage": 2, "dp": 8,
           "compile": True},  # ZeRO-2: every block not yet done gathered; 70B: a second f x h gradient in the MLP's
          {"model": "llama-3-70b", "seq": 4096, "loss": "chunked", "checkpointing": "full", "zero_stage": 3, "dp": 64,
           "compile": True},  # backward (fit_compiled.recomputed_mlp's second point); the embedding and head as units
          {"model": "llama-3-8b", "seq": 8192, "loss": "chunked", "checkpointing": "full", "zero_stage": 3, "dp": 16,
           "fsdp_units": "blocks-embed-head", "compile": True},
          {"model": "llama-3-8b", "layers": 4, "seq": 8192, "vocab": 32000, "loss": "chunked", "checkpointing": "full",
           "zero_stage": 3, "dp": 16, "fsdp_units": "blocks-embed-head", "compile": True}]
SERVE_NON_TORCH = labs.load(14, "serving_budget").NON_TORCH_BYTES  # what vLLM subtracts beside weights and a prefill


@dataclass
class Config:
    """Write the calculator's data and the configurations its JavaScript is checked against."""

    out_dir: Path = option(ROOT / "results" / "fit", "where calculator.json and table.json go", path="folder")
    count: int = option(600, "configurations in table.json", min=500, max=20000)
    seed: int = option(0, "seed of the sampled configurations", min=0, max=2**32 - 1)

    def __post_init__(self) -> None:
        check_fields(self)


# ----------------------------------------------------------------------------- the verdict and the levers
def verdict(x: Inputs, gpu: str) -> dict:
    """Fit or not on ``gpu``: a step against Lab 13's usable bytes (NVML total less the CUDA context,
    less the allocator's headroom); a server's weights, prefill peak and KV blocks against
    ``gpu_memory_utilization`` of the total less Lab 14's non-torch growth (vLLM's budget: the CUDA
    context stays outside it; CUDA graphs are Lab 14's, not the formula's), and the KV pool that is left."""
    g, (moment, cats) = lab13_gpus.GPUS[gpu], lab01_fit.peak(x)
    total = sum(e.value for e in cats.values())
    out = {"moment": moment, "total": total}
    if x.task != "serve":
        return out | {"capacity": g.capacity_bytes, "fits": total <= g.capacity_bytes}
    usable = int(x.gpu_memory_utilization * g.total_bytes) - SERVE_NON_TORCH
    pool = usable - cats["parameters"].value - cats["activations"].value
    S = lab01_fit.symbols(x, lab01_fit.sizes(x))
    per_block = x.block_size * lab01_fit.kv_per_token(S, lab01_fit.KV_DTYPES[x.kv_dtype][1]).value
    tokens = max(pool, 0) // per_block * x.block_size
    return out | {"capacity": usable, "fits": total <= usable, "pool": pool, "pool_tokens": tokens,
                  "pool_requests": tokens // (-(-x.context // x.block_size) * x.block_size)}


def ladder(x: Inputs, gpu: str) -> list[dict]:
    """Lab 13's ladder (``fit_levers.climb``) on the formulas: each lever that applies, cheapest first,
    kept when it lowers the peak (replacing a kept one of its kind), a halving pulled again while it
    applies and saves, until the configuration fits. One row per lever: ``saves_bytes`` over its pulls."""
    base = verdict(x, gpu)
    if base["fits"]:
        return []
    out, kept, current, now = {}, {}, x, base
    for lever in LEVERS:
        if x.task not in lever.tasks:
            continue
        while not now["fits"] and (changes := lever.pull(current)):
            trial = {k: v for name, ch in kept.items() if KIND[name] != lever.kind for k, v in ch.items()} | changes
            try:
                after = replace(x, **trial)
            except UsageError:
                break
            after_v = verdict(after, gpu)
            saved = now["total"] - after_v["total"]
            again = lever.name in out
            if saved > 0:
                kept = {n: ch for n, ch in kept.items() if KIND[n] != lever.kind} | {lever.name: changes}
                current, now = after, after_v
            if not again or saved > 0:  # a pull again that saves nothing leaves the lever as it was
                out[lever.name] = {"name": lever.name, "kept": saved > 0 or again,
                                   "saves_bytes": (out[lever.name]["saves_bytes"] if again else 0) + saved,
                                   "pulls": out[lever.name]["pulls"] + 1 if again else 1,
                                   "total": now["total"], "fits": now["fits"]}
            if not (lever.repeats and saved > 0):
                break
        if now["fits"]:
            break
    return list(out.values())


KIND = {lever.name: lever.kind for lever in LEVERS}


# ----------------------------------------------------------------------------- the command that traces it
PYTHON = ".venv/bin/python"


@functools.cache
def clis() -> dict:
    """The labs' command lines that trace a configuration, as the page builds them: Lab 13's fit.py (a
    step or a prefill) and Lab 14's serve_memory.py --fake (a serving budget, real size on fake tensors).
    Each flag is read from the lab's own Config: [its field, its flag, its default], --model first."""
    def flags(config_cls, names):
        got = {f.name: [f.name, flag(f.name), f.default] for f in fields(config_cls) if f.name in names}
        return [[*got["model"][:2], None]] + [got[n] for n in got if n != "model"]  # --model always said

    lab13, lab14 = labs.load(13).Config, labs.load(14).Config
    train = {f.name for f in fields(lab13)} - {"device", "seed", "levers", "lora_dropout"}  # the calculator has no dropout
    serve = {"model", "gpu", "tp", "gpu_memory_utilization", "weights", "kv_dtype", "seq_len", "prefill_chunk",
             "block_size"}
    return {"fit": {"script": "code/lab-13-will-it-fit/fit.py", "fixed": [], "flags": flags(lab13, train)},
            "serve": {"script": "code/lab-14-serving-memory/serve_memory.py", "fixed": ["--fake"],
                      "flags": flags(lab14, serve), "gpus": _choices(lab14, "gpu")}}


def _choices(config_cls, name: str) -> list:
    return next(list(choices_of(kind)) for f, kind in fields_of(config_cls) if f.name == name)


def command(x: Inputs, gpu: str) -> list:
    """``[the command that traces x on gpu, None]``, or ``[None, why no lab's command can]`` (an input that
    CLI has no flag for). The page (fit.js ``command``) builds the same text from the same ``clis()``."""
    custom = x.model == CUSTOM or any(getattr(x, n) is not None for n in lab01_inputs.DIMS)
    c = clis()["serve" if x.task == "serve" else "fit"]
    script = c["script"].split("/")[-1]
    if custom:
        return [None, f"{script} takes a zoo model or a config.json's path (--model PATH), not dimensions: "
                      "save them as a config.json to trace them"]
    if x.task == "serve":
        if zoo.get(x.model).family == "gpt":
            return [None, f"{script} serves the Llama-family models, not {x.model}"]
        if x.precision == "fp32":
            return [None, f"{script} serves bf16 weights: it has no --precision fp32"]
        if gpu not in c["gpus"]:
            return [None, f"{script} sizes a budget for {', '.join(c['gpus'])}: not {gpu}"]
        if x.context > zoo.get(x.model).context:  # serve_memory.py refuses it, as vLLM refuses a max_model_len past it
            return [None, f"{script} serves at most {x.model}'s context of {zoo.get(x.model).context} tokens"]
        values = {"model": x.model, "gpu": gpu, "tp": x.tp, "gpu_memory_utilization": x.gpu_memory_utilization,
                  "weights": x.weights, "kv_dtype": x.kv_dtype, "block_size": x.block_size,
                  "prefill_chunk": x.prefill_chunk,
                  "seq_len": None if x.context == zoo.get(x.model).context else x.context}
    else:
        if x.tp > 1 and x.task != "train":
            return [None, f"{script} traces tensor parallelism for training: --task {x.task} splits over GPUs in Lab 14"]
        if x.tp > 1 and zoo.get(x.model).family != "llama":
            return [None, f"{script} splits a zoo Llama's modules under --tp, not {x.model}'s"]
        if x.task != "decode":  # a decode step's sizes, which fit.py takes with --task decode only
            x = replace(x, kv_len=None, new_tokens=1)
        if x.task in ("infer", "decode"):  # what a prefill or decode does not use: left out (fit.py refuses it)
            x = replace(x, accumulation=1, optimizer="adamw", checkpointing="none", checkpoint_every=None, loss="full", method="full",
                        optimizer_in_backward=False, offload_activations=False, float8="none",
                        zero_stage=0 if x.zero_stage in (1, 2) else x.zero_stage,
                        offload="none" if x.offload == "optimizer" else x.offload)
            try:
                x.check_sharding()
            except UsageError as err:
                return [None, f"{script}: {err}"]
        values = asdict(x) | {"gpu": gpu}
    args = [PYTHON, c["script"]]
    for name, flag_, default in c["flags"]:
        if values[name] is not None and values[name] != default:
            args += [flag_] if values[name] is True else [flag_, _text(values[name])]  # a switch: its flag alone
        if name == "model":
            args += c["fixed"]
    return [" ".join(args), None]


def _text(value) -> str:
    """A flag's value as the page writes it (JavaScript's String: 1.0 is "1")."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# ----------------------------------------------------------------------------- what the labs traced
def lab13_traced() -> list[dict]:
    """Lab 13's published traces of preset configurations: its two summaries and its zoo table (whose
    rows' configurations are the ``CONFIGS`` of its notebook source and the ``seq`` of the call that
    traces them, read as literals: the summary publishes the table, not its configurations)."""
    data = json.loads((ROOT / "results" / labs.slug(13) / "summary.json").read_text())
    source = ast.parse((ROOT / "notebooks" / "src" / f"{labs.slug(13)}.py").read_text())
    configs = next(ast.literal_eval(_dict_calls(n.value)) for n in ast.walk(source)
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CONFIGS")
    rows_call = next(n for n in ast.walk(source) if isinstance(n, ast.Call) and any(  # Config(..., **CONFIGS[label])
        k.arg is None and ast.unparse(k.value).startswith("CONFIGS[") for k in n.keywords))
    seq = next(k.value.value for k in rows_call.keywords if k.arg == "seq")
    out = []
    for key in ("summary", "llama70b"):
        s = data["numbers"][key]
        out.append({"inputs": _train_fields(s["config"]), "bytes": s["per_rank_peak_bytes"], "phase": s["peak_phase"],
                    "by_category": s["by_category"], "compared": None, "free": [],
                    "reserved": (s.get("reserved") or {}).get("reserved_bytes"),  # Lab 16's simulation, when published
                    "source": f"results/{labs.slug(13)}/summary.json: numbers.{key}"})
    columns = [c[0] for c in data["tables"]["zoo"]["columns"]]
    for row in data["tables"]["zoo"]["rows"]:
        fields_ = {"model": row[0], "seq": seq} | configs[row[1]]
        r = dict(zip(columns, row))
        out.append({"inputs": _train_fields(fields_), "bytes": row[2], "phase": row[3], "by_category": None,
                    "compared": None, "free": [], "reserved": r.get("reserved (simulated)"),
                    "source": f"results/{labs.slug(13)}/summary.json: table zoo, {row[0]}, {row[1]}"})
    return out


def lab14_traced() -> list[dict]:
    """Lab 14's traced serving budgets (weights and prefill peak), once its results exist."""
    path = ROOT / "results" / "lab-14-serving-memory" / "summary.json"
    if not path.is_file():
        return []
    table = json.loads(path.read_text())["tables"]["real_scale"]
    cols = [c[0] for c in table["columns"]]
    out = []
    for row in table["rows"]:
        r = dict(zip(cols, row))
        if r["model"] not in lab01_inputs.presets():  # latent attention (MLA): Lab 14 traces it, no formula does
            continue
        x = Inputs(model=r["model"], task="serve", tp=r["TP"], kv_dtype=r["KV dtype"], context=r["context"],
                   prefill_chunk=r["prefill chunk"], weights=r["weights"])  # each row's prefill, whole or chunked
        out.append({"inputs": _fields(x), "bytes": r["weights / GPU"] + r["prefill peak"], "phase": "prefill",
                    "by_category": {"parameters": r["weights / GPU"], "activations": r["prefill peak"]},
                    "compared": ["parameters", "activations"],  # the KV pool is the budget's remainder
                    "free": ["requests", "block_size", "gpu_memory_utilization"],  # they change the KV, not these
                    "source": f"{path.relative_to(ROOT)}: table real_scale"})
    return out


def lab15_traced() -> list[dict]:
    """Lab 15's fine-tunes traced at real size (LoRA, QLoRA, the 8-bit AdamW), once its results exist."""
    path = ROOT / "results" / labs.slug(15) / "summary.json"
    if not path.is_file():
        return []
    return [{"inputs": _train_fields(r["inputs"]), "bytes": r["per_rank_peak_bytes"], "phase": r["peak_phase"],
             "by_category": r["by_category"], "compared": None, "free": [],
             "source": f"{path.relative_to(ROOT)}: numbers.real_scale[name={r['name']}]"}
            for r in json.loads(path.read_text())["numbers"]["real_scale"]]


def _dict_calls(node):
    """``dict(a=1)`` in a literal, as ``{"a": 1}`` (so ``ast.literal_eval`` reads it)."""
    class Calls(ast.NodeTransformer):
        def visit_Call(self, call):
            self.generic_visit(call)
            return ast.Dict([ast.Constant(k.arg) for k in call.keywords], [k.value for k in call.keywords])
    return Calls().visit(node)


def _train_fields(config: dict) -> dict:
    keep = {f.name for f in fields(Inputs)}
    return _fields(Inputs(**{k: v for k, v in config.items() if k in keep}))


def _fields(x: Inputs) -> dict:
    """The inputs that differ from the defaults: what the page's address carries."""
    default = Inputs()
    return {k: v for k, v in asdict(x).items() if v != getattr(default, k)}


# ----------------------------------------------------------------------------- the configurations checked
DIM_CHOICES = {"heads": (8, 12, 16, 24, 32, 40, 64), "head_dim": (64, 80, 128), "vocab": (32000, 50257, 128256, 151936)}


def sample(rng: random.Random) -> tuple[Inputs, str]:
    """One valid configuration and a GPU, drawn across every input the page has."""
    while True:
        f: dict = {"model": rng.choice([*lab01_inputs.presets(), "custom", "custom"])}
        if f["model"] == "custom":
            heads, head_dim = rng.choice(DIM_CHOICES["heads"]), rng.choice(DIM_CHOICES["head_dim"])
            f |= {"layers": rng.randint(1, 96), "heads": heads, "hidden": heads * head_dim,
                  "kv_heads": rng.choice([d for d in (1, 2, 4, 8, heads) if heads % d == 0]),
                  "ffn": 256 * rng.randint(4, 120), "vocab": rng.choice(DIM_CHOICES["vocab"]), "tied": rng.random() < 0.3}
            if rng.random() < 0.2:
                f |= {"experts": rng.choice((4, 8, 16)), "top_k": rng.choice((1, 2))}
            if rng.random() < 0.1:
                f["head_dim"] = rng.choice(DIM_CHOICES["head_dim"])
        task = f["task"] = rng.choices(("train", "infer", "decode", "serve"), (6, 1.5, 1, 2.5))[0]
        f["precision"] = rng.choice(("fp32", "bf16", "mixed"))
        f["tp"] = rng.choice((1, 1, 2, 4, 8))
        if task == "serve":
            f |= {"context": rng.choice((512, 2048, 4096, 8192, 32768, 131072)), "requests": rng.choice((1, 8, 32, 64, 256)),
                  "kv_dtype": rng.choice(("bf16", "fp8", "int8", "fp32")), "block_size": rng.choice((1, 8, 16, 32, 128)),
                  "gpu_memory_utilization": rng.choice((0.5, 0.8, 0.9, 0.95, 1.0)),
                  "prefill_chunk": rng.choice((None, None, 512, 2048))}
        else:
            f |= {"batch": rng.choice((1, 1, 2, 4, 8)), "seq": rng.choice((256, 1024, 2048, 4096, 8192))}
            f["dp"] = rng.choice((1, 1, 2, 8, 64))
            if task == "decode":
                f |= {"dp": 1, "precision": rng.choice(("bf16", "fp32")), "batch": rng.choice((1, 8, 32, 128)),
                      "kv_len": rng.choice((None, 2048, 8192, 131072)), "new_tokens": rng.choice((1, 1, 4))}
            f["zero_stage"] = rng.choice((0, 1, 2, 3)) if f["dp"] > 1 else 0
        if task == "train":
            f |= {"accumulation": rng.choice((1, 1, 2, 4)), "checkpointing": rng.choice(CHECKPOINTING),
                  "loss": rng.choice(("full", "full", "chunked", "fused-linear")),
                  "optimizer": rng.choice(("adamw", "adamw-foreach", "adamw-fused", "adamw8bit", "sgd")),
                  "method": rng.choice(("full", "full", "lora", "qlora"))}
            f["checkpoint_every"] = rng.choice((2, 4)) if f["checkpointing"].startswith("every") else None
            f |= {"optimizer_in_backward": rng.random() < 0.2, "offload_activations": rng.random() < 0.2}
            f["offload"] = rng.choice(("none", "none", "optimizer", "params"))
            f["float8"] = rng.choice(("none", "none", "none", "tensorwise", "tensorwise-all-gather"))
            f["sp"] = f["tp"] > 1 and rng.random() < 0.5
            f["pp"] = rng.choice((1, 1, 1, 2, 4))
            if f["zero_stage"] >= 2 and f["dp"] > 2:
                f["replicate"] = rng.choice((1, 2))
            if f["zero_stage"] >= 2:  # the embedding and the head as FSDP2 units of their own, or left to the root
                f["fsdp_units"] = rng.choice(("blocks", "blocks-embed-head"))
            if f["pp"] > 1:
                f["accumulation"] = f["pp"] * rng.choice((2, 4))
            if f["zero_stage"] >= 2 and rng.random() < 0.3:  # context parallelism (Lab 13's fit_context.py), with
                f |= {"cp": rng.choice((2, 4)), "pp": 1, "float8": "none",  # what it is traced with (also beside
                      "offload": "none", "offload_activations": False, "optimizer_in_backward": False,  # --tp: no
                      "checkpointing": rng.choice(("none", "full")),  # checkpointing or full)
                      "checkpoint_every": None, "method": "full"}
            if f["method"] != "full":  # a rank and targets only where adapters read them (the page's address too),
                f |= {"lora_rank": rng.choice((8, 16, 64)), "offload": "none",  # on one GPU,
                      "lora_targets": rng.choice((lora_targets.ALL, ("q", "v"), ("q", "k", "v", "o"),
                                                  ("gate", "up", "down"))), "dp": 1, "zero_stage": 0, "tp": 1,
                      "sp": False, "pp": 1, "replicate": 1, "float8": "none", "cp": 1}  # eager, unsplit (Lab 15's traces)
            if rng.random() < 0.15:  # each block torch.compile'd (fit_compiled.py), beside what its formula counts
                f |= {"compile": True, "checkpointing": rng.choice(CHECKPOINTING[:4]), "checkpoint_every": None,
                      "float8": "none",
                      "tp": 1, "sp": False, "pp": 1, "cp": 1, "optimizer_in_backward": False, "offload_activations": False}
        try:
            return Inputs(**f), rng.choice(list(lab13_gpus.GPUS))
        except UsageError:
            continue


#: Input the page must refuse next to the field named, with Python's message beside it.
BAD = [
    ({"layers": "-4"}, "layers"), ({"heads": "32.5"}, "heads"), ({"kv_heads": "5"}, "kv_heads"),
    ({"kv_heads": "0"}, "kv_heads"), ({"seq": "-1"}, "seq"), ({"batch": "1e3"}, "batch"), ({"dp": "two"}, "dp"),
    ({"heads": "7"}, "heads"), ({"tp": "3"}, "tp"), ({"sp": "true"}, "sp"), ({"pp": "4"}, "pp"), ({"replicate": "2"}, "replicate"), ({"zero_stage": "2"}, "zero_stage"),
    ({"task": "serve", "gpu_memory_utilization": "1.5"}, "gpu_memory_utilization"),
    ({"task": "serve", "block_size": "0"}, "block_size"), ({"model": "custom", "layers": "4"}, "hidden"),
    ({"model": "mixtral-8x7b", "top_k": "9"}, "top_k"), ({"lora_rank": "-8"}, "lora_rank"), ({"lora_rank": "0"}, "lora_rank"),
    ({"method": "lora", "model": "llama-3.2-1b", "lora_rank": "1024"}, "lora_rank"),
    ({"method": "lora", "lora_targets": "q,x"}, "lora_targets"), ({"method": "qlora", "precision": "fp32"}, "method"),
    ({"method": "lora", "model": "gpt-3-175b"}, "method"), ({"method": "lora", "dp": "8"}, "method"),
    ({"optimizer": "adamw8bit", "dp": "8", "zero_stage": "1"}, "optimizer"),
    ({"method": "lora", "tp": "2"}, "method"), ({"method": "qlora", "float8": "tensorwise"}, "method"),
    ({"method": "lora", "pp": "2", "accumulation": "4"}, "method"),  # Lab 15's step is not traced with them
    ({"compile": "true", "pp": "2", "accumulation": "4"}, "compile"),  # Lab 13 traces it; the formula has none
    # a field the task does not show: the page shows it while it is wrong, and the task's result
    ({"task": "serve", "seq": "-1"}, "seq"), ({"task": "serve", "dp": "two"}, "dp"),
    ({"task": "infer", "lora_rank": "-8"}, "lora_rank"), ({"task": "train", "context": "0"}, "context"),
    ({"task": "serve", "gpu_memory_utilization": "0.001"}, "gpu_memory_utilization"),
    # a choice no control offers: marked beside the control, computed with its default
    ({"precision": "fp16"}, "precision"), ({"model": "llama-9b"}, "model"), ({"gpu": "h100"}, "gpu"),
    ({"task": "serve", "zero_stage": "7"}, "zero_stage"), ({"task": "serve", "offload": "disk"}, "offload"),
    ({"float8": "tensorwise", "precision": "fp32"}, "float8"),
    ({"checkpointing": "every-kth-block"}, "checkpoint_every"), ({"checkpointing": "every-kth-block",
                                                                "checkpoint_every": "2", "offload_activations": "true"}, "checkpointing"),
    ({"cp": "2"}, "cp"), ({"cp": "4", "seq": "4092", "dp": "2", "zero_stage": "3"}, "cp"),  # --cp: Lab 13's ring
    ({"cp": "2", "task": "infer"}, "cp"),
    ({"compile": "true", "task": "infer"}, "compile"), ({"compile": "true", "model": "mixtral-8x7b"}, "compile"),
    ({"compile": "true", "tp": "2"}, "compile"), ({"compile": "true", "float8": "tensorwise"}, "compile"),  # Lab 13's;
    ({"compile": "true", "method": "lora"}, "compile"),  # Lab 13 traces LoRA compiled; the formula has none
    ({"float8": "tensorwise-all-gather"}, "float8"), ({"fsdp_units": "blocks-embed-head"}, "fsdp_units"), ({"fsdp_units": "blocks-embed-head", "dp": "8", "zero_stage": "3",
                                                          "model": "llama-3.2-1b"}, "fsdp_units"),
]
BAD_CONFIG_JSON = ['{"hidden_size": 4096, "num_attention_heads": 32', '[1, 2, 3]',
                   '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3, '
                   '"intermediate_size": 128, "vocab_size": 256}',
                   '{"num_hidden_layers": 2, "num_attention_heads": 4}']


def bad_cases() -> list[dict]:
    """Each refused input with Python's message (the field is the one the page marks)."""
    out = []
    for given, field in BAD:
        try:
            if given.get("gpu", "h100-80gb") not in lab13_gpus.GPUS:
                raise UsageError(f"--gpu must be one of {', '.join(lab13_gpus.GPUS)}, got {given['gpu']!r}")
            Inputs(**{k: _parse(k, v) for k, v in given.items() if k != "gpu"})
        except (UsageError, ValueError) as err:
            out.append({"query": given, "field": field, "python": str(err)})
            continue
        raise AssertionError(f"{given} was accepted")
    for text in BAD_CONFIG_JSON:
        try:
            lab01_inputs.from_config_json(json.loads(text))
        except (UsageError, ValueError) as err:
            out.append({"config_json": text, "field": "config_json", "python": str(err)})
            continue
        raise AssertionError(f"{text} was accepted")
    return out


def _parse(name: str, text: str):
    """A field's text as the page's address carries it, read as the field's type (the Inputs judge it)."""
    field = next(f for f in lab01_inputs.fields() if f["name"] == name)
    kind = type(field["choices"][0]).__name__ if field["choices"] else field["type"]
    try:
        if kind == "list":
            return tuple(part.strip() for part in text.split(",") if part.strip())
        if kind == "int":
            return int(text) if text.lstrip("-").isdigit() else float(text)
        return float(text) if kind == "float" else text
    except ValueError:
        raise UsageError(f"{field['flag']} must be a number, got {text!r}") from None


def row(x: Inputs, gpu: str, with_formulas: bool) -> dict:
    moment, cats = lab01_fit.peak(x)
    out = {"query": _fields(x), "gpu": gpu, "bytes": {k: e.value for k, e in cats.items()},
           "verdict": verdict(x, gpu), "levers": [[r["name"], r["kept"], r["total"], r["pulls"]] for r in ladder(x, gpu)],
           "command": command(x, gpu)}
    if with_formulas:
        out["formulas"] = {k: [e.text, e.filled] for k, e in cats.items()}
    return out


# ----------------------------------------------------------------------------- the files
def calculator(traced: list[dict]) -> dict:
    from memory_accounting import MOMENTS, RECIPES, STEP_COUNTER, ZERO_SHARDS

    f = lab01_fit
    presets = {}
    for name in lab01_inputs.presets():
        spec = zoo.get(name)
        presets[name] = lab01_inputs.preset_dims(spec) | {"family": spec.family, "context": spec.context,
                                                          "source": spec.source, "params": spec.param_count()}
    for t in traced:
        x = Inputs(**t["inputs"])
        moment, cats = f.peak(x)
        formula = sum(cats[k].value for k in (t["compared"] or cats))
        t |= {"formula": formula, "moment": moment, "gap": (formula - t["bytes"]) / t["bytes"]}
    return {
        "inputs": lab01_inputs.fields(), "presets": presets, "hf_keys": lab01_inputs.HF_KEYS,
        "gpus": {n: {"stated": g.stated, "datasheet": g.datasheet, "total_bytes": g.total_bytes,
                     "capacity_bytes": g.capacity_bytes} for n, g in lab13_gpus.GPUS.items()},
        "cuda_context_bytes": lab13_gpus.CUDA_CONTEXT_BYTES, "allocator_headroom": lab13_gpus.ALLOCATOR_HEADROOM,
        "serve_non_torch_bytes": SERVE_NON_TORCH,
        "constants": {"recipes": {k: asdict(r) for k, r in RECIPES.items()}, "moments": MOMENTS,
                      "step_counter": STEP_COUNTER, "zero_shards": ZERO_SHARDS, "precisions": f.PRECISIONS,
                      "optimizers": f.OPTIMIZERS, "kv_dtypes": f.KV_DTYPES, "row": f.ROW, "lse": f.LSE,
                      "slot": f.SLOT, "scale": f.SCALE, "indices": f.INDICES, "loss_chunks": f.LOSS_CHUNKS, "frozen": f.FROZEN,
                      "nf4_blocks": f.NF4_BLOCKS, "opt8": f.OPT8, "max_ranks": lab01_inputs.MAX_RANKS},
        "categories": f.CATEGORIES, "symbols": f.SYMBOLS, "legend": legend(), "lora_targets": list(lora_targets.ALL),
        "levers": [{"name": lv.name, "kind": lv.kind, "tasks": list(lv.tasks), "repeats": lv.repeats,
                    "numerics": lv.numerics,
                    "cost": {task: lv.cost_for(task) for task in lv.tasks},
                    "lab": {task: _lab_link(_per_task(LEVER_LAB[lv.name], task)) for task in lv.tasks}}
                   for lv in LEVERS],
        "measured_by": {task: {k: _lab_link(n) for k, n in labs_.items()} for task, labs_ in MEASURED_BY.items()},
        "python": PYTHON, "clis": clis(),
        "traced": traced,
    }


SNIPPET = "# --8<-- [start:"


def formula_code() -> dict[str, str]:
    """The sections of fit_formula.py, fit_moments.py, fit_serve.py, fit_lora.py and fit_compiled.py a page may quote
    (between snippet markers), by name."""
    text = "".join((ROOT / "code" / "lab-01-memory-accounting" / name).read_text(encoding="utf-8")
                   for name in ("fit_formula.py", "fit_moments.py", "fit_serve.py", "fit_lora.py", "fit_compiled.py"))
    return {part.split("]", 1)[0]: part.split("\n", 1)[1].split("# --8<-- [end:", 1)[0]
            for part in text.split(SNIPPET)[1:]}


def names_used(code: str) -> list[str]:
    """The names a piece of formula code reads that its functions do not define: ``S.c`` and ``x.seq``
    (a symbol, an input), module constants and helpers (``ROW``, ``ceil_div``); not the functions it
    defines, their arguments and locals, or Python's builtins. The page's legend must say what each is."""
    import builtins

    tree, defined = ast.parse(code), set(dir(builtins))
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))):
        defined |= {function.name} if isinstance(function, ast.FunctionDef) else set()
        defined |= {a.arg for a in function.args.args + function.args.kwonlyargs}
        defined |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - defined
    used |= {f"{n.value.id}.{n.attr}" for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("S", "x")}
    return sorted(used)


def _said(value) -> str:
    """A constant's value in the legend: ``4``; ``adamw 2, momentum 1``; ``fp8 (1, 4)``; ``sgd momentum``."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_said(v)}" for k, v in value.items())
    if isinstance(value, tuple):
        return "(" + ", ".join(map(str, value)) + ")"
    return str(value) if isinstance(value, (int, str)) else ""  # a function or a class: no value


def legend() -> list[dict]:
    """Every name the page's formula code uses, with what it is (the inputs' help for ``x.NAME``,
    ``SYMBOLS`` for ``S.NAME``, ``LEGEND`` for the rest) and a constant's value: the page's legend,
    in that order. A name none of them explains stops the script."""
    f, helps = lab01_fit, {field["name"]: f"{field['flag']}: {field['help']}" for field in lab01_inputs.fields()}
    used = set(names_used("\n".join(formula_code().values()))) | {"S", "x"}

    def means(name: str) -> str:
        kind, _, attr = name.partition(".")
        text = f.LEGEND.get(name) or (f.SYMBOLS.get(attr) if kind == "S" else helps.get(attr) if kind == "x" else None)
        if not text:
            raise SystemExit(f"fit_formula.py's code uses {name}, which neither SYMBOLS, the inputs nor LEGEND explain")
        return text

    order = [n for n in ("S", "x") if n in used] + [f"S.{k}" for k in f.SYMBOLS if f"S.{k}" in used]
    order += sorted(n for n in used if n.startswith("x."))
    order += [n for n in f.LEGEND if n in used and n not in order]
    order += sorted(used - set(order))  # a name no list orders: means() says what is missing
    return [{"name": n, "means": means(n), "value": _said(getattr(f, n, None))} for n in order]


def _per_task(value, task: str):
    return value[task] if isinstance(value, dict) else value


def _lab_link(n: int | tuple[int, str]) -> dict | None:
    """The lab page that measures it, when that page is in the site (a lab's number, or its number and
    a page under docs/labs/, for a lab's extra page)."""
    n, stem = n if isinstance(n, tuple) else (n, None)
    page = ROOT / "docs" / "labs" / f"{stem}.md" if stem else next((ROOT / "docs" / "labs").glob(f"lab-{n:02d}-*.md"), None)
    return {"lab": n, "page": f"labs/{stem or page.stem}/"} if page and page.is_file() else None


def run(config: Config) -> dict:
    t0 = time.perf_counter()
    for name in ("calculator.json", "table.json"):
        files.check_writable(config.out_dir / name, "--out-dir")
    rng = random.Random(config.seed)
    traced = lab13_traced() + lab14_traced() + lab15_traced()
    core = [(Inputs(**t["inputs"]), "h100-80gb") for t in traced]
    core += [(Inputs(model=m, task=task), "h100-80gb") for m in lab01_inputs.presets() for task in ("train", "serve")
             if not (task == "serve" and zoo.get(m).family == "gpt")]
    core += [(Inputs(**f), "h100-80gb") for f in NAMED]
    picked = core + [sample(rng) for _ in range(config.count - len(core))]
    rows = [row(x, gpu, with_formulas=i % 8 == 0) for i, (x, gpu) in enumerate(cli.progress(picked, desc="rows"))]
    record = provenance.collect(1, "cpu", time.perf_counter() - t0)
    calc = calculator(traced)
    provenance.write_results(config.out_dir / "calculator.json", calc, record)
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)
    files.write_text(config.out_dir / "table.json", '{"provenance": ' + json.dumps(record) + ',\n"bad": '
                     + json.dumps(bad_cases()) + ',\n"configurations": [\n' + body + "\n]}\n")
    return {"rows": len(rows), "traced": calc["traced"], "out_dir": str(config.out_dir)}


def report(result: dict) -> None:
    print(f"{result['rows']} configurations -> {result['out_dir']}/table.json; calculator.json beside it")
    for t in result["traced"]:
        print(f"  traced {t['bytes']:>17,} formula {t['formula']:>17,} gap {100 * t['gap']:+6.2f} %  {t['source']}")


if __name__ == "__main__":
    cli.main(Config, run, report)
