"""Lab 01's formulas swept: recipes, ZeRO stages, sequence lengths and KV caches for a 7B model
(derived), and the toy GPT's measured activations across sequence lengths.

The notebook calls these and publishes their tables; the tests check what they must give (112 GB
of model state, 14 GB per rank under ZeRO-3 on 8 ranks, a KV cache four times smaller with 8 KV
heads, measured activations equal to TinyGPT's list). Sizes at 7B scale are in GB (1e9 bytes), the
unit of the "112 GB" rule.
"""

from __future__ import annotations

from labkit.table import Table
from memory_accounting import (MOMENTS, RECIPES, Result, activation_bytes_per_layer, estimate_bytes, kv_cache_bytes,
                               model_state_bytes, zero_model_state)
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


# ---------------------------------------------------------------------- model parallelism at 70B, derived and traced
SHAPE_70B = {"seq": 8192, "batch": 1, "hidden": 8192, "heads": 64}  # Llama 3's 8k-token pre-training sequences
LAYERS_70B = 80
# case: (GPUs, activation_bytes_per_layer's split, recompute, pipeline stage, Table 2's per-layer formula)
PARALLEL_CASES = {
    "one_gpu": (1, {}, "none", None, "sbh(34 + 5as/h)"),
    "tp8": (8, {"tp": 8}, "none", None, "sbh(10 + 24/t + 5as/(ht))"),
    "tp8_sp": (8, {"tp": 8, "sp": True}, "none", None, "sbh/t · (34 + 5as/h)"),
    "tp8_selective": (8, {"tp": 8}, "selective", None, "sbh(10 + 24/t)"),
    "tp8_sp_selective": (8, {"tp": 8, "sp": True}, "selective", None, "34·sbh/t"),
    "tp8_full": (8, {"tp": 8}, "full", None, "2·sbh"),
    "tp8_pp4_stage0": (32, {"tp": 8, "sp": True}, "selective", "first", "34·sbh/t"),
    "tp8_pp4_last": (32, {"tp": 8, "sp": True}, "selective", "last", "34·sbh/t"),
}


def llama_params_per_gpu(name: str = "llama-3-70b", tp: int = 1, pp: int = 1, stage: str = "first") -> int:
    """Parameters on one GPU of a zoo Llama split the Megatron way (model_parallel.params_per_rank does
    the same for TinyGPT's layout): every matrix / tp, the two RMSNorms of a layer whole, the
    vocabulary / tp; the first stage holds L/pp layers and the embedding, the last the head and the
    final norm. name: a labkit.zoo Llama; tp, pp: t and p; stage: "first" or "last"."""
    from labkit import zoo

    spec = zoo.get(name)
    w, vocab = spec.width, -(-spec.vocab // tp) * spec.width
    matrices = (spec.param_count() - spec.vocab * w * (1 if spec.tied else 2) - w) // spec.layers - 2 * w
    on_gpu = spec.layers // pp * (matrices // tp + 2 * w)
    if stage == "first" or pp == 1:
        on_gpu += vocab
    if stage == "last" or pp == 1:
        on_gpu += (0 if spec.tied else vocab) + w
    return on_gpu


def parallel_70b(cases=PARALLEL_CASES, pp: int = 4) -> dict[str, dict]:
    """Llama-3-70B trained on t = 8 GPUs (and t = 8, p = 4 on 32), one 8k sequence per micro-batch:
    activations per GPU by Korthikanti et al.'s formulas (16-bit, 1-byte masks: the paper's block at
    70B's s, b, h, a, L) and mixed-precision AdamW model state, 16 B x the parameters on the GPU."""
    out = {}
    for case, (gpus, split, recompute, stage, formula) in cases.items():
        per_layer = activation_bytes_per_layer(**SHAPE_70B, act=2, recompute=recompute, **split)
        layers, in_flight = (LAYERS_70B // pp, pp if stage == "first" else 1) if stage else (LAYERS_70B, 1)
        params = llama_params_per_gpu(tp=split.get("tp", 1), pp=pp if stage else 1, stage=stage or "first")
        state = sum(model_state_bytes(params, "mixed", "adamw").values())
        activations = layers * in_flight * per_layer
        out[case] = {"gpus": gpus, "formula": formula, "layers": layers, "micro_batches": in_flight,
                     "per_layer": per_layer, "activations": activations, "params_per_gpu": params,
                     "model_state": state, "activations_gb": activations / GB, "model_state_gb": state / GB,
                     "total_gb": (activations + state) / GB}
    return out


def parallel_table(cases: dict[str, dict]) -> Table:
    labels = {"one_gpu": "1 GPU", "tp8": "t = 8", "tp8_sp": "t = 8, SP", "tp8_selective": "t = 8, selective",
              "tp8_sp_selective": "t = 8, SP + selective", "tp8_full": "t = 8, full recompute",
              "tp8_pp4_stage0": "t = 8, p = 4: stage 0", "tp8_pp4_last": "t = 8, p = 4: last stage"}
    return Table(["case", ("GPUs", "int"), "per layer (Table 2)", "layers x micro-batches kept",
                  ("activations (GB)", "float:1"), ("model state, 16 B/param (GB)", "float:1"), ("sum (GB)", "float:1")],
                 [[labels[k], c["gpus"], c["formula"], f"{c['layers']} x {c['micro_batches']}", c["activations_gb"],
                   c["model_state_gb"], c["total_gb"]] for k, c in cases.items()], strong=("sum (GB)",))


def traced_70b_layer(tp: int = 8) -> dict[str, dict]:
    """One layer of the paper's block (plain PyTorch, no dropout) at 70B's width on one GPU of ``tp``,
    split by DTensor and traced on fake tensors in bf16 (tp_trace), without and with SP, next to
    the formula for the same block (no masks, no scores kept) and the terms between them."""
    import torch
    import tp_trace

    s, b, h, a = SHAPE_70B["seq"], SHAPE_70B["batch"], SHAPE_70B["hidden"], SHAPE_70B["heads"]
    out = {}
    for sp in (False, True):
        traced = tp_trace.trace_block(h, a, s, b, tp, sp, dtype=torch.bfloat16)
        formula = activation_bytes_per_layer(s, b, h, a, act=2, mask=None, recompute="selective", tp=tp, sp=sp)
        out["tp8_sp" if sp else "tp8"] = {"traced": traced.activations, "formula": formula,
                                          "gap": tp_trace.gap_to_formula(h, a, s, b, tp, sp, elem=2),
                                          "parameters": traced.parameters}
    return out


def traced_table(layers: dict[str, dict]) -> Table:
    rows = []
    for case, c in layers.items():
        rows += [[case, "formula: sbh x 4e" + ("/t" if case.endswith("sp") else "") + " + sbh x 12e/t, e=2", c["formula"]],
                 *([case, f"+ {why}", n] for why, n in c["gap"]),
                 [case, "= traced (DTensor, fake tensors, bf16)", c["traced"]]]
    return Table(["split", "term, one layer on one GPU", ("bytes", "bytes")], rows)
