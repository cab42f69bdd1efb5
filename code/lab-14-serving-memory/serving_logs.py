"""Lab 14 - the budget held against vLLM's own start-up logs, published with the configuration that made them.

vLLM prints what it measured when it sized its KV pool: the card's total, the weights ("model weights
take", "Loading model weights took", printed in GiB though some versions write "GB"), the activation
peak of its profiling forward, the non-torch memory, the KV cache, "# GPU blocks" and "Maximum
concurrency for N tokens per request". Each :class:`Log` below is one such log, quoted from a public
GitHub thread (its link), with the settings the thread states. :func:`compare` sizes the same
configuration with :func:`serving_budget.plan` (the card's total as the log states it, the same
utilization, tensor parallelism, weight format and profiled tokens) and puts the two side by side,
term by term. Where they differ, :data:`MECHANISMS` says why, each with its source; nothing is fitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import quantize
import serving_budget
import torch

from labkit import fake, zoo
from labkit.table import Table

GIB = serving_budget.GIB


@dataclass(frozen=True)
class Log:
    """One published vLLM start-up log: what it says, in GiB (None: the log does not say)."""

    source: str
    version: str  # as the thread states it
    model: str  # the zoo's name for the checkpoint
    checkpoint: str
    card: str
    total_gib: float | None  # vLLM's total_gpu_memory (None: not printed)
    utilization: float
    tp: int
    tokens: int  # tokens of the profiling forward: the max_model_len (or max_num_batched_tokens) served
    weights: str = "bf16"
    weights_gib: float | None = None
    activations_gib: float | None = None  # "PyTorch activation peak memory", or peak_torch less the weights
    non_torch_gib: float | None = None
    kv_gib: float | None = None
    blocks: int | None = None  # "# GPU blocks", 16 tokens each
    concurrency: float | None = None  # "Maximum concurrency for <tokens> tokens per request"
    derived: str = ""  # which of these numbers the lab derived from the log's own others, and how
    mechanisms: tuple[str, ...] = ()  # keys of MECHANISMS that explain its gaps
    recipe: str = ""  # a checkpoint's own rule for what it leaves in bf16 (RECIPES)


PR_10511 = "https://github.com/vllm-project/vllm/pull/10511"
ISSUE_10517 = "https://github.com/vllm-project/vllm/issues/10517"
LOGS = (
    Log(PR_10511, "0.6.4 (main, 2024-12-13)", "llama-3-8b", "meta-llama/Meta-Llama-3-8B", "H100 80GB", 79.22, 0.90, 1,
        8192, weights_gib=14.96, activations_gib=1.26, non_torch_gib=1.79, kv_gib=53.29,
        mechanisms=("sampler", "non_torch_then")),
    Log(PR_10511, "0.6.4 (main, 2024-12-13)", "llama-3-8b", "meta-llama/Meta-Llama-3-8B", "H100 80GB", 79.22, 0.90, 2,
        8192, weights_gib=7.48, activations_gib=1.26, non_torch_gib=3.58, kv_gib=71.29 - 7.48 - 3.58 - 1.26,
        derived="KV: the log's 71.29 GiB usable less its three terms (its last line is cut in the thread)",
        mechanisms=("sampler", "non_torch_then", "tp_buffers")),
    Log(ISSUE_10517, "0.6.4 (2024-12-02)", "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "RTX 3090 24GB", 23.58,
        0.90, 1, 20000, weights_gib=14.9888, activations_gib=17.06 - 14.9888, non_torch_gib=0.35, kv_gib=3.81,
        blocks=1952, concurrency=1.56, derived="activations: peak_torch_memory 17.06 GiB less the weights",
        mechanisms=("fused_kernels", "small_card", "rope_cache")),
    Log(ISSUE_10517, "0.6.4 (2024-12-02)", "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "RTX 3090 24GB", 23.58,
        0.90, 1, 29000, weights_gib=14.9888, activations_gib=17.98 - 14.9888, non_torch_gib=0.35, kv_gib=2.89,
        blocks=1478, concurrency=0.82, derived="activations: peak_torch_memory 17.98 GiB less the weights",
        mechanisms=("fused_kernels", "small_card", "rope_cache")),
    Log("https://github.com/vllm-project/vllm/issues/6746", "0.5.3 (2024-07-24)", "llama-3.1-405b",
        "meta-llama/Meta-Llama-3.1-405B-Instruct-FP8", "8 x H100 80GB", None, 0.90, 8, 8192, weights="fp8",
        weights_gib=57.7520, mechanisms=("fp8_recipe",), recipe="llama3-fp8"),
    Log("https://github.com/vllm-project/vllm/pull/12569", "0.7.1 (main, 2025-01-30)", "llama-3-70b",
        "neuralmagic/Meta-Llama-3.1-70B-Instruct-quantized.w8a8", "not stated", None, 0.98, 1, 2048, weights="int8",
        weights_gib=67.7229, blocks=1381, concurrency=10.79, mechanisms=("int8_dense",)),
)

#: Why a log and the lab's budget differ, one mechanism each, with its source.
MECHANISMS = {
    "sampler": ("activations, vLLM higher: its profiling run also samples max_num_seqs (256) dummy sequences, "
                "whose float32 logits alone are 256 x 128,256 x 4 B = 125 MiB a copy; the lab traces a prompt to "
                "its last token's logits (vLLM's profile_run: "
                "https://github.com/vllm-project/vllm/blob/v0.6.4/vllm/worker/model_runner.py)"),
    "fused_kernels": ("activations, the lab higher on long prompts: vLLM adds the residual inside its RMSNorm kernel "
                      "(fused_add_rms_norm, in place) and runs gate and up as one matmul into SiluAndMul, where the "
                      "lab's plain PyTorch keeps the stream, its fp32 norm and both projections apart "
                      "(vllm/model_executor/layers/layernorm.py, activation.py)"),
    "non_torch_then": ("non-torch, vLLM higher: this build measured it from before the engine made its CUDA context, "
                       "so its 1.79 GiB holds the context too; a later build reports 0.16 GiB for such a run, the "
                       "lab's default (https://github.com/vllm-project/vllm/pull/12126)"),
    "tp_buffers": ("TP 2, vLLM higher: its activation peak does not fall with the second GPU and its non-torch "
                   "doubles (NCCL's and the custom all-reduce's buffers, vllm/distributed/device_communicators); "
                   "the lab's trace halves the MLP and holds no communication buffer"),
    "small_card": ("on a 24 GB card the pool is what 21 GiB leave after 15 GiB of weights: each term's gap shows "
                   "fivefold in the pool's"),
    "rope_cache": ("weights, vLLM higher: it keeps a cos/sin table of max_position x head size in the model's dtype "
                   "(32 MiB at Llama 3.1's 131,072 positions; vllm/model_executor/layers/rotary_embedding.py, "
                   "_compute_cos_sin_cache); the lab's RoPE keeps its frequencies only"),
    "fp8_recipe": ("weights: Meta's FP8 checkpoint quantizes the feed-forward matrices only, and none in the first "
                   "and the last transformer layers (Llama 3 paper, section 6.2: https://arxiv.org/abs/2407.21783); "
                   "the lab's first figure quantizes every block's matrices, its second follows that recipe; 1.8 % "
                   "stays unexplained"),
    "int8_dense": ("weights: Llama-3.1-70B has Llama-3-70B's shapes; the card is not stated, so only the weights "
                   "are compared"),
}
WEIGHT_MECHANISMS = ("rope_cache", "fp8_recipe", "int8_dense")


def recipe_bytes(log: Log) -> int:
    """The weights of one GPU with a checkpoint's own rule (``log.recipe``): Llama 3's FP8 leaves the
    attention, and the whole first and last layers, in bf16 (each tensor in 512-byte blocks)."""
    spec = serving_budget.per_gpu_spec(zoo.get(log.model), log.tp)
    with torch.device("meta"):
        block = spec.build().blocks[0] if spec.layers <= 2 else serving_budget.traced_blocks(spec).build().blocks[0]
    whole = quantize.model_bytes(block, "bf16", block=fake.CUDA_BLOCK)
    mlp = quantize.model_bytes(block, log.weights, block=fake.CUDA_BLOCK, keep=lambda name: not name.startswith("mlp."))
    outside = serving_budget.weight_bytes(zoo.get(log.model), tp=log.tp) - spec.layers * whole  # embedding, head, norm
    return outside + 2 * whole + (spec.layers - 2) * mlp


def lab_budget(log: Log):
    """The lab's budget of the log's configuration: the card's total as the log states it (Lab 13's H100
    for a log that states none), its utilization, TP, weight format and profiled tokens; no CUDA graphs
    (these builds captured them after sizing the pool)."""
    total = int(log.total_gib * GIB) if log.total_gib else None
    return serving_budget.plan(zoo.get(log.model), gpu="h100-80gb", tp=log.tp, utilization=log.utilization,
                               seq_len=log.tokens, weights=log.weights, cuda_graphs=False, gpu_bytes=total)


def link(log: Log) -> str:
    kind, number = log.source.rsplit("/", 2)[-2:]
    return f"[{'PR' if kind == 'pull' else 'issue'} {number}]({log.source})"


def weights_table(logs=LOGS) -> Table:
    """Each log's weights beside the lab's: every block's matrices in the format, and the checkpoint's own
    recipe where it has one."""
    rows = []
    for log in logs:
        every = serving_budget.weight_bytes(zoo.get(log.model), tp=log.tp, weights=log.weights)
        recipe = recipe_bytes(log) if log.recipe else None
        rows.append([link(log), log.version, log.checkpoint, log.tp, log.weights, log.weights_gib * GIB, every, recipe,
                     (recipe or every) / (log.weights_gib * GIB) - 1,
                     ", ".join(m for m in log.mechanisms if m in WEIGHT_MECHANISMS)])
    return Table(["log", "vLLM", "checkpoint", ("TP", "int"), "format", ("weights, log", "size"),
                  ("lab, every block", "size"), ("lab, its recipe", "size"), ("gap", "pct:2"), "why"], rows)


def compare(logs=LOGS) -> tuple[Table, Table, list]:
    """Each log that states its pool beside the lab's budget of its configuration, term by term: activation
    peak and non-torch memory (the first table), then the KV pool and 16-token blocks (the second; two
    tables fit a page). Returns the two tables and the lab's budgets."""
    terms, pools, budgets = [], [], []
    for log in (log for log in logs if log.kv_gib is not None):
        b = lab_budget(log)
        budgets.append(b)
        terms.append([link(log), log.model, log.card, log.tp, log.tokens, log.activations_gib * GIB,
                      b.prefill_peak_bytes, log.non_torch_gib * GIB, b.non_torch_bytes])
        pools.append([link(log), log.model, log.kv_gib * GIB, b.kv_pool_bytes, b.kv_pool_bytes / (log.kv_gib * GIB) - 1,
                      log.blocks, b.max_tokens_in_flight // b.block_size if log.blocks else None,
                      ", ".join(m for m in log.mechanisms if m not in WEIGHT_MECHANISMS)])
    return (Table(["log", "model", "card", ("TP", "int"), ("tokens profiled", "int"), ("activations, log", "size"),
                   ("activations, lab", "size"), ("non-torch, log", "size"), ("non-torch, lab", "size")], terms),
            Table(["log", "model", ("KV pool, log", "size"), ("KV pool, lab", "size"), ("pool gap", "pct:1"),
                   ("blocks, log", "int"), ("blocks, lab", "int"), "why"], pools), budgets)


def mechanisms_table() -> Table:
    return Table(["why", "mechanism"], [[key, text] for key, text in MECHANISMS.items()])
