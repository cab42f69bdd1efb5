"""Lab 16 - how close are the traces to real GPUs? Published GPU memory figures, against the trace and
the simulation of the same configuration.

``PUBLISHED`` lists measurements other people published, each with its exact source, its
configuration in their words, and what it measures: ``reserved`` (``max_memory_reserved``, what
torchtitan logs as "memory"), ``allocated``, ``active`` (allocated, plus blocks waiting for another
stream's events) or ``nvidia-smi`` (the whole process). A figure whose configuration Lab 13 can
trace carries the flags that trace it (``step``: torchtitan's op-level checkpointing policy is Lab
13's ``--checkpointing save-alternate-matmuls``) and the allocator setting the run used, read from the
launcher it ran with (``alloc_conf``, with its source). Every other figure says why it cannot be
expressed yet, and stays on the list.

``check(figure)`` traces the step on fake tensors (Lab 13), replays it through the allocator model
(two steps: the second meets the cache the first left) and returns the traced peak, the simulated
peaks by pool, and the error against the published figure. Nothing is fitted: the only terms
between a trace and a reserved figure are the allocator's rules and cuBLAS's workspaces
(``caching_allocator.CUBLAS_WORKSPACE``), each with its source.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import alloc_conf
from allocator_blocks import GiB
from labkit import labs

TITAN = ("https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/"
         "llama3_h100_202412_torchtitan.md")
TITAN_RUN = "https://github.com/pytorch/torchtitan/blob/9dec370ad26b5f8e9a7333a0e36165018262644b/run_llama_train.sh"
TITAN_SLURM = "https://github.com/pytorch/torchtitan/blob/9dec370ad26b5f8e9a7333a0e36165018262644b/multinode_trainer.slurm"
TRAINY = ("https://github.com/pytorch/torchtitan/blob/cbccb387871a5e1f522c1e222c51ab88b03c0392/benchmarks/"
          "llama3-8b_h200_202506_trainy-whitefiber.md")
COOKBOOK = "https://github.com/meta-llama/llama-cookbook/pull/41"
TORCHTUNE = "https://github.com/pytorch/torchtune/blob/1814feb17a9038e1a8053ce93111bd26774a8db6/README.md"
#: torchtitan's Llama 3.1 8B runs of its December 2024 benchmark: llama3_8b.toml at commit 9dec370 (seq_len
#: 8192, selective op checkpointing, bf16 parameters and fp32 reduction under FSDP2, AdamW foreach).
TITAN_8B = {"model": "llama-3.1-8b", "seq": 8192, "batch": 2, "zero_stage": 3, "precision": "mixed",
            "checkpointing": "save-alternate-matmuls"}
#: why a figure is not expressed yet: what Lab 13 does not trace together (its refusals say the same)
COMPILE = ("torch.compile with --tp or --cp is not traced together (Lab 13 compiles whole blocks under FSDP2 or on a "
           "pipeline stage, with their checkpoint inside, not DTensor's split blocks or the ring)")
FLOAT8_RECIPE = ("the benchmark names Float8 without its recipe or whether FSDP2 gathered float8 weights (Lab 13 traces "
                 "--float8 tensorwise and tensorwise-all-gather; which one ran is not stated)")
FLOAT8_SPLIT = "Float8 with --cp is not traced together (Lab 13 traces it with --tp and --pp)"


@dataclass(frozen=True)
class Published:
    key: str
    source: str
    url: str
    config: str  # in the publisher's words
    measures: str  # reserved | allocated | active | nvidia-smi
    gib: float  # the figure, in GiB (2**30 bytes) as published
    step: dict | None = None  # Lab 13's Config fields that trace it
    alloc_conf: str = ""
    alloc_conf_source: str = ""
    why_not: str | None = None  # why its configuration cannot be expressed yet


def _titan(key, table, config, gib, why_not=None, **kw) -> Published:
    return Published(key, f"torchtitan benchmark, Dec 2024, {table}", TITAN, config, "reserved", gib, why_not=why_not,
                     **kw)


# --8<-- [start:published]
PUBLISHED = (
    _titan("titan-8b-fsdp8", "Table 1", "Llama 3.1 8B, FSDP over 8 H100, local batch 2 x 8192, selective op AC", 82.4,
           step=TITAN_8B | {"dp": 8}, alloc_conf="expandable_segments:True",
           alloc_conf_source=TITAN_RUN),
    _titan("titan-8b-fsdp8-compile", "Table 1", "the same, + torch.compile", 77.0,
           step=TITAN_8B | {"dp": 8, "compile": True}, alloc_conf="expandable_segments:True", alloc_conf_source=TITAN_RUN),
    _titan("titan-8b-fsdp8-compile-fp8", "Table 1", "the same, + torch.compile + Float8", 76.8, FLOAT8_RECIPE),
    *(_titan(f"titan-8b-cp{cp}", "Table 2", f"Llama 3.1 8B, FSDP {8 // cp} x CP {cp}, local batch 1 x {seq:,}, full AC, "
             "torch.compile + Float8", gib, f"{COMPILE}; {FLOAT8_SPLIT}")
      for cp, seq, gib in ((1, 32768, 83.9), (2, 65536, 84.2), (4, 131072, 84.0), (8, 262144, 84.5))),
    _titan("titan-8b-fsdp128", "Table 3", "Llama 3.1 8B, FSDP over 128 H100, local batch 2 x 8192, selective op AC", 67.0,
           step=TITAN_8B | {"dp": 128}, alloc_conf="",
           alloc_conf_source=TITAN_SLURM),
    _titan("titan-8b-fsdp128-compile", "Table 3", "the same, + torch.compile", 62.0,
           step=TITAN_8B | {"dp": 128, "compile": True}, alloc_conf="", alloc_conf_source=TITAN_SLURM),
    _titan("titan-8b-fsdp128-compile-fp8", "Table 3", "the same, + torch.compile + Float8", 61.8, FLOAT8_RECIPE),
    _titan("titan-70b-2d", "Table 4", "Llama 3.1 70B, FSDP 32 x TP 8, local batch 16, full AC, compile + Float8", 71.9,
           COMPILE),
    _titan("titan-70b-2d-asynctp", "Table 4", "the same, + AsyncTP", 67.6,
           f"AsyncTP's symmetric-memory buffers are not traced; {COMPILE}"),
    _titan("titan-405b-1f1b", "Table 5", "Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, 1F1B, local batch 32, full AC, "
           "torch.compile + Float8 + AsyncTP", 82.5, f"{COMPILE}; AsyncTP's buffers are not traced"),
    _titan("titan-405b-interleaved", "Table 5", "the same, interleaved 1F1B", 72.7,
           "the interleaved schedule is a cited formula in Lab 13, not traced; and as 1F1B's row"),
    *(_titan(f"titan-405b-4d-cp{cp}", "Table 6", f"Llama 3.1 405B, 4D (FSDP {8 // cp}, TP 8, PP 8, CP {cp}), "
             f"{seq:,} tokens, full AC, torch.compile + Float8 + AsyncTP", gib,
             f"--cp with --tp and --pp is not traced together; {COMPILE}; {FLOAT8_SPLIT}")
      for cp, seq, gib in ((1, 32768, 75.3), (2, 65536, 75.9), (4, 131072, 77.1), (8, 262144, 84.9))),
    *(Published(f"trainy-h200-{nodes}n", "torchtitan benchmark, Trainy on WhiteFiber, June 2025", TRAINY,
                f"Llama 3.1 8B on {nodes} x 8 H200, local batch 2, torch.compile + Float8 all-gather", "reserved", gib,
                why_not="its float8 options force_recompute_fp8_weight_in_bwd and precompute_float8_dynamic_scale_for_fsdp "
                "are not Lab 13 flags (the Float8 all-gather is: --float8 tensorwise-all-gather)")
      for nodes, gib in ((4, 47.96), (8, 46.97))),
    *(Published(f"cookbook-lora-{name}", "llama-cookbook PR #41 (Andrew Gu)", COOKBOOK,
                f"Llama 2 7B, LoRA (PEFT), pure bf16, FSDP1 over 4 A100 40 GB, {what}", "reserved", gib,
                why_not="FSDP1's flat parameters and PEFT's LoRA are not traced (Lab 15 holds LoRA, FSDP2 only)")
      for name, what, gib in (("default", "limit_all_gathers=False", 32.67 * 1e9 / GiB),
                              ("limited", "limit_all_gathers=True", 27.36 * 1e9 / GiB),
                              ("no-logits", "limit_all_gathers=True, logits not kept", 19.36 * 1e9 / GiB))),
    Published("torchtune-3b-baseline", "torchtune README, Nov 2024", TORCHTUNE,
              "Llama 3.2 3B full finetune on one A100, batch 2, bf16, unpacked Alpaca", "active", 25.5,
              why_not="unpacked samples: each batch's length comes from the data, which a trace does not have"),
    Published("torchtune-3b-packed", "torchtune README, Nov 2024", TORCHTUNE,
              "the same, packed to 4,096 tokens", "active", 60.0,
              why_not="the optimizer is not stated (the config's default, 8-bit AdamW, is a later row of the table)"),
)
# --8<-- [end:published]


def check(p: Published, keep: bool = False) -> dict:
    """Trace ``p``'s step (Lab 13), replay it (the allocator setting its run used), compare;
    ``keep``: also return the replay itself (``"replay"``), to draw it."""
    lab13, lab16 = labs.load(13), labs.load(16)
    trace = lab13.trace(lab13.Config(**p.step, levers="none"))
    ev = labs.load(16, "replay").events_of(trace.ledger)
    r = lab16.simulate(ev, alloc_conf.parse(p.alloc_conf), capacity=None, workspaces=2, repeat=2)
    predicted = {"reserved": r.peak_reserved, "allocated": r.peak_allocated, "active": r.peak_allocated,
                 "nvidia-smi": r.peak_reserved + lab16.CUDA_CONTEXT}[p.measures]
    published = p.gib * GiB
    return {"key": p.key, "traced_bytes": r.peak_traced, "allocated_bytes": r.peak_allocated,
            "reserved_bytes": r.peak_reserved, "by_stream": r.by_stream, "predicted_bytes": predicted,
            "published_bytes": published, "error": predicted / published - 1,
            "old_error": trace.per_rank_peak_bytes * 1.05 / published - 1,  # Lab 13's 5 % headroom, before
            **({"replay": r} if keep else {})}


def summary(checked: list[dict]) -> dict:
    """The median and the worst error against the published figures that report reserved memory."""
    reserved = [c for c in checked if next(p for p in PUBLISHED if p.key == c["key"]).measures == "reserved"]
    errors = [abs(c["error"]) for c in reserved]
    old = [abs(c["old_error"]) for c in reserved]
    return {"figures": len(PUBLISHED), "expressed": len(checked), "reserved_expressed": len(reserved),
            "median_error": statistics.median(errors) if errors else None, "worst_error": max(errors, default=None),
            "old_median_error": statistics.median(old) if old else None, "old_worst_error": max(old, default=None)}


def table(checked: list[dict]):
    """Every published figure: what it measures, the trace and the simulation where it is expressed, the
    error, and otherwise why not."""
    from labkit.table import Table

    done = {c["key"]: c for c in checked}
    rows = []
    for p in PUBLISHED:
        c = done.get(p.key)
        rows.append([p.key, p.source, p.config, p.measures, p.gib * GiB, c and c["traced_bytes"],
                     c and c["predicted_bytes"], c and c["error"], c and c["old_error"],
                     f"allocator: {p.alloc_conf or 'default'}" if c else f"not expressed: {p.why_not}"])
    return Table(["figure", "source", "configuration", "measures", ("published", "bytes"), ("traced", "bytes"),
                  ("simulated", "bytes"), ("error", "pct:1"), ("traced + 5 %: error", "pct:1"), "note"], rows,
                 unit="GiB")
