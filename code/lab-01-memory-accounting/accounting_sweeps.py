"""Lab 01's formulas swept: recipes, ZeRO stages, sequence lengths and KV caches for a 7B model
(derived), and the toy GPT's measured activations across sequence lengths.

The notebook calls these and publishes their tables; the tests check what they must give (112 GB
of model state, 14 GB per rank under ZeRO-3 on 8 ranks, a KV cache four times smaller with 8 KV
heads, measured activations equal to TinyGPT's list). Sizes at 7B scale are in GB (1e9 bytes), the
unit of the "112 GB" rule.
"""

from __future__ import annotations

from labkit.table import Table
from memory_accounting import (MOMENTS, RECIPES, Result, estimate_bytes, kv_cache_bytes, model_state_bytes,
                               zero_model_state)
from toy_gpt import Shape, param_count

GB = 10**9
P_7B = 7_000_000_000
SHAPE_7B = {"layers": 32, "hidden": 4096, "heads": 32, "batch": 1, "vocab": 50304}  # with a seq of your choice
SEQS_7B = (512, 1024, 2048, 4096, 8192, 16384, 32768)
POLICIES = ("none", "selective", "full")
STATE = ("parameters", "gradients", "master_weights", "optimizer_state")


# ---------------------------------------------------------------------- a 7B model, derived
def recipes_table(params: int = P_7B) -> Table:
    """Bytes per parameter of every recipe and optimizer, and the model state of ``params``."""
    rows = []
    for precision in RECIPES:
        for optimizer in MOMENTS:
            one = model_state_bytes(1, precision, optimizer)
            rows.append([precision, optimizer, *(one[c] for c in STATE), sum(one.values()),
                         sum(model_state_bytes(params, precision, optimizer).values()) / GB])
    return Table(["precision", "optimizer", ("weights", "int"), ("grads", "int"), ("master", "int"),
                  ("state", "int"), ("B/param", "int"), (f"{params / 1e9:g}B model (GB)", "float:0")],
                 rows, strong=("B/param",))


def zero_stages(params: int = P_7B, precision: str = "mixed", optimizer: str = "adamw",
                dp: int = 8) -> dict[int, dict[str, int]]:
    """Model state per rank for ZeRO stages 0 to 3 (arguments as for zero_model_state)."""
    return {stage: zero_model_state(params, precision, optimizer, stage, dp) for stage in range(4)}


def model_state_per_rank(stages: dict[int, dict[str, int]]) -> dict[int, int]:
    """The model-state bytes per rank of each stage of :func:`zero_stages`."""
    return {stage: sum(per_rank.values()) for stage, per_rank in stages.items()}


def zero_stage_table(stages: dict[int, dict[str, int]]) -> Table:
    """One row per stage: what it adds to the shards, each category per rank, the sum (GB)."""
    added = {0: "nothing", 1: "state, master", 2: "gradients", 3: "weights"}
    totals = model_state_per_rank(stages)
    return Table([("stage", "int"), "also sharded",
                  *((f"{c} (GB)", "float:2") for c in ("weights", "grads", "master", "state")),
                  ("per rank (GB)", "float:2")],
                 [[s, added[s], *(b[c] / GB for c in STATE), totals[s] / GB] for s, b in stages.items()],
                 strong=("per rank (GB)",))


def activations_by_sequence(seqs=SEQS_7B, precision: str = "mixed", shape: dict | None = None) -> dict[str, list[int]]:
    """Activation bytes of a whole model against sequence length, per recompute policy.

    seqs: sequence lengths; precision: a recipe (its element size); shape: the Shape fields but
    seq (default: the 7B-class SHAPE_7B)."""
    shape = shape or SHAPE_7B
    return {policy: [estimate_bytes(shape=Shape(seq=s, **shape), precision=precision, recompute=policy)["activations"]
                     for s in seqs] for policy in POLICIES}


def activations_table(seqs, by_policy: dict[str, list[int]]) -> Table:
    return Table([("sequence", "int"), ("none: keep all (GB)", "float:2"), ("selective: recompute scores (GB)", "float:2"),
                  ("full: recompute all (GB)", "float:2")],
                 [[s, *(by_policy[p][i] / GB for p in POLICIES)] for i, s in enumerate(seqs)])


def model_state_of(shape: dict | None = None, seq: int = 2048, precision: str = "mixed",
                   optimizer: str = "adamw") -> int:
    """Model-state bytes of a shape (default SHAPE_7B at ``seq`` tokens), to set activations against."""
    return sum(model_state_bytes(param_count(Shape(seq=seq, **(shape or SHAPE_7B))), precision, optimizer).values())


KV_CASES = ((4096, 1), (4096, 8), (32768, 1), (32768, 8))


def kv_cache_cases(cases=KV_CASES, kv_heads=(32, 8), params: int = P_7B) -> dict[str, dict]:
    """The bf16 KV cache of a 7B shape (32 layers, 32 heads of 128) per (seq, batch) case, with all
    32 KV heads (MHA) and with 8 (GQA), in GB and as a multiple of the bf16 weights (2 B x params).
    Keys: ``seq{seq}_batch{batch}``."""
    weights = 2 * params
    out = {}
    for seq, batch in cases:
        mha, gqa = (kv_cache_bytes(Shape(layers=32, hidden=4096, heads=32, seq=seq, batch=batch, vocab=32000,
                                         kv_heads=k), act=2) for k in kv_heads)
        out[f"seq{seq}_batch{batch}"] = {"seq": seq, "batch": batch, "mha_bytes": mha, "gqa_bytes": gqa,
                                         "mha_gb": mha / GB, "gqa_gb": gqa / GB, "weights_gb": weights / GB,
                                         "mha_over_weights": mha / weights, "gqa_over_weights": gqa / weights}
    return out


def kv_cache_table(cases: dict[str, dict]) -> Table:
    return Table([("sequence", "int"), ("batch", "int"), ("32 KV heads, MHA (GB)", "float:2"),
                  ("8 KV heads, GQA (GB)", "float:2"), ("MHA ÷ bf16 weights", "x:2"), ("GQA ÷ bf16 weights", "x:2")],
                 [[c["seq"], c["batch"], c["mha_gb"], c["gqa_gb"], c["mha_over_weights"], c["gqa_over_weights"]]
                  for c in cases.values()])


# ---------------------------------------------------------------------- the toy GPT, measured
def paper_policy(dropout: float) -> str:
    """The recompute policy under which the paper's formula matches what TinyGPT's CPU attention
    keeps: with dropout the math path keeps the s x s scores (``none``); without, the flash kernel
    keeps none, as ``selective`` recomputation does."""
    return "none" if dropout else "selective"


def sweep_point(result: Result) -> list:
    """[seq, dropout, measured, TinyGPT's list, the paper's formula] of one measured run."""
    c, m = result.config, result.measurement
    paper = estimate_bytes(shape=result.shape, precision=c.precision, dropout=c.dropout > 0,
                           recompute=paper_policy(c.dropout))["activations"]
    return [result.shape.seq, c.dropout, m.measured["activations"], m.tinygpt_activations["total"], paper]


def sweep_table(points: list[list], elem: int = 4) -> Table:
    """The sweep_point of each run; elem: bytes per activation element of the runs (4: fp32)."""
    return Table([("seq", "int"), ("dropout", "float:1"), ("measured", "B"), ("TinyGPT list", "B"),
                  (f"paper, e={elem}", "B"), ("measured / paper", "float:3")],
                 [[*p, p[2] / p[4]] for p in points])


# ---------------------------------------------------------------------- real architectures, derived
ZOO_MODELS = ("llama-3.2-1b", "llama-3-8b", "mixtral-8x7b", "llama-3-70b", "gpt-3-175b", "llama-3.1-405b")


def zoo_model_state(names=ZOO_MODELS, dp: int = 8) -> dict[str, dict]:
    """Each real model's exact parameter count (labkit.zoo's closed form, equal to the published
    count), its mixed-precision AdamW model state on one GPU and per rank under ZeRO-3 over ``dp``
    ranks, and its bf16 KV cache per token."""
    from labkit import zoo

    out = {}
    for name in names:
        spec = zoo.get(name)
        params = spec.param_count()
        out[name] = {"params": params,
                     "mixed_adamw": sum(model_state_bytes(params, "mixed", "adamw").values()),
                     "zero3_per_rank": sum(zero_model_state(params, "mixed", "adamw", 3, dp).values()),
                     "kv_bf16_per_token": spec.kv_bytes_per_token(2)}
    return out


def zoo_table(models: dict[str, dict], dp: int = 8) -> Table:
    return Table(["model", ("parameters", "int"), ("mixed AdamW state (16 B/param)", "bytes"),
                  (f"per rank, ZeRO-3 over {dp}", "bytes"), ("KV cache per token, bf16", "B")],
                 [[name, m["params"], m["mixed_adamw"], m["zero3_per_rank"], m["kv_bf16_per_token"]]
                  for name, m in models.items()])
