"""Lab 01 - what the "Will it fit?" calculator is asked: a model, a task and the way it runs.

The names are Lab 13's flags (``fit.py --model llama-3-8b --seq 4096 --precision bf16``) and Lab
14's (``--kv-dtype --block-size --gpu-memory-utilization --tp``), so a page's address
(``?model=llama-3-8b&seq=4096``) and a command line say the same thing. Every rule lives here, once:
:class:`Inputs` raises :class:`labkit.config.UsageError` naming the flag, and ``fields()`` hands the
bounds and choices to the page, whose JavaScript checks the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import fit_compiled
import fit_rules
from labkit import labs, zoo
from labkit.config import (
    MAX_BATCH, MAX_COUNT, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH, UsageError,
    check_fields, choices_of, fields_of, option, split_optional,
)

lora = labs.load(15, "lora")  # TARGETS and the projections' shapes: where an adapter can go

#: A Hugging Face config.json's keys for each dimension, first found wins (``zoo.hf_spec`` reads them so).
HF_KEYS = zoo.HF_KEYS
DIMS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "experts", "top_k", "tied")
ITEMS = {"lora_targets": lora.ALL}
CUSTOM = "custom"
MAX_RANKS = 2**20  # GPUs in one run, all parallel degrees multiplied (the largest runs have about 10**5)


def presets() -> list[str]:
    """The zoo's causal language models (the diffusion transformers take no tokens; latent attention, MLA,
    has no formula here: Lab 14 traces it)."""
    return [n for n in zoo.names() if zoo.get(n).family not in ("flux", "deepseek")]


@dataclass
class FineTuning:
    """What a step trains: every weight, or LoRA adapters on a frozen base, in full precision or in 4-bit
    NF4 (Lab 15). Lab 15's ``Config``, Lab 13's and the calculator's inputs share these flags."""

    method: Literal["full", "lora", "qlora"] = option(
        "full", "full: train every weight; lora: adapters on a frozen base; qlora: the frozen base in 4-bit NF4 "
        "(Lab 15)")
    lora_rank: int = option(16, "rank of each LoRA adapter (at most min(in, out) of every targeted projection)",
                            min=1, max=MAX_WIDTH)
    lora_targets: tuple[str, ...] = option(lora.ALL, f"the projections that get an adapter, some of {','.join(lora.ALL)}")

    def __post_init__(self) -> None:  # a lab's Config: its fields' checks, then the targets' names, whatever --method
        super().__post_init__()
        self.check_targets()

    def check_targets(self) -> None:
        """--lora-targets: names of Lab 15's projections, each at most once (UsageError)."""
        unknown = [t for t in self.lora_targets if t not in lora.TARGETS]
        if unknown or len(set(self.lora_targets)) < len(self.lora_targets):
            raise UsageError(f"--lora-targets {','.join(self.lora_targets)}: each at most once, from "
                             f"{','.join(lora.ALL)}" + (f" (unknown: {','.join(unknown)})" if unknown else ""))

    def check_fine_tuning(self, spec) -> None:
        """The rules of --method, --lora-rank and --lora-targets for ``spec`` (UsageError naming the flag)."""
        self.check_targets()
        if self.method == "full":
            return
        split = [f for f, on in (("--tp", getattr(self, "tp", 1) > 1), ("--pp", getattr(self, "pp", 1) > 1),
                                 ("--float8", getattr(self, "float8", "none") != "none")) if on]
        if split:  # Lab 15's step was traced on one GPU in bf16 matmuls: these were not traced with it
            raise UsageError(f"{' and '.join(split)} with --method {self.method} is not traced together (Lab 15 traces "
                             "adapters on one GPU, without float8): train every weight, or leave them out")
        if spec.family not in ("llama", "mixtral", "hf"):
            raise UsageError(f"--method {self.method} puts adapters on Llama's q, k, v, o, gate, up and down "
                             f"projections: {spec.name} is a {spec.family} model, which has none")
        if self.method == "qlora" and getattr(self, "precision", "bf16") == "fp32":
            raise UsageError("--method qlora reads its NF4 weights back in bf16 for every matmul: use --precision "
                             "bf16 or mixed, not fp32")
        name, i, o = min(lora.shapes(spec, self.lora_targets), key=lambda s: min(s[1:]))
        if self.lora_rank > min(i, o):
            raise UsageError(f"--lora-rank {self.lora_rank} is larger than min(in, out) = {min(i, o)} of the {name} "
                             f"projection ({i} -> {o}): a rank-r product cannot have r above either side")


@dataclass
class TrainingRun(FineTuning):
    """How a step runs: its sizes, precision, optimizer, checkpointing and data-parallel sharding.

    Written once, for the calculator's :class:`Inputs` and Lab 13's ``fit.py`` ``Config`` (which mixes
    it in), so that a flag means the same in a command line and a page's address."""

    batch: int = option(1, "sequences per micro-batch, per rank", min=1, max=MAX_BATCH)
    seq: int = option(4096, "tokens per sequence", min=1, max=MAX_TOKENS)
    accumulation: int = option(1, "micro-batches per optimizer step (gradient accumulation, Lab 06)",
                               min=1, max=MAX_COUNT)
    precision: Literal["fp32", "bf16", "mixed"] = option(
        "mixed", "fp32: weights, gradients and AdamW state in fp32; bf16: pure bf16 (no fp32 master): weights, "
        "gradients and AdamW state in bf16; mixed: fp32 weights and state, bf16 autocast")
    optimizer: Literal["adamw", "adamw-foreach", "adamw-fused", "adamw8bit", "sgd"] = option(
        "adamw", "adamw: CUDA's default implementation (foreach); adamw8bit: moments in 8-bit blocks (Lab 15); sgd: "
        "with momentum")
    checkpointing: Literal["none", "full", "every-k", "every-kth-block", "save-matmuls", "save-alternate-matmuls"] = option(
        "none", "activation checkpointing (Lab 04), by what each block keeps for backward. none: everything; full: "
        "its input only; every-k: the input of each segment of --checkpoint-every blocks (a segment recomputed "
        "whole in backward); every-kth-block (torchtitan's layer policy): blocks K, 2K, ... (counted from 1) keep "
        "their input only, every other block everything; save-matmuls: its input, every matmul's output and attention's; "
        "save-alternate-matmuls (torchtitan's op policy): its input, attention's output and every other matmul's "
        "(q, v, gate, down in a Llama block); the rest is recomputed in backward")
    checkpoint_every: int | None = option(None, "every-k: blocks per checkpointed segment; every-kth-block: every K-th block "
                                          "checkpointed", min=1, max=MAX_LAYERS)
    loss: Literal["full", "chunked", "fused-linear"] = option(
        "full", "full: the model's own loss, every token's logits at once, with their float32 copy and gradient; "
        "chunked: 8 chunks of tokens, each chunk's logits recomputed in backward (torch.utils.checkpoint); "
        "fused-linear: the head and the loss in one function that takes the gradients chunk by chunk in forward "
        "and keeps only them (Liger Kernel's method, in plain PyTorch); all three give the same loss and gradients")
    optimizer_in_backward: bool = option(
        False, "step each parameter's optimizer in backward, as soon as its gradient is accumulated, and free that "
        "gradient (a post-accumulate-grad hook per parameter): one gradient alive at a time, not all of them")
    offload_activations: bool = option(
        False, "keep what the blocks save for backward on the host between forward and backward (Lab 09's streamed "
        "saved-tensor hooks: all but the last two saved tensors and those under 4 KiB; the parameters stay)")
    float8: Literal["none", "tensorwise", "tensorwise-all-gather"] = option(
        "none", "tensorwise: the blocks' linears multiply in float8 as torchao's Float8Linear does (input and weight "
        "cast to e4m3, the output's gradient to e5m2, one dynamic scale per tensor; backward keeps the bf16 input and "
        "the weight itself, as torchao's default); the weights, optimizer and the rest of the step keep --precision "
        "(mixed or bf16); tensorwise-all-gather: also FSDP2's float8 all-gather (ZeRO-2/3): each rank casts its shard "
        "to e4m3 first, the gathered weight is 1 byte per element and a scale, used as it is (torchao's option)")
    compile: bool = option(False, "train: every block torch.compile'd, AOTAutograd's graphs run as Python (Lab 13's fit_compile.py): "
                           "what its partitioner saves is traced; inductor's fused kernels and buffer reuse are not, "
                           "so temporaries are an upper bound; checkpointing inside each block; not a MoE or every-k")
    dp: int = option(1, "data-parallel ranks", min=1, max=2**20)
    zero_stage: Literal[0, 1, 2, 3] = option(
        0, "ZeRO: 1 shards the optimizer state over --dp ranks, 2 also the gradients, 3 also the parameters")
    offload: Literal["none", "optimizer", "params"] = option(
        "none", "optimizer: AdamW and its state on the host (Lab 07); params: FSDP2's CPU offload (ZeRO-3)")
    tp: int = option(1, "tensor-parallel ranks: heads, KV heads, MLP and vocabulary split the Megatron way (training: "
                     "DTensor's plan, Lab 13; serving: Lab 14); with --dp, a --dp x --tp mesh", min=1, max=1024)
    sp: bool = option(False, "sequence parallelism over the --tp ranks: the norms and the residual stream between "
                      "sublayers split along the sequence, each sublayer's input gathered once")
    replicate: int = option(1, "HSDP: FSDP2 over a --replicate x (--dp / --replicate) mesh, each parameter sharded over "
                            "the dp / replicate ranks of its group and replicated across the groups (ZeRO-2/3)",
                            min=1, max=2**20)
    fsdp_units: Literal["blocks", "blocks-embed-head"] = option(
        "blocks", "FSDP2's units under --zero-stage 2 or 3. blocks: each block, and the root holding the embedding, final "
        "norm and head (Lab 11's wrap); blocks-embed-head: each block, the embedding alone, and the final norm with the "
        "head, gathered from its forward to its backward (torchtitan's): no weight left to the root")
    pp: int = option(1, "pipeline stages, 1F1B (PyTorch's Schedule1F1B): the answer is the first stage's, which holds "
                     "the embedding, ⌈layers / pp⌉ blocks and --pp micro-batches of activations in flight "
                     "(needs --accumulation ≥ --pp)", min=1, max=1024)
    cp: int = option(1, "context-parallel ranks: each sequence split over them, attention a ring passing K/V chunks "
                     "(training, Lab 13); FSDP then shards over --dp x --cp ranks, as torchtitan", min=1, max=1024)

    def check_checkpointing(self, layers: int) -> None:
        fit_rules.check_checkpointing(self, layers)

    def check_sharding(self) -> None:
        """The rules between the sharding flags (UsageError naming them)."""
        if self.zero_stage and self.dp * self.cp == 1:
            raise UsageError(f"--zero-stage {self.zero_stage} shards over data-parallel ranks: give --dp N (N > 1)")
        if self.offload == "params" and self.zero_stage != 3:
            raise UsageError("--offload params keeps FSDP2's parameter shards on the host: it needs --zero-stage 3")
        if self.offload == "optimizer" and self.optimizer in ("sgd", "adamw8bit"):
            raise UsageError("--offload optimizer runs PyTorch's AdamW on the host: choose adamw, adamw-foreach or "
                             "adamw-fused")
        if self.optimizer == "adamw8bit" and self.zero_stage:
            raise UsageError("--optimizer adamw8bit is traced on whole tensors: leave --zero-stage at 0")
        if self.method != "full" and (self.dp > 1 or self.offload != "none"):
            raise UsageError(f"--method {self.method} is traced on one GPU (Lab 15): leave --dp at 1 and --offload at none")
        if self.sp and self.tp == 1:
            raise UsageError("--sp splits the sequence over the tensor-parallel ranks: give --tp N (N > 1)")
        if self.sp and self.seq % self.tp:
            raise UsageError(f"--sp splits --seq {self.seq} over --tp {self.tp} ranks: give a multiple of {self.tp}")
        if self.tp * self.pp * self.dp > MAX_RANKS:
            raise UsageError(f"--tp {self.tp} x --pp {self.pp} x --dp {self.dp} is {self.tp * self.pp * self.dp:,} GPUs: "
                             f"more than {MAX_RANKS:,}")
        if self.replicate > 1 and (self.zero_stage < 2 or self.dp % self.replicate or self.dp == self.replicate):
            raise UsageError(f"--replicate {self.replicate} is HSDP: it needs --zero-stage 2 or 3 and a --dp it divides "
                             f"into groups of two or more, got --dp {self.dp}")
        fit_rules.check_combinations(self)


@dataclass
class Subject:
    """The model (a zoo preset, or its dimensions typed or read from a config.json) and the task:
    first in an address, before how the step runs."""

    model: str = option("llama-3-8b", "a zoo model, or custom: the dimensions below")
    layers: int | None = option(None, "transformer blocks (default: the preset's)", min=1, max=MAX_LAYERS)
    hidden: int | None = option(None, "hidden size", min=1, max=MAX_WIDTH)
    heads: int | None = option(None, "attention heads", min=1, max=MAX_HEADS)
    kv_heads: int | None = option(None, "key/value heads (grouped-query attention when fewer than heads)",
                                  min=1, max=MAX_HEADS)
    head_dim: int | None = option(None, "size of one head (default: hidden / heads)", min=1, max=MAX_WIDTH)
    ffn: int | None = option(None, "MLP hidden size (per expert)", min=1, max=MAX_WIDTH)
    vocab: int | None = option(None, "vocabulary", min=1, max=MAX_VOCAB)
    experts: int | None = option(None, "MoE experts per layer (0: a dense MLP)", min=0, max=MAX_EXPERTS)
    top_k: int | None = option(None, "experts each token is routed to", min=0, max=MAX_EXPERTS)
    tied: bool | None = option(None, "the head shares the embedding's weight")
    task: Literal["train", "infer", "decode", "serve"] = option(
        "train", "train: one step; infer: one prefill of batch x seq (Lab 13); decode: one decode step against a KV "
        "cache preallocated to --kv-len (Lab 13); serve: a KV pool (Lab 14)")


@dataclass
class Inputs(TrainingRun, Subject):
    """A model (a zoo preset, or its dimensions typed or read from a config.json), a task, and how it runs."""

    kv_len: int | None = option(None, "decode: tokens the KV cache is preallocated to, per sequence (default: --seq)",
                                min=1, max=MAX_TOKENS)
    new_tokens: int = option(1, "decode: new tokens per sequence in the step (1: plain decoding; more: a speculative "
                             "decoder verifying its drafted tokens)", min=1, max=MAX_TOKENS)

    context: int = option(8192, "serve: tokens of one request (prompt and output)", min=1, max=MAX_TOKENS)
    requests: int = option(32, "serve: requests in flight at once", min=1, max=MAX_BATCH)
    weights: Literal["bf16", "fp8", "int8", "int4-awq", "int4-gptq", "nvfp4"] = option(
        "bf16", "serve: how the blocks' matrices are stored (Lab 14's quantize.py): int4 in groups of 128 with "
        "fp16 scales and 4-bit zeros; int8 and fp8 with fp32 scales; nvfp4 with an fp8 scale per 16")
    kv_dtype: Literal["bf16", "fp8", "fp8-per-head", "fp8-per-token", "int8", "fp32"] = option(
        "bf16", "serve: how keys and values are stored (fp8: one scale per layer, vLLM's default; fp8-per-token, "
        "int8: an fp32 scale per token and head)")
    block_size: int = option(16, "serve: tokens per KV block", min=1, max=MAX_TOKENS)
    gpu_memory_utilization: float = option(
        0.9, "serve: fraction of the GPU the engine may use (0.1 or more: less leaves a 24 GB card no more than its "
        "CUDA context)", min=0.1, max=1)
    prefill_chunk: int | None = option(None, "serve: prefill in chunks of this many tokens", min=1, max=MAX_TOKENS)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.model != CUSTOM and self.model not in presets():
            raise UsageError(f"--model must be custom or one of {', '.join(presets())}, got {self.model!r}")
        if self.model == CUSTOM:
            missing = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "heads", "ffn", "vocab")
                       if getattr(self, n) is None]
            if missing:
                raise UsageError(f"--model custom needs {' '.join(missing)}")
        d = self.dims()
        if d["experts"] and not 1 <= d["top_k"] <= d["experts"]:
            raise UsageError(f"--top-k {d['top_k']} must be 1 to --experts {d['experts']}")
        if not d["experts"] and d["top_k"]:
            raise UsageError(f"--top-k {d['top_k']} routes to experts: give --experts too")
        if not self.head_dim and d["hidden"] % d["heads"]:
            raise UsageError(f"--heads {d['heads']} does not divide --hidden {d['hidden']} (or give --head-dim)")
        if d["heads"] % d["kv_heads"]:
            raise UsageError(f"--kv-heads {d['kv_heads']} does not divide --heads {d['heads']}")
        t, kv = self.tp, d["kv_heads"]
        if d["heads"] % t or d["ffn"] % t or (kv % t if t <= kv else t % kv):
            raise UsageError(f"--tp {t} does not split {d['heads']} heads, {kv} KV heads and an MLP of {d['ffn']} evenly")
        try:
            family = self.spec().family
            self.spec().param_count()
        except ValueError as err:  # a GPT preset whose dimensions are no longer a GPT block's
            raise UsageError(f"--model {self.model}: {err}") from None
        if family == "gpt" and self.weights != "bf16" and self.task == "serve":
            raise UsageError(f"--weights {self.weights}: the formula counts a Llama block's matrices; {self.model} is a GPT")
        fit_rules.check_lever_formulas(self, family, d)
        fit_compiled.check(self, family, d)
        head = d["head_dim"] or d["hidden"] // d["heads"]
        if self.float8 != "none" and self.task == "train" and (family != "llama" or d["experts"] or any(
                v % 16 for v in (d["hidden"], d["ffn"], d["heads"] * head, d["kv_heads"] * head))):
            raise UsageError(f"--float8 {self.float8} converts a dense Llama's block linears, each dimension a multiple of "
                             "16 (torchao's rule): no --experts or GPT preset")
        if family == "gpt" and t > 1:
            raise UsageError(f"--tp {t}: the GPT preset's closed form is for one rank; give a custom model to split")
        self.check_checkpointing(d["layers"])
        if self.task == "train":
            self.check_sharding()
            self.check_fine_tuning(self.spec())
            if self.method != "full" and d["experts"]:
                raise UsageError(f"--method {self.method} on a mixture of experts: the formulas count dense blocks "
                                 "(Lab 13 traces it: fit.py --model mixtral-8x7b --method ...)")
            if t > 1 and kv % t:
                raise UsageError(f"--tp {t} does not split {kv} KV heads: training splits whole KV heads (Lab 13)")
            fit_rules.check_pipeline(self, family, d["layers"])
        if self.task != "train" and self.pp > 1:
            raise UsageError(f"--pp {self.pp} is traced for training (Lab 13): --task {self.task} has no pipeline here")
        if self.task == "decode":
            if family == "gpt" or self.precision == "mixed" or self.dp > 1 or t > 1 or self.zero_stage \
                    or self.offload != "none":
                raise UsageError("--task decode traces a Llama or Mixtral on one GPU with its weights on it, in their "
                                 "own dtype: --precision bf16 or fp32, no --dp, --tp, --zero-stage or --offload")
            if self.new_tokens > (self.kv_len or self.seq):
                raise UsageError(f"--new-tokens {self.new_tokens} is more than the cache holds, --kv-len "
                                 f"{self.kv_len or self.seq}")

    def dims(self) -> dict:
        """The model's dimensions: the preset's, each replaced by the one given."""
        base = {} if self.model == CUSTOM else preset_dims(zoo.get(self.model))
        given = {n: getattr(self, n) for n in DIMS if getattr(self, n) is not None}
        d = {"experts": 0, "top_k": 0, "tied": False, "head_dim": 0} | base | given
        return d | {"kv_heads": d.get("kv_heads") or d["heads"]}

    def spec(self) -> zoo.ModelSpec:
        """The zoo's specification of the model (its closed-form parameter count, its family)."""
        d = self.dims()
        family = zoo.get(self.model).family if self.model != CUSTOM else "llama"
        family = "mixtral" if d["experts"] else ("llama" if family in ("hf", "mixtral") else family)
        return zoo.ModelSpec(self.model, family, layers=d["layers"], width=d["hidden"], heads=d["heads"],
                             kv_heads=d["kv_heads"], ffn=d["ffn"], vocab=d["vocab"], tied=d["tied"],
                             experts=d["experts"], top_k=d["top_k"], head_dim=d["head_dim"],
                             context=zoo.get(self.model).context if self.model != CUSTOM else 0)


def preset_dims(spec: zoo.ModelSpec) -> dict:
    return {"layers": spec.layers, "hidden": spec.width, "heads": spec.heads, "kv_heads": spec.kv_heads,
            "head_dim": spec.head_dim if spec.head_dim * spec.heads != spec.width else 0, "ffn": spec.ffn,
            "vocab": spec.vocab, "experts": spec.experts, "top_k": spec.top_k, "tied": spec.tied}


def fields() -> list[dict]:
    """Each input as the page needs it: name, flag, type, default, bounds, choices, help."""
    out = []
    for f, kind in fields_of(Inputs):
        base, optional = split_optional(kind)
        m = f.metadata
        items = ITEMS.get(f.name)  # a list of names (--lora-targets q,v), each one of these
        out.append({"name": f.name, "flag": f"--{f.name.replace('_', '-')}", "optional": optional,
                    "type": "choice" if choices_of(base) else "list" if items else base.__name__,
                    "default": list(f.default) if items else f.default, "choices": list(choices_of(base) or items or ()),
                    "help": m["help"],
                    **{k: m[k] for k in ("min", "max", "above", "below") if m.get(k) is not None}})
    return out


def from_config_json(data: dict) -> dict:
    """The dimensions a Hugging Face config.json gives (its text model's, for a multimodal config)."""
    data = data.get("text_config") or data if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise UsageError("a config.json is one JSON object")
    out = {}
    for name, keys in HF_KEYS.items():
        value = next((data[k] for k in keys if data.get(k) is not None), None)
        if value is not None:
            out[name] = value
    Inputs(model=CUSTOM, **out)  # the same rules as typed dimensions
    return out
