"""Start here: the primer's three pictures, drawn from what the labs compute.

* ``start-consumers``: what holds a GPU's memory, by category, in one traced Llama-3-8B training step
  (Lab 13's trace, phase by phase) and when the same model serves on one H100 (Lab 14's budget).
* ``start-hierarchy``: registers, L1 and shared memory, L2 and HBM of an H100 SXM, an H200 SXM and an
  RTX 4090, sizes and memory bandwidth on log scales (cited from NVIDIA in Lab 14's ``serving_speed``).
* ``start-roofline``: the H100's roofline with a training matmul and two decode steps on it (derived).
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from labkit import labs, zoo
from labkit.plot import CATEGORY_COLORS, PHASE_COLORS

GIB = 2**30
MODEL, TRAIN_SEQ, SERVE_CONTEXT = "llama-3-8b", 4096, 8192
CARD_COLORS = (CATEGORY_COLORS["parameters"], CATEGORY_COLORS["optimizer_state"], CATEGORY_COLORS["gradients"])


def consumers():
    fit, budget = labs.load(13), labs.load(14, "serving_budget")
    step = fit.trace(fit.Config(model=MODEL, seq=TRAIN_SEQ, batch=1, levers="none"))
    phases = step.derived["by_phase"]
    serve = budget.plan(zoo.get(MODEL), gpu="h100-80gb", seq_len=SERVE_CONTEXT)
    categories = ["parameters", "gradients", "optimizer_state", "activations", "temporaries", "kv_cache", "other"]
    rows = [(name, {c: phases[phase].get(c, 0) for c in categories})
            for name, phase in (("forward", "forward"), ("backward", "backward"), ("optimizer step", "optimizer"))]
    rows.append(("serving", {"parameters": serve.weights_bytes, "activations": serve.prefill_peak_bytes,
                           "other": serve.non_torch_bytes + serve.cuda_graph_bytes, "kv_cache": serve.kv_pool_bytes,
                           "free": serve.outside_bytes}))
    labels = {"optimizer_state": "optimizer state (AdamW)", "kv_cache": "KV cache (the pool)",
              "other": "CUDA graphs, libraries", "free": "left out (vLLM's 10 %: the CUDA context)",
              "activations": "activations (serving: a prefill)", "parameters": "weights"}
    colors = CATEGORY_COLORS | {"free": PHASE_COLORS["zero_grad"]}

    fig, ax = plt.subplots(figsize=(5.2, 3.6), layout="constrained")
    y = [3.4, 2.4, 1.4, 0]
    shown = []  # the legend lists the categories in the ledger's order
    for pos, (_, parts) in zip(y, rows):
        left = 0.0
        for cat in [*categories, "free"]:
            width = parts.get(cat, 0) / GIB
            if width <= 0.05:  # the training step's "other" is 16 KiB
                continue
            free = cat == "free"  # outlined and hatched: an empty share must show on both palettes
            ax.barh(pos, width, left=left, height=0.8, color=colors[cat], linewidth=0.8 if free else 0.5,
                    edgecolor=CATEGORY_COLORS["other"] if free else "white", hatch="//" if free else None)
            shown.append(cat)
            left += width
    card = serve.gpu_bytes / GIB
    ax.axvline(card, color=CATEGORY_COLORS["other"], linestyle="--", linewidth=1.2)
    ax.text(card, 4.0, " one H100", va="center", ha="left")
    ax.set_yticks(y, [name for name, _ in rows])
    ax.set_ylim(-0.6, 4.4)
    ax.set_xlabel("GiB, at each bar's peak")
    ax.set_title("Llama-3-8B: training, then serving", loc="left")
    handles = [Patch(facecolor=colors[c], label=labels.get(c, c), hatch="//" if c == "free" else None,
                     edgecolor=CATEGORY_COLORS["other"] if c == "free" else colors[c])
               for c in [*categories, "free"] if c in shown]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return fig


def hierarchy():
    speed = labs.load(14, "serving_speed")
    chips = list(speed.CHIPS.values())
    levels = (("registers / SM", "registers_per_sm"), ("L1 + shared / SM", "l1_shared_per_sm"),
              ("L2 / GPU", "l2"), ("memory / GPU", "memory"))
    fig, (size_ax, speed_ax) = plt.subplots(2, 1, figsize=(5.2, 7.0), layout="constrained",
                                            gridspec_kw={"height_ratios": (3, 1.2)})
    step, low = len(chips) + 1, 3  # the bars start at 1 KB: log10(bytes) on a linear axis, labelled in units
    for k, (_, field) in enumerate(levels):
        for j, chip in enumerate(chips):
            fact = getattr(chip, field)
            pos = -(k * step + j)
            if fact is None:
                size_ax.text(low + 0.2, pos, "not stated", va="center")
                continue
            size_ax.barh(pos, math.log10(fact.value) - low, left=low, color=CARD_COLORS[j], height=0.85,
                         label=chip.label if k == 0 else None)
            size_ax.text(math.log10(fact.value) + 0.2, pos, fact.stated.split()[0] + " " + fact.stated.split()[1],
                         va="center")
    size_ax.set_xlim(low, 13.5)
    size_ax.set_xticks([3, 6, 9, 12], ["1 KB", "1 MB", "1 GB", "1 TB"])
    size_ax.set_yticks([-(k * step + 1) for k in range(len(levels))], [name for name, _ in levels])
    size_ax.set_title("How big: each level (log scale)", loc="left")
    size_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    size_ax.grid(axis="x", alpha=0.3)
    for j, chip in enumerate(chips):
        speed_ax.barh(-j, chip.bandwidth.value / 1e12, color=CARD_COLORS[j], height=0.8)
        speed_ax.text(chip.bandwidth.value / 1e12 * 1.1, -j, chip.bandwidth.stated, va="center")
    speed_ax.set_xscale("log")
    speed_ax.set_xlim(0.5, 20)
    speed_ax.set_yticks([-j for j in range(len(chips))], [c.label for c in chips])
    speed_ax.set_xlabel("TB/s, memory to chip (log scale)")
    speed_ax.set_title("How fast: memory bandwidth", loc="left")
    speed_ax.grid(axis="x", alpha=0.3)
    return fig


def roofline():
    speed, budget = labs.load(14, "serving_speed"), labs.load(14, "serving_budget")
    h100, spec = speed.CHIPS["h100-80gb"], zoo.get(MODEL)
    pool = budget.plan(spec, gpu=h100.name, seq_len=SERVE_CONTEXT).sequences(SERVE_CONTEXT)
    xs = [0.3 * 1.2**k for k in range(60)]
    fig, ax = plt.subplots(figsize=(5.2, 4.2), layout="constrained")
    ax.plot(xs, [speed.attainable(h100, x) / 1e12 for x in xs], color=CATEGORY_COLORS["other"], linewidth=2.5,
            label="H100 SXM: the most it can do")
    ax.axvline(h100.ridge, color=CATEGORY_COLORS["other"], linestyle=":", linewidth=1)
    ax.text(h100.ridge * 1.15, 1.5, f"ridge\n{h100.ridge:.0f}", va="bottom")
    ax.text(0.45, 150, "memory-bound:\nwaits on HBM", va="center")
    ax.text(h100.ridge * 1.3, 150, "compute-\nbound", va="center")
    flops, moved = speed.matmul(tokens=8192, d_in=4096, d_out=4096)
    points = [("training matmul", flops / moved, CATEGORY_COLORS["parameters"]),
              ("decode, 1 sequence", speed.decode(h100, spec, SERVE_CONTEXT)["intensity"],
               CATEGORY_COLORS["temporaries"]),
              (f"decode, {pool} sequences", speed.decode(h100, spec, SERVE_CONTEXT, pool)["intensity"],
               CATEGORY_COLORS["optimizer_state"])]
    for name, x, color in points:
        y = speed.attainable(h100, x) / 1e12
        ax.plot([x], [y], "o", markersize=10, color=color, label=f"{name}: {x:,.0f} FLOPs/B" if x >= 10
                else f"{name}: {x:.1f} FLOPs/B")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(0.3, 2e4)
    ax.set_ylim(1, 3000)
    ax.set_xlabel("FLOPs per byte moved (log scale)")
    ax.set_ylabel("TFLOP/s, bf16 (log scale)")
    ax.set_title("Below the ridge, memory sets the pace", loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    return fig


FIGURES = {"start-consumers": consumers, "start-hierarchy": hierarchy, "start-roofline": roofline}
