"""The serving chapter's budget, drawn from Lab 14's ``serving_budget.plan``: what an engine stacks on a
card before the KV pool, for Llama-3-8B on an H100 and on a 24 GB L4, with its weights in bf16 and in
int4 AWQ, and with a draft model for speculative decoding (traced at real size on fake tensors)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from labkit import labs, zoo
from labkit.plot import CATEGORY_COLORS, PHASE_COLORS

GIB = 2**30
CONTEXT = 8192
#: (bar label, model, GPU, keyword arguments of serving_budget.plan)
BARS = (
    ("H100, bf16", "llama-3-8b", "h100-80gb", {}),
    ("H100, int4", "llama-3-8b", "h100-80gb", {"weights": "int4-awq"}),
    ("H100, + draft", "llama-3.1-8b", "h100-80gb", {"draft": "llama-3.2-1b"}),
    ("L4, bf16", "llama-3-8b", "l4-24gb", {}),
    ("L4, int4", "llama-3-8b", "l4-24gb", {"weights": "int4-awq"}),
)
PARTS = (("weights", "parameters", "weights (a draft's too)"), ("prefill", "activations", "a prefill's peak"),
         ("graphs", "temporaries", "CUDA graphs"), ("non_torch", "other", "outside PyTorch"),
         ("pool", "kv_cache", "KV pool"), ("outside", None, "left out (CUDA context)"))


def budget_stack():
    budget = labs.load(14, "serving_budget")
    fig, ax = plt.subplots(figsize=(5.2, 4.6), layout="constrained")
    colors = {key: CATEGORY_COLORS[cat] if cat else PHASE_COLORS["zero_grad"] for key, cat, _ in PARTS}
    for pos, (_, model, gpu, kwargs) in enumerate(BARS):
        draft = kwargs.get("draft")
        b = budget.plan(zoo.get(model), gpu=gpu, seq_len=CONTEXT,
                        **(kwargs | ({"draft": zoo.get(draft)} if draft else {})))
        parts = {"weights": b.weights_bytes + b.draft_weights_bytes, "prefill": b.prefill_peak_bytes,
                 "graphs": b.cuda_graph_bytes, "non_torch": b.non_torch_bytes, "pool": max(b.kv_pool_bytes, 0),
                 "outside": b.outside_bytes}
        left, y = 0.0, -pos
        for key, _, _ in PARTS:
            width = parts[key] / GIB
            hatch = key == "outside"  # an empty share, outlined so that it shows on both palettes
            ax.barh(y, width, left=left, height=0.72, color=colors[key], hatch="//" if hatch else None,
                    edgecolor=CATEGORY_COLORS["other"] if hatch else "white", linewidth=0.8 if hatch else 0.4)
            left += width
        ax.text(left + 1.0, y, f"{b.sequences(CONTEXT)} × 8k", va="center")
    ax.set_yticks([-p for p in range(len(BARS))], [label for label, *_ in BARS])
    ax.set_xlim(0, 100)
    ax.set_xlabel("GiB of one card; right: requests of 8k tokens")
    ax.set_title("Llama-3-8B: what comes before the pool", loc="left")
    fig.legend(handles=[Patch(facecolor=colors[k], label=text, hatch="//" if k == "outside" else None,
                              edgecolor=CATEGORY_COLORS["other"] if k == "outside" else colors[k])
                        for k, _, text in PARTS], loc="outside lower center", ncols=2, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return fig


FIGURES = {"serving-budget-stack": budget_stack}
