"""Lab 15 - at real size: the page's questions, traced by Lab 13, and published peaks held against traces.

``finetune.py`` runs the techniques on a toy, where every byte is checked. At real size the same
pieces (``prepare``, ``AdamW8bit``) are what Lab 13 applies under ``--method lora|qlora`` and
``--optimizer adamw8bit``, on fake tensors. This file names:

* ``ANSWERS``: the configurations the page answers with (Llama-3-8B QLoRA on a 24 GB card at 2k and
  8k tokens, LoRA in bf16 on an H100, a full fine-tune with 8-bit AdamW and checkpointing, Llama-3-70B
  QLoRA on one 80 GB card), each traced with Lab 13's ladder of levers where it does not fit;
* ``PUBLISHED``: single-GPU LoRA and QLoRA peaks that their authors published with the whole
  configuration. Each is traced as configured and set beside the trace, with what the published
  stack does that the trace does not, each with its source; a figure that Lab 13 cannot express yet
  (its stack compiles the step, or its configuration is not published) is listed with the reason.
  No term is fitted: a gap stays a gap, explained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from labkit import labs
from labkit.table import Table

nf4 = labs.load(15, "nf4")  # nf4_bytes: a quantized head's codes and constants

lab13 = labs.load(13)  # trace, run, Config: real models on fake tensors
EXAMPLES = Path(__file__).resolve().parent / "examples"
LLAMA2 = {n: str(EXAMPLES / f"llama-2-{n}.config.json") for n in ("7b", "13b")}  # absolute: a notebook runs elsewhere

# --8<-- [start:answers]
ANSWERS = {  # name: (the question, Lab 13's flags)
    "qlora_8b_2k": ("Llama-3-8B, QLoRA rank 16 on every linear, 2,048 tokens, on a 24 GB RTX 4090",
                    dict(model="llama-3-8b", method="qlora", precision="bf16", seq=2048, gpu="rtx4090-24gb")),
    "qlora_8b_8k": ("the same at 8,192 tokens", dict(model="llama-3-8b", method="qlora", precision="bf16", seq=8192,
                                                      gpu="rtx4090-24gb")),
    "lora_8b_h100": ("Llama-3-8B, LoRA rank 16 on every linear, bf16, 4,096 tokens, on an 80 GB H100",
                     dict(model="llama-3-8b", method="lora", precision="bf16", seq=4096, gpu="h100-80gb")),
    "full_8bit_h100": ("Llama-3-8B, every weight trained in bf16, 8-bit AdamW, full checkpointing, 4,096 tokens, H100",
                       dict(model="llama-3-8b", precision="bf16", optimizer="adamw8bit", checkpointing="full",
                            seq=4096, gpu="h100-80gb")),
    "qlora_70b_h100": ("Llama-3-70B, QLoRA rank 16 on every linear, 2,048 tokens, on an 80 GB H100",
                       dict(model="llama-3-70b", method="qlora", precision="bf16", seq=2048, gpu="h100-80gb")),
}
# --8<-- [end:answers]


@dataclass(frozen=True)
class Difference:
    """Something the published stack does that the trace does not, its source, and, where the shapes
    say how much, the bytes it adds to the published peak (negative: it saves them)."""

    how: str
    source: str
    size: Callable | None = None  # (trace) -> bytes


@dataclass(frozen=True)
class Published:
    """A peak its authors measured and published, with their configuration."""

    name: str
    source: str  # a pinned link
    stack: str  # what measured it
    setup: str  # its configuration, as published
    measures: str  # what the number counts
    figure: str  # as published
    published: int  # bytes
    trace: dict | None = None  # Lab 13's flags for the same step (None: it cannot express it yet)
    differs: tuple[Difference, ...] = ()  # what the published stack does that the trace does not
    why_not: str = ""


GB, GIB = 10**9, 2**30
LITGPT = "https://github.com/Lightning-AI/litgpt/blob/0cc02afa1dca7434418cf612690da13d38d294fd/tutorials/resource-tables.md"
LITGPT_CODE = "https://github.com/Lightning-AI/litgpt/blob/8641822b3249bb94f068c254aa5d13decbc9f0a0/"
TORCHTUNE = "https://github.com/pytorch/torchtune/blob/1814feb17a9038e1a8053ce93111bd26774a8db6/README.md"
LITGPT_SETUP = ("finetune/lora.py at commit 8641822, Alpaca, --precision bf16-true, micro-batch 1, LoRA r 8, alpha 16, "
                "dropout 0.05 on the query and value projections, the longest sample (1,304 Llama 2 tokens) run first, "
                "1 x A100 40 GB")
def _dims(trace) -> tuple[int, int, int, int, int]:
    """(tokens, hidden, MLP width, vocabulary, layers) of a traced step."""
    c, s = trace.config, trace.config.spec
    return c.batch * c.seq, s.width, s.ffn, s.vocab, s.layers


LITGPT_LOSS = Difference(
    "LitGPT runs the head in chunks of 128 tokens and its cross-entropy keeps the bf16 log-softmax (2 B per logit); "
    "the trace's loss keeps an fp32 one and makes the fp32 gradient beside it (8 B per logit at the start of backward)",
    LITGPT_CODE + "finetune/lora.py", lambda t: -6 * _dims(t)[0] * _dims(t)[3])
LITGPT_DROPOUT = Difference(
    "LitGPT's LoRAQKVLinear drops the fused qkv input once for both adapters; PEFT, and the trace, drop each adapter's "
    "input: one bool mask and one bf16 copy fewer per block in LitGPT", LITGPT_CODE + "lit_gpt/lora.py",
    lambda t: -3 * _dims(t)[0] * _dims(t)[1] * _dims(t)[4])
BNB_INPUTS = Difference(
    "bitsandbytes 0.41's MatMul4Bit keeps every quantized linear's input until backward (ctx.tensors = (A, B)); 0.50, "
    "which the trace's Linear4bit matches, keeps none: qkv, proj, MLP and down inputs per block, the head's once",
    "https://github.com/bitsandbytes-foundation/bitsandbytes/blob/0.41.1/bitsandbytes/autograd/_functions.py",
    lambda t: 2 * _dims(t)[0] * ((3 * _dims(t)[1] + _dims(t)[2]) * _dims(t)[4] + _dims(t)[1]))
LITGPT_HEAD = Difference(
    "Fabric's BitsandbytesPrecision quantizes every nn.Linear, the head too (no ignore_modules); bitsandbytes' 4-bit "
    "loading in transformers, and the trace, keep the head in bf16",
    "https://github.com/Lightning-AI/pytorch-lightning/blob/2.1.0/src/lightning/fabric/plugins/precision/bitsandbytes.py",
    lambda t: sum(nf4.nf4_bytes(_dims(t)[3] * _dims(t)[1]).values()) - 2 * _dims(t)[3] * _dims(t)[1])
PAGED = Difference(
    "a quantized run's optimizer is bnb.optim.PagedAdamW: its state lives in CUDA unified memory, which "
    "max_memory_allocated does not count", "https://huggingface.co/docs/bitsandbytes/main/en/explanations/optimizers",
    lambda t: -t.derived["peak"]["optimizer_state"])


def litgpt(size: str, quantize: str, figure: float) -> Published:
    method = "lora" if quantize == "None" else "qlora"
    trace = dict(model=LLAMA2[size], method=method, precision="bf16", lora_rank=8, lora_targets=("q", "v"),
                 lora_dropout=0.05, seq=1304, gpu="a100-40gb")
    differs = (LITGPT_LOSS, LITGPT_DROPOUT) + ((BNB_INPUTS, LITGPT_HEAD, PAGED) if method == "qlora" else ())
    why_not = "" if quantize != "bnb.nf4" else (
        "Lab 15's NF4 always double-quantizes its constants; LitGPT's nf4 keeps a float32 absmax per 64 weights "
        "(the row below is the same run with double quantization)")
    return Published(f"LitGPT, Llama 2 {size.upper()}, LoRA, {quantize}", LITGPT, "LitGPT (Lightning Fabric)", LITGPT_SETUP,
                     "torch.cuda.max_memory_allocated() / 1e9, printed as 'Memory used'", f"{figure:.2f} GB",
                     round(figure * GB), None if why_not else trace, differs, why_not)


# --8<-- [start:published]
PUBLISHED = (
    litgpt("7b", "None", 21.30), litgpt("7b", "bnb.nf4", 14.14), litgpt("7b", "bnb.nf4-dq", 13.84),
    litgpt("13b", "None", 38.12), litgpt("13b", "bnb.nf4", 23.14), litgpt("13b", "bnb.nf4-dq", 22.55),
    Published("torchtune, Llama 3.2 3B, full, bf16, packed", TORCHTUNE + "#optimization-flags", "torchtune",
              "full_finetune_single_device, bf16, batch 2 of packed 4,096-token sequences, A100, the '+ Packed Dataset' "
              "row: no compile, no activation checkpointing, torch.optim.AdamW (the table's later rows add the rest)",
              "torch.cuda.memory_stats()['active_bytes.all.peak'] (torchtune's peak_memory_active), GiB", "60.0 GiB",
              round(60.0 * GIB), dict(model="llama-3.2-3b", precision="bf16", batch=2, seq=4096, gpu="a100-80gb"),
              (Difference("a packed batch carries a block-causal mask per sample (torchtune's PackedDataset), which "
                          "attention honours through FlexAttention where it can; the trace runs plain causal SDPA",
                          "https://github.com/pytorch/torchtune/blob/1814feb17a9038e1a8053ce93111bd26774a8db6/"
                          "torchtune/datasets/_packed.py"),)),
    Published("torchtune, Llama 3.2 3B, QLoRA", TORCHTUNE + "#optimization-flags", "torchtune",
              "the last row: packed 4,096-token sequences, batch 2, compile, chunked cross-entropy, activation "
              "checkpointing and offloading", "peak active bytes, GiB", "4.6 GiB", round(4.6 * GIB),
              why_not="torch.compile fuses the step's pointwise ops (what it keeps for backward changes) and "
                      "activation offloading keeps block inputs on the host: Lab 13 traces the eager step"),
    Published("torchtune, Llama 3.1 8B, QLoRA, 1 x RTX 4090", TORCHTUNE + "#memory-and-training-speed", "torchtune",
              "batch 2, packed to 2,048 tokens, torch.compile on", "peak per GPU, GiB", "7.4 GiB", round(7.4 * GIB),
              why_not="compiled (the table's note), and the recipe's other flags are not given beside the figure"),
    Published("PEFT README, bloomz-7b1, LoRA", "https://github.com/huggingface/peft/blob/"
              "0032f32a82fcec45748606a1b9dcc52986cef168/README.md", "PEFT with plain PyTorch",
              "ought/raft/twitter_complaints, 1 x A100 80 GB", "GPU memory, GB", "32 GB", 32 * GB,
              why_not="BLOOM (a fused query_key_value, ALiBi) has none of the projections Lab 15 targets, and the "
                      "run's sequence length and batch are not published"),
    Published("QLoRA paper, 65B on one 48 GB GPU", "https://arxiv.org/abs/2305.14314", "the QLoRA repository",
              "Guanaco 65B, paged AdamW, 4-bit NF4 with double quantization", "fits a 48 GB GPU", "< 48 GB", 48 * GB,
              why_not="a claim that it fits, not a measured peak with its sequence length and batch"),
)
# --8<-- [end:published]


@dataclass
class Compared:
    row: Published
    traced: object | None = field(default=None, repr=False)  # Lab 13's Trace

    @property
    def gap(self) -> float | None:
        """(traced - published) / published."""
        if self.traced is None:
            return None
        return (self.traced.per_rank_peak_bytes - self.row.published) / self.row.published

    @property
    def explained(self) -> int | None:
        """The bytes the sized differences add to the published peak (derived from the trace's shapes)."""
        if self.traced is None:
            return None
        return sum(d.size(self.traced) for d in self.row.differs if d.size is not None)

    @property
    def remainder(self) -> float | None:
        """What the sized differences leave of the gap, as a fraction of the published peak."""
        if self.traced is None:
            return None
        return (self.traced.per_rank_peak_bytes + self.explained - self.row.published) / self.row.published


def answer(name: str):
    """Lab 13's run for one of ``ANSWERS``: the trace, its verdict, and the levers when it does not fit."""
    return lab13.run(lab13.Config(**ANSWERS[name][1]))


def compare(rows=PUBLISHED) -> list[Compared]:
    """Each published row beside its trace (rows that cannot be expressed keep ``traced`` None)."""
    return [Compared(r, lab13.trace(lab13.Config(levers="none", **r.trace)) if r.trace else None) for r in rows]


def published_table(compared: list[Compared]) -> Table:
    rows = [[c.row.name, c.row.figure, c.row.published, None if c.traced is None else c.traced.per_rank_peak_bytes,
             c.gap, c.explained, c.remainder,
             c.row.why_not or "; ".join(d.how for d in c.row.differs)] for c in compared]
    return Table(["run", "as published", ("published", "bytes"), ("traced", "bytes"), ("gap", "pct:1"),
                  ("differences, sized", "+B"), ("left unexplained", "pct:1"),
                  "what the published stack does that the trace does not, or why it is not traced"], rows, unit="GiB")


def sources_table(compared: list[Compared]) -> Table:
    """Each published row's configuration, what its number counts, and the sources (the figure's, each difference's)."""
    return Table(["run", "configuration", "what it counts", "source", "the differences' sources"],
                 [[c.row.name, c.row.setup, c.row.measures, c.row.source, " ".join(d.source for d in c.row.differs)]
                  for c in compared])
