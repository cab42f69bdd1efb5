"""The handbook chapters' mechanism figures: one or more per chapter, each drawn from what a lab computes.

Every figure here explains how a mechanism works (which tensors autocast keeps, what each ZeRO rank
holds, a paged block table) and takes its numbers from the labs: their formulas (Lab 01's model
state, Lab 05's attention bytes, Lab 07's bytes per parameter), their own code run at toy size on
this CPU (Lab 04's checkpointed blocks, Lab 08's offload engines, Lab 10's bucket rule, Lab 14's
paged cache), or their steps traced at real scale on fake tensors (Lab 02, Lab 03). What a figure
shows is said in its caption on the page, with the evidence (measured, traced, derived).

Colours are ``labkit.plot``'s: a memory category always has its ledger colour, a phase its phase
colour; outlines and text are left in the ink ``labkit.plot.save`` gives them.
"""

from __future__ import annotations

import inspect
import math
from functools import partial

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch, Rectangle

from labkit import labs, zoo
from labkit.plot import CATEGORY_COLORS as CAT
from labkit.plot import MIN_FONT_PT as FS
from labkit.plot import PAGE_WIDTH_IN as WIDTH
from labkit.plot import PHASE_COLORS as PHASE
from labkit.plot import decimate
from labkit.table import format_bytes

GB = 10**9
MIB = 2**20
LINE_IN = FS * 1.4 / 72  # one line of text at the page's smallest size, in inches
LIGHT = 0.45  # fill opacity behind text: black text on it reads in light mode, white on its inverse in dark


# ---------------------------------------------------------------------------------------- drawing kit
def canvas(height: float, width: float = WIDTH):
    """A figure one page column wide, ``height`` inches tall, whose one axes is measured in inches
    from its bottom-left corner: a diagram places its boxes and words where it wants them. A
    narrower ``width`` draws on the left part only, and the SVG is cut to what is drawn: a phone
    scales every figure to its column, so the narrower the drawing, the larger its text there."""
    fig = plt.figure(figsize=(WIDTH, height))
    ax = fig.add_axes((0, 0, width / WIDTH, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def trim(fig, ax, pad=0.06):
    """Fit a canvas to what is drawn on it: the page shows no empty band above or below a diagram."""
    renderer = fig.canvas.get_renderer()
    to_data = ax.transData.inverted()
    ys = [y for artist in (*ax.texts, *ax.patches, *ax.lines)
          for y in to_data.transform(artist.get_window_extent(renderer).get_points())[:, 1]]
    low, high = min(ys) - pad, max(ys) + pad
    ax.set_ylim(low, high)
    fig.set_size_inches(WIDTH, high - low)
    return fig


def box(ax, x, y, w, h, color=None, alpha=1.0, hatch=None, outline=True, lw=0.8):
    """A rectangle at (x, y), filled with a palette ``color`` (or empty), outlined in ink."""
    if color is not None:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, alpha=alpha, lw=0, hatch=hatch))
    if outline:
        ax.add_patch(Rectangle((x, y), w, h, fill=False, lw=lw))


def say(ax, x, y, text, ha="left", va="center", **kw):
    return ax.text(x, y, text, ha=ha, va=va, fontsize=FS, **kw)


def arrow(ax, x0, y0, x1, y1):
    ax.annotate("", (x1, y1), (x0, y0), arrowprops={"arrowstyle": "->", "lw": 1.0, "shrinkA": 0, "shrinkB": 0})


def legend_under(ax, handles, ncols=1):
    """A legend under the plot, as ``labkit.plot.page_layout`` lays legends out for a phone."""
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=FS, ncols=ncols)


def patch(label, color=None, alpha=1.0, hatch=None):
    if color is None:
        return Patch(fill=False, label=label, hatch=hatch)
    return Patch(facecolor=color, alpha=alpha, hatch=hatch, label=label)


def bytes_text(n: float) -> str:
    """Bytes in binary units, rounded for speaking: 30 GiB, 1.1 GiB, 520 MiB."""
    text = format_bytes(int(n))
    if " " not in text:
        return text
    number, unit = text.split()
    value = float(number.replace(",", ""))
    return f"{value:.{0 if value >= 10 else 1}f} {unit}".replace(".0 ", " ")


def phase_bands(ax, spans, alpha=0.35):
    """Each phase of a ledger timeline as a coloured band behind the plot."""
    for span in spans:
        if span.end > span.start:
            ax.axvspan(span.start - 0.5, span.end - 0.5, color=PHASE[span.name], alpha=alpha, lw=0, zorder=0)


def lanes(ax, tl, rows, scope="device", points=300):
    """One lane per ``(label, category)`` of a ledger timeline ``tl``: when its bytes exist and how
    they rise and fall, each lane scaled to its own largest value (named under its label)."""
    columns = tl.device if scope == "device" else tl.host
    labels = []
    for k, (label, cat) in enumerate(rows):
        y0, ys = len(rows) - 1 - k, columns[cat]
        top = max(ys) or 1
        x = decimate(ys, points)
        ax.fill_between(x, y0, [y0 + 0.8 * ys[i] / top for i in x], step="post", color=CAT[cat], lw=0, zorder=2)
        ax.axhline(y0, color=CAT["other"], lw=0.5, zorder=1)
        labels.append(f"{label}\nup to {bytes_text(top)}")
    ax.set_yticks([len(rows) - 1 - k + 0.4 for k in range(len(rows))], labels)
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(-0.1, len(rows))
    ax.set_xlim(-0.5, len(tl) - 0.5)
    ax.set_xticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


# ------------------------------------------------------------------------- memory accounting (Lab 01)
def model_state_bytes():
    """Bytes per parameter of three recipes, tensor by tensor (Lab 01's ``model_state_bytes``), and
    what one layer keeps for backward under the three recomputation policies, in units of s·b·h
    (Lab 01's ``activation_bytes_per_layer`` at a 7B shape, s = 2048)."""
    lab01 = labs.load(1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH, 6.4), layout="constrained")
    recipes = {"fp32": "fp32", "mixed": "mixed (ZeRO's)", "bf16": "pure bf16"}
    parts = [("parameters", "parameters", None, "weights forward reads"), ("gradients", "gradients", None, "gradients"),
             ("master_weights", "parameters", "///", "fp32 master copy"),
             ("optimizer_state", "optimizer_state", None, "AdamW's two moments")]
    for row, recipe in enumerate(recipes):
        one, left = lab01.model_state_bytes(1, recipe, "adamw"), 0
        for key, cat, hatch, _ in parts:
            if one[key]:
                top.barh(row, one[key], left=left, color=CAT[cat], hatch=hatch, alpha=LIGHT if hatch else 1.0,
                         edgecolor=None, height=0.62)
                top.text(left + one[key] / 2, row, str(one[key]), ha="center", va="center", fontsize=FS)
                left += one[key]
        top.text(left + 0.3, row, f"= {left} B", va="center", fontsize=FS)
    top.set_yticks(range(len(recipes)), list(recipes.values()))
    top.invert_yaxis()
    top.set_xlim(0, 21)
    top.set_xlabel("bytes per parameter, AdamW")
    legend_under(top, [patch(text, CAT[cat], LIGHT if hatch else 1.0, hatch) for _, cat, hatch, text in parts])

    s, b, h, a = 2048, 1, 4096, 32
    sbh = s * b * h
    policies = {"none": "keep everything", "selective": "selective", "full": "full recompute"}
    for row, policy in enumerate(policies):
        kept = lab01.activation_bytes_per_layer(s, b, h, a, recompute=policy) / sbh
        linear = min(kept, lab01.activation_bytes_per_layer(s, b, h, a, recompute="selective") / sbh)
        bottom.barh(row, linear, color=CAT["activations"], height=0.62)
        if kept > linear:
            bottom.barh(row, kept - linear, left=linear, color=CAT["activations"], alpha=LIGHT, hatch="\\\\",
                        height=0.62)
        bottom.text(kept + 2, row, f"{kept:g} sbh", va="center", fontsize=FS)
    bottom.set_yticks(range(len(policies)), list(policies.values()))
    bottom.invert_yaxis()
    bottom.set_xlim(0, 150)
    bottom.set_xlabel("bytes one layer keeps, in units of s·b·h")
    legend_under(bottom, [patch("grows with s: 34 sbh", CAT["activations"]),
                          patch("attention scores: 5as/h · sbh", CAT["activations"], LIGHT, "\\\\")])
    return fig


# -------------------------------------------------------------------------- the training step (Lab 02)
def step_lifetimes():
    """Two training steps of Llama-3-8B traced on fake tensors by Lab 02 (its own ``run``): one lane
    per kind of tensor, showing when its bytes are born and when they die."""
    lab02 = labs.load(2)
    result = lab02.run(lab02.Config(model="llama-3-8b", fake=True, seq_len=4096, batch_size=1, steps=2))
    tl = result.ledger.timeline()
    fig, ax = plt.subplots(figsize=(WIDTH, 4.6), layout="constrained")
    phase_bands(ax, tl.spans)
    lanes(ax, tl, [("parameters", "parameters"), ("activations", "activations"), ("gradients", "gradients"),
                   ("optimizer state", "optimizer_state"), ("temporaries", "temporaries")])
    starts = {span.step: span.start for span in reversed(tl.spans)}
    for step, start in starts.items():
        ax.text(start, 5.02, f"step {step + 1}", fontsize=FS, va="bottom")
    ax.set_xlabel("one allocation or free after another")
    legend_under(ax, [patch(name, PHASE[name], 0.35) for name in ("forward", "backward", "optimizer")])
    return fig


# ------------------------------------------------------------------------- mixed precision (Lab 03)
SAVED_KINDS = {  # Lab 03's census kinds -> how the figure draws them
    "float32": ("fp32 tensors", CAT["activations"], 1.0, None),
    "bfloat16": ("bf16 tensors", CAT["activations"], LIGHT, "\\\\"),
    "16-bit weight copies": ("bf16 copies of the weights", CAT["parameters"], LIGHT, "///"),
    "int64": ("token ids (int64)", CAT["other"], 1.0, None),
}


def autocast_saved():
    """What one forward of Llama-3-8B saves for backward, by dtype, in an fp32 step and under bf16
    autocast: Lab 03's own census (``saved_for_backward``) of its real-scale trace on fake tensors."""
    lab03 = labs.load(3)
    harness = lab03.scale_harness
    recipes = {"fp32": "fp32 step", "bf16": "bf16 autocast"}
    config = lab03.Config(model="llama-3-8b", fake=True, seq_len=4096, batch_size=1)
    device = torch.device("cpu")
    with config.tensors(), harness.values_read_as_zero(True):
        model = harness.build_model(config, None, device)
        x, y = harness.token_source(config, config.model_config()).batch(0, 1, device)
        saved = {recipe: lab03.saved_for_backward(model, recipe, x, y) for recipe in recipes}
    fig, ax = plt.subplots(figsize=(WIDTH, 3.4), layout="constrained")
    for row, recipe in enumerate(recipes):
        left = 0.0
        for kind, (_, color, alpha, hatch) in SAVED_KINDS.items():
            n = saved[recipe].get(kind, 0) / 2**30
            if n:
                ax.barh(row, n, left=left, color=color, alpha=alpha, hatch=hatch, height=0.6)
                left += n
        ax.text(left + 0.8, row, bytes_text(sum(saved[recipe].values())), va="center", fontsize=FS)
    ax.set_yticks(range(len(recipes)), list(recipes.values()))
    ax.invert_yaxis()
    ax.set_xlim(0, 62)
    ax.set_xlabel("saved for backward (GiB)")
    legend_under(ax, [patch(*SAVED_KINDS[kind]) for kind in SAVED_KINDS if any(kind in s for s in saved.values())])
    return fig


# ------------------------------------------------------------------ activation checkpointing (Lab 04)
def checkpoint_schedule():
    """Lab 04's chain of 8 blocks, checkpointed in segments of 4 by its own ``run_blocks``: the order
    in which PyTorch runs each block's forward, recompute and backward, recorded by hooks, and which
    blocks hold their saved tensors (or only their segment's input) at each moment."""
    lab04 = labs.load(4)
    seg = labs.load(4, "segments")
    blocks, k = 8, 4
    model, x, y = seg.chain(blocks, 8, 2, "cpu")
    events: list[tuple[str, int]] = []  # ("F", i) forward, ("R", i) recompute, ("D", i) backward done
    started = []  # becomes non-empty when backward starts

    def on_start(i, module, args):
        events.append(("R" if started else "F", i))
        if not started:
            args[0].register_hook(lambda grad: events.append(("D", i)))  # its input's gradient: block i is done

    def on_end(module, args, out):
        if not started and out.requires_grad:
            out.register_hook(lambda grad: started.append(True))

    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: on_start(i, m, a)) for i, b in enumerate(model.blocks)]
    hooks.append(model.blocks[-1].register_forward_hook(on_end))
    try:
        lab04.train_step(model, x, y, "every-k", k)
    finally:
        for hook in hooks:
            hook.remove()

    # What each block holds after each event: its saved tensors from its recompute until its
    # backward is done, or, checkpointed, only its segment's input until the segment is done.
    n = len(events)
    state = [[None] * n for _ in range(blocks)]
    alive, kept = set(), set()
    for t, (kind, i) in enumerate(events):
        if kind == "F" and i % k == 0:
            kept.add(i)
        if kind == "R":
            alive.add(i)
        if kind == "D":
            alive.discard(i)
            kept.discard(i)
        for j in range(blocks):
            state[j][t] = "alive" if j in alive else "kept" if j in kept else None
    left, ch = 0.75, 0.25
    cw = (WIDTH - left - 0.1) / n
    key = [("saved tensors held", CAT["activations"], 1.0, None), ("segment input kept", CAT["activations"], LIGHT, None),
           ("forward", PHASE["forward"], 1.0, None), ("recompute", PHASE["forward"], 1.0, "///"),
           ("backward", PHASE["backward"], 1.0, None)]
    key_h = 0.3 * math.ceil(len(key) / 2) + 0.2
    y_top = key_h + blocks * ch + 0.25
    fig, ax = canvas(y_top + 0.45)
    for t, (kind, i) in enumerate(events):
        x0 = left + t * cw
        box(ax, x0, y_top - (i + 1) * ch, cw, ch, PHASE["backward" if kind == "D" else "forward"], outline=False,
            hatch="///" if kind == "R" else None)
        for j in range(blocks):
            if state[j][t]:
                ax.add_patch(Rectangle((x0 + 0.025, y_top - (j + 1) * ch + 0.04), cw - 0.05, ch - 0.08,
                                       facecolor=CAT["activations"], alpha=1.0 if state[j][t] == "alive" else LIGHT,
                                       lw=0, zorder=3))
    box(ax, left, y_top - blocks * ch, n * cw, blocks * ch, lw=0.6)
    say(ax, left - 0.1, y_top + 0.2, "block", ha="right")
    for j in range(blocks):
        say(ax, left - 0.1, y_top - (j + 0.5) * ch, str(j + 1), ha="right")
    first = next(t for t, (kind, _) in enumerate(events) if kind != "F")
    say(ax, left, y_top + 0.2, "forward")
    say(ax, left + first * cw + 0.05, y_top + 0.2, "backward, a segment at a time")
    ax.plot([left + first * cw] * 2, [y_top - blocks * ch, y_top + 0.32], lw=1.0, color=CAT["other"])
    for m, (label, color, alpha, hatch) in enumerate(key):
        kx, ky = 0.1 + (m % 2) * 2.6, key_h - 0.2 - 0.3 * (m // 2)
        box(ax, kx, ky - 0.08, 0.16, 0.16, color, alpha, hatch, outline=False)
        say(ax, kx + 0.24, ky, label)
    return trim(fig, ax)


# ------------------------------------------------------------------------ attention memory (Lab 05)
def attention_tiles():
    """The s × s scores of one head, and which part of them exists at once: all of it (naive), one
    block of query rows (chunked), one tile that never leaves the chip (a fused kernel). The bytes
    are Lab 05's ``predicted_bytes`` forward peaks at s = 8192, 32 heads, d_head = 128, bf16."""
    lab05 = labs.load(5)
    s, c, heads, d, e = 8192, 1024, 32, 128, 2
    n = s // c
    peaks = {impl: lab05.predicted_bytes(impl, s, batch=1, heads=heads, head_dim=d, e=e, chunk=c, backend=backend)
             for impl, backend in (("naive", None), ("chunked", None), ("sdpa", "FLASH_ATTENTION"))}
    fig, ax = canvas(3.3)
    side, gap, y0 = 1.46, 0.21, 1.15
    titles = {"naive": ("naive", "all of s × s"), "chunked": ("chunked", "c rows × s"), "sdpa": ("fused", "tiles, on chip")}
    for m, impl in enumerate(peaks):
        x0 = 0.12 + m * (side + gap)
        cell = side / n
        for r in range(n):
            for q in range(n):
                if impl == "naive" or (impl == "chunked" and r == 2) or (impl == "sdpa" and r == 2 and q == 5):
                    box(ax, x0 + q * cell, y0 + side - (r + 1) * cell, cell, cell, CAT["temporaries"], outline=False)
        for t in range(1, n):
            ax.plot([x0, x0 + side], [y0 + t * cell] * 2, lw=0.3, color=CAT["other"])
            ax.plot([x0 + t * cell] * 2, [y0, y0 + side], lw=0.3, color=CAT["other"])
        box(ax, x0, y0, side, side)
        for line, text in enumerate((*titles[impl], f"peak {bytes_text(peaks[impl])}")):
            say(ax, x0 + side / 2, y0 - 0.2 - 0.3 * line, text, ha="center")
    say(ax, 0.12, y0 + side + 0.22, "scores of s = 8,192 queries ↓ and keys →")
    return trim(fig, ax)


# ------------------------------------------------------------------- gradient accumulation (Lab 06)
def accumulation_lanes():
    """One optimizer step of Lab 06's TinyGPT as 4 micro-batches of 2 (its own ``train``, measured
    by the ledger on this CPU): activations rise and fall four times, gradients are born in the first
    backward and stay; the dashed line is the activation peak of the same 8 samples in one batch."""
    lab06 = labs.load(6)
    config = lab06.Config(steps=1, batch=8, micro_batch=2)
    device = torch.device("cpu")
    split = lab06.train(config, device, micro=2, k=4, ckpt=False, steps=1, quiet=True)
    whole = lab06.train(config, device, micro=8, k=1, ckpt=False, steps=1, quiet=True)
    tl, big = split.ledger.timeline(), max(whole.ledger.timeline().device["activations"])
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6), layout="constrained")
    phase_bands(ax, tl.spans)
    rows = [("activations", "activations"), ("gradients", "gradients"), ("optimizer state", "optimizer_state")]
    # the activations lane on the scale of the one large batch, so that the dashed line is its peak
    acts = tl.device["activations"]
    x = decimate(acts, 400)
    ax.fill_between(x, 2, [2 + 0.8 * acts[i] / big for i in x], step="post", color=CAT["activations"], lw=0, zorder=2)
    ax.axhline(2.8, color=CAT["other"], ls="--", lw=1.2, zorder=3)
    for k, (_, cat) in enumerate(rows[1:], start=1):
        ys = tl.device[cat]
        xs = decimate(ys, 400)
        y0 = 2 - k
        ax.fill_between(xs, y0, [y0 + 0.8 * ys[i] / (max(ys) or 1) for i in xs], step="post", color=CAT[cat], lw=0,
                        zorder=2)
    for y0 in range(3):
        ax.axhline(y0, color=CAT["other"], lw=0.5, zorder=1)
    ax.text(len(tl) - 0.5, 2.83, f"one batch of 8: {bytes_text(big)}", ha="right", va="bottom", fontsize=FS)
    ax.set_yticks([2.4, 1.4, 0.4], [f"activations\nup to {bytes_text(max(acts))}",
                                    f"gradients\nup to {bytes_text(max(tl.device['gradients']))}",
                                    f"optimizer state\n{bytes_text(max(tl.device['optimizer_state']))}"])
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(-0.1, 3.15)
    ax.set_xlim(-0.5, len(tl) - 0.5)
    ax.set_xticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("4 micro-batches of 2, then one optimizer step")
    legend_under(ax, [patch(name, PHASE[name], 0.35) for name in ("forward", "backward", "optimizer")])
    return fig


# ------------------------------------------------------------------------- optimizer offload (Lab 07)
def offload_placement():
    """Bytes per parameter on the device (left) and on the host (right) between steps, mixed
    precision, for Lab 07's three placements: its ``derived_bytes_per_param``."""
    acct = labs.load(7, "offload_accounting")
    modes = {"none": "no offload", "optimizer": "optimizer\noffload", "gradients": "+ gradient\noffload"}
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6), layout="constrained")
    for row, mode in enumerate(modes):
        w, g, opt, host = acct.derived_bytes_per_param(mode, "bf16")
        left = 0
        for n, cat in ((w, "parameters"), (g, "gradients"), (opt, "optimizer_state")):
            if n:
                ax.barh(row, -n, left=-left, color=CAT[cat], height=0.6)
                left += n
        ax.text(-left - 0.4, row, f"{left}", ha="right", va="center", fontsize=FS)
        if host:
            ax.barh(row, host, color=CAT["host_copies"], height=0.6)
            ax.text(host + 0.4, row, f"{host}", va="center", fontsize=FS)
    ax.axvline(0, lw=1.2, color=CAT["other"])
    ax.set_yticks(range(len(modes)), list(modes.values()))
    ax.invert_yaxis()
    ax.set_xlim(-23, 23)
    ax.set_xticks([-16, -8, 0, 8, 16], ["16", "8", "0", "8", "16"])
    ax.set_xlabel("bytes per parameter: ← on the GPU | on the host →")
    legend_under(ax, [patch("bf16 weights", CAT["parameters"]), patch("bf16 gradients", CAT["gradients"]),
                      patch("fp32 master and moments", CAT["optimizer_state"]),
                      patch("host: master, fp32 gradients, moments, staging copy", CAT["host_copies"])])
    return fig


# ------------------------------------------------------------------------------ weight offload (Lab 08)
def residency(lab08, mode: str, config) -> tuple[list[str], list[tuple[str, dict]]]:
    """Run Lab 08's pipeline under ``mode`` on this CPU and read, as each part starts to compute,
    which units' weights are on the device ("on"), copied ahead ("ahead") or on the host (None)."""
    device = torch.device("cpu")
    pipe = lab08.build_pipeline(config)
    prompt, noise = pipe.inputs(config.seed, device)
    blocks = lab08.denoiser_blocks(pipe.denoiser)
    in_blocks = {id(p) for p in blocks.parameters()}
    units = {"text encoder": list(pipe.text_encoder.parameters()),
             "denoiser rest": [p for p in pipe.denoiser.parameters() if id(p) not in in_blocks],
             **{f"block {i + 1}": list(b.parameters()) for i, b in enumerate(blocks)},
             "decoder": list(pipe.decoder.parameters())}
    columns: list[tuple[str, dict]] = []
    with torch.no_grad(), lab08.installed(mode, pipe, device, config) as handles:
        streaming = next((h for h in handles if isinstance(h, lab08.LayerwiseOffload)), None)

        def state(unit: str, params) -> str | None:
            if all(p.numel() for p in params):  # an offloaded parameter is an empty placeholder
                return "on"
            ahead = streaming is not None and unit.startswith("block ")
            return "ahead" if ahead and streaming.buffers[int(unit.split()[1]) - 1] is not None else None

        def seen(name, *_):
            columns.append((name, {unit: state(unit, params) for unit, params in units.items()}))

        watched = [("text encoder", pipe.text_encoder), *((f"block {i + 1}", b) for i, b in enumerate(blocks)),
                   ("decoder", pipe.decoder)]
        hooks = [m.register_forward_pre_hook(partial(seen, name)) for name, m in watched]
        try:
            lab08.run_pipeline(pipe, handles, prompt, noise)
        finally:
            for hook in hooks:
                hook.remove()
    return list(units), columns


def residency_schedule():
    """Which weights of Lab 08's toy pipeline are on the device when each part starts to compute,
    under model offload and layerwise offload with one block prefetched: Lab 08's own engines
    installed and run on this CPU (:func:`residency`)."""
    lab08 = labs.load(8)
    config = lab08.Config(denoiser_layers=4, steps=2, mode="model")
    grids = {mode: residency(lab08, mode, config) for mode in ("model", "layerwise")}
    names, _ = grids["model"]
    cw, ch, label_w = 0.16, 0.25, 1.55
    key_h = 0.5
    y_top = key_h + len(names) * ch + 0.25
    fig, ax = canvas(y_top + 0.45)
    titles = {"model": "model offload", "layerwise": "layerwise, k = 1"}
    for g, mode in enumerate(grids):
        units, columns = grids[mode]
        x0 = label_w + g * (len(columns) * cw + 0.22)
        say(ax, x0, y_top + 0.2, titles[mode])
        for t, (running, row) in enumerate(columns):
            for r, unit in enumerate(units):
                y = y_top - (r + 1) * ch
                if row[unit] == "on":
                    box(ax, x0 + t * cw, y, cw, ch, CAT["parameters"], 1.0 if unit == running else LIGHT,
                        outline=False)
                elif row[unit] == "ahead":
                    box(ax, x0 + t * cw, y, cw, ch, PHASE["transfer"], 1.0, "///", outline=False)
            if t and columns[t - 1][0].split()[0] != running.split()[0] or running == "block 1" and t > 1:
                ax.plot([x0 + t * cw] * 2, [y_top - len(units) * ch, y_top], lw=0.5, color=CAT["other"])
        box(ax, x0, y_top - len(units) * ch, len(columns) * cw, len(units) * ch, lw=0.6)
    for r, unit in enumerate(names):
        say(ax, label_w - 0.08, y_top - (r + 0.5) * ch, unit, ha="right")
    key = [("computing", CAT["parameters"], 1.0, None), ("resident", CAT["parameters"], LIGHT, None),
           ("copied ahead", PHASE["transfer"], 1.0, "///")]
    for m, (label, color, alpha, hatch) in enumerate(key):
        kx = 0.1 + m * 1.7
        box(ax, kx, 0.22, 0.16, 0.16, color, alpha, hatch, outline=False)
        say(ax, kx + 0.24, 0.3, label)
    return trim(fig, ax)


# ---------------------------------------------------------------------- activation offload (Lab 09)
def phase_x(tl):
    """Each timeline row's place on a shared axis: forward from 0 to 1, backward from 1 to 2, so that
    runs with different numbers of events line up phase by phase."""
    spans = {s.name: s for s in tl.spans if s.name in ("forward", "backward")}
    out = []
    for i in range(len(tl)):
        f, b = spans["forward"], spans["backward"]
        if i < f.end:
            out.append(max(0.0, (i - f.start) / max(f.end - f.start, 1)))
        else:
            out.append(1 + min(1.0, (i - b.start) / max(b.end - b.start, 1)))
    return out


def activation_offload_flow():
    """One training step of Lab 09's TinyGPT, measured by its own ``measure`` on this CPU: device
    activations without offload (dashed), and with the streamed hooks the device's activations (up)
    against the host copies (down)."""
    lab09 = labs.load(9)
    config = lab09.Config(layers=8)
    model, x, y = lab09.build(config, torch.device("cpu"))
    _, none = lab09.measure(model, x, y, "none")
    _, streamed = lab09.measure(model, x, y, "streamed", **config.knobs)
    a, b = none.timeline(), streamed.timeline()
    unit = 2**20
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6), layout="constrained")
    ax.axvspan(0, 1, color=PHASE["forward"], alpha=0.35, lw=0)
    ax.axvspan(1, 2, color=PHASE["backward"], alpha=0.35, lw=0)
    xb = phase_x(b)
    dev = [v / unit for v in b.device["activations"]]  # saved tensors only: a CPU kernel's scratch varies with threads
    host = [-b.host["host_copies"][i] / unit for i in range(len(b))]
    keep = decimate(dev, 300)
    ax.fill_between([xb[i] for i in keep], 0, [dev[i] for i in keep], step="post", color=CAT["activations"], lw=0,
                    label="on the device, streamed")
    keep = decimate([-v for v in host], 300)
    ax.fill_between([xb[i] for i in keep], 0, [host[i] for i in keep], step="post", color=CAT["host_copies"], lw=0,
                    label="on the host, streamed")
    xa = phase_x(a)
    base = [v / unit for v in a.device["activations"]]
    keep = decimate(base, 300)
    ax.step([xa[i] for i in keep], [base[i] for i in keep], where="post", color=CAT["other"], ls="--", lw=1.4,
            label="on the device, no offload")
    ax.axhline(0, lw=0.8, color=CAT["other"])
    top = max(max(dev), max(base)) * 1.15
    ax.set_ylim(min(host) * 1.15, top)
    ax.set_xlim(0, 2)
    ax.set_xticks([0.5, 1.5], ["forward", "backward"])
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{abs(v):g}"))
    ax.set_ylabel("MiB: device ↑, host ↓")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=FS)
    return fig


# ---------------------------------------------------------------------------- data parallel (Lab 10)
def ddp_buckets():
    """Lab 10's TinyGPT gradients in the order backward produces them, cut into buckets by Lab 10's
    ``derive_buckets`` (DDP's rule; the lab checks it against DDP's own buckets) at the lab's cap,
    and the moment each bucket's all-reduce can start."""
    lab10 = labs.load(10)
    config = lab10.Config()
    from labkit.models import TinyGPT

    model = TinyGPT(config.model_config())
    sizes = [(name, p.numel() * p.element_size()) for name, p in reversed(list(model.named_parameters()))]
    cap = int(config.bucket_cap_mb * MIB)
    buckets = lab10.derive_buckets(sizes, cap)
    nbytes = dict(sizes)
    kib = 1024
    fig, ax = plt.subplots(figsize=(WIDTH, 3.4), layout="constrained")
    x = 0.0
    for _, n in sizes:
        ax.barh(2, n / kib, left=x, color=CAT["gradients"], height=0.55)
        ax.plot([x, x], [1.725, 2.275], lw=0.4, color=CAT["other"])
        x += n / kib
    end, x, busy = x, 0.0, 0.0
    for k, bucket in enumerate(buckets):
        size = sum(nbytes[p] for p in bucket) / kib
        ax.barh(1, size, left=x, fill=False, height=0.55, lw=1.0)
        ax.text(x + size / 2, 1, str(k), ha="center", va="center", fontsize=FS)
        x += size
        start = max(x, busy)  # launched when its bucket is full, after the one before it on the stream
        ax.barh(0, size, left=start, color=CAT["communication"], height=0.55, alpha=1.0 if k % 2 else LIGHT)
        busy = start + size
    ax.axvline(end, color=CAT["other"], ls=":", lw=1.2)
    ax.text(end, 2.45, " backward ends", fontsize=FS, va="bottom", ha="right")
    ax.set_yticks([2, 1, 0], ["gradients\nready", "buckets", "all-reduce"])
    ax.set_ylim(-0.5, 2.9)
    ax.set_xlim(0, busy * 1.02)
    ax.set_xlabel("gradient KiB ready, in backward's order")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig


# -------------------------------------------------------------------------------- ZeRO stages (Lab 01)
def zero_stages():
    """Model state on ONE of 8 ranks training Llama-3-8B in mixed precision with AdamW, for ZeRO
    stages 0 to 3: Lab 01's ``zero_model_state``; the outline is what a rank held at stage 0."""
    lab01 = labs.load(1)
    params, d = zoo.get("llama-3-8b").param_count(), 8
    full = sum(lab01.zero_model_state(params, "mixed", "adamw", 0, d).values()) / GB
    parts = [("parameters", "parameters", None, "bf16 weights"), ("gradients", "gradients", None, "bf16 gradients"),
             ("master_weights", "parameters", "///", "fp32 master copy"),
             ("optimizer_state", "optimizer_state", None, "AdamW's two moments")]
    fig, ax = plt.subplots(figsize=(WIDTH, 3.9), layout="constrained")
    names = ["stage 0 (DDP)", "1: optimizer", "2: + gradients", "3: + weights"]
    for stage in range(4):
        per_rank = lab01.zero_model_state(params, "mixed", "adamw", stage, d)
        left = 0.0
        for key, cat, hatch, _ in parts:
            n = per_rank[key] / GB
            ax.barh(stage, n, left=left, color=CAT[cat], hatch=hatch, alpha=LIGHT if hatch else 1.0, height=0.6)
            left += n
        ax.barh(stage, full, fill=False, height=0.6, lw=0.8, ls="--")
        ax.text(left + 2, stage, f"{left:.0f} GB", va="center", fontsize=FS)
    ax.axvline(80, color=CAT["other"], lw=1.2)
    ax.text(80, -0.55, " an 80 GB card", ha="left", va="bottom", fontsize=FS)
    ax.set_yticks(range(4), names)
    ax.invert_yaxis()
    ax.set_ylim(3.5, -0.9)
    ax.set_xlim(0, full * 1.3)
    ax.set_xticks([0, 40, 80, 120])
    ax.set_xlabel(f"model state on one of {d} ranks (GB)")
    legend_under(ax, [patch(text, CAT[cat], LIGHT if hatch else 1.0, hatch) for _, cat, hatch, text in parts])
    return fig


# --------------------------------------------------------------------------- serving memory (Lab 14)
def paged_block_table():
    """Lab 14's ``PagedKVCache`` at toy size, run on this CPU: three requests (two share a prompt
    prefix) admitted into a pool of 12 blocks of 4 slots, then grown by decoded tokens; each
    request's block table, and the pool's blocks with the slots that hold a token."""
    kv = labs.load(14, "paged_kv")
    store = kv.KVStore(layers=1, slots=48, kv_heads=1, head_dim=1, allocate=False)
    cache = kv.PagedKVCache(store, block_size=4)
    prompt = ("system prompt", 8)
    cache.admit(0, 10, prompt)
    cache.publish_prefix(0, prompt)
    cache.admit(1, 5)
    cache.admit(2, 9, prompt)
    for seq, grow in ((0, 3), (1, 4), (2, 2)):
        for _ in range(grow):
            cache.grow(seq)
    colors = {0: CAT["parameters"], 1: CAT["gradients"], 2: CAT["optimizer_state"]}
    names = {0: "request A", 1: "request B", 2: "request C"}
    owners: dict[int, list[int]] = {}
    for seq, table in cache.tables.items():
        for block in table:
            owners.setdefault(block, []).append(seq)
    slot = 0.088
    bw = 4 * slot
    fig, ax = canvas(3.9, width=4.8)  # the pool's 12 blocks set the width; narrower, the text reads at 12 px on a phone
    # the block tables: logical block i -> physical block table[i]
    say(ax, 0.1, 3.62, "block tables (logical → physical)")
    for r, (seq, table) in enumerate(cache.tables.items()):
        y = 3.15 - r * 0.42
        say(ax, 0.1, y, names[seq])
        for i, block in enumerate(table):
            x0 = 1.55 + i * (bw + 0.1)
            shared = len(owners[block]) > 1
            box(ax, x0, y - 0.17, bw, 0.34, CAT["kv_cache"] if shared else colors[seq], LIGHT)
            say(ax, x0 + bw / 2, y, str(block), ha="center")
    # the pool: physical blocks 0..11, each slot filled when it holds a token
    say(ax, 0.1, 1.58, "the pool: 12 blocks of 4 slots")
    for block in range(cache.num_blocks):
        x0, y0 = 0.1 + block * (bw + 0.03), 0.95
        seqs = owners.get(block, [])
        color = CAT["kv_cache"] if len(seqs) > 1 else colors[seqs[0]] if seqs else None
        for s in range(4):
            if s < cache.fill[block]:
                box(ax, x0 + s * slot, y0, slot, 0.34, color, 1.0, outline=False)
        box(ax, x0, y0, bw, 0.34)
        say(ax, x0 + bw / 2, y0 - 0.2, str(block), ha="center")
    key = [("shared prefix", CAT["kv_cache"]), *((names[s], colors[s]) for s in sorted(names))]
    for m, (label, color) in enumerate(key):
        kx = 0.1 + (m % 2) * 2.3
        ky = 0.42 - (m // 2) * 0.3
        box(ax, kx, ky - 0.08, 0.16, 0.16, color, 1.0, outline=False)
        say(ax, kx + 0.24, ky, label)
    return trim(fig, ax)


# ------------------------------------------------------------------------- memory debugging (Lab 12)
PIECE_MIB = 20  # Lab 12's out_of_memory carves its cached block into pieces of 20 MiB


def fragmented_segment():
    """Lab 12's fragmentation scenario (``out_of_memory(pattern="fragmented")``, a CUDA run): one
    cached segment carved into 20 MiB blocks, every other one freed, then a 40 MiB request; the
    allocator's rules (its source, cited on the page) decide what happens, with and without
    expandable segments."""
    scenarios = labs.load(12, "cuda_scenarios")
    cap = inspect.signature(scenarios.out_of_memory).parameters["cap_mb"].default
    pieces = cap // PIECE_MIB
    held = list(range(pieces))
    del held[::2]  # as the scenario frees every other piece
    live = set(held)
    free_mib = (pieces - len(live)) * PIECE_MIB
    fig, ax = canvas(4.35)
    x0, w = 0.1, WIDTH - 0.2
    piece = w / pieces

    def segment(y, requested=()):
        for i in range(pieces):
            if i in live or i in requested:
                box(ax, x0 + i * piece, y, piece, 0.3, CAT["temporaries" if i in requested else "activations"],
                    outline=False)
            if i:
                ax.plot([x0 + i * piece] * 2, [y, y + 0.3], lw=0.3, color=CAT["other"])
        box(ax, x0, y, w, 0.3)

    say(ax, x0, 4.1, f"1. a {pieces * PIECE_MIB:,} MiB tensor, freed: its segment stays cached")
    box(ax, x0, 3.65, w, 0.3)
    say(ax, x0, 3.3, f"2. cut into {pieces} blocks of {PIECE_MIB} MiB; every other one freed")
    segment(2.85)
    say(ax, x0, 2.6, f"{free_mib} MiB free, no two free blocks side by side:")
    say(ax, x0, 2.3, f"a 40 MiB request is out of memory (cap {cap:,} MiB)")
    say(ax, x0, 1.8, "3. with expandable segments, free pages remap")
    segment(1.35, requested=(0, 2))
    say(ax, x0, 1.1, "the 40 MiB request fits in two free blocks")
    key = [("live tensor", CAT["activations"]), ("cached, free", None), ("40 MiB request", CAT["temporaries"])]
    for m, (label, color) in enumerate(key):
        kx = 0.1 + m * 1.72
        box(ax, kx, 0.52, 0.16, 0.16, color)
        say(ax, kx + 0.24, 0.6, label)
    return trim(fig, ax)


# --------------------------------------------------------------------- model parallelism (Lab 01)
def tensor_parallel_mlp():
    """One MLP split the Megatron way across t = 2 GPUs: the first matrix by columns, the second by
    rows, an all-reduce to finish; boxes to scale in h (the width) and s (the tokens, drawn as tall
    as h). What each GPU holds, whole or a 1/t shard, is what Lab 01's ``activation_bytes_per_layer``
    and ``params_per_rank`` count (the page quotes their numbers)."""
    t, u = 2, 0.34  # GPUs; inches per h
    ffn = 4 * u / t  # each GPU's share of the MLP's 4h
    fig, ax = canvas(3.5)
    row_h, label_w = 1.05, 0.85
    items = [("X", u, u, CAT["activations"], 1.0), ("W₁", ffn, u, CAT["parameters"], 1.0),
             ("Y", ffn, u, CAT["activations"], LIGHT), ("W₂", u, ffn, CAT["parameters"], 1.0),
             ("Z{r}", u, u, CAT["communication"], 1.0), ("Z", u, u, CAT["activations"], 1.0)]
    ops = ["×", "→", "×", "→", None]
    gaps = [0.22, 0.22, 0.22, 0.22, 0.62]
    for r in range(t):
        y_mid = 2.5 - r * row_h
        say(ax, 0.1, y_mid, f"GPU {r}")
        x = label_w
        for k, (name, w, h, color, alpha) in enumerate(items):
            box(ax, x, y_mid - h / 2, w, h, color, alpha)
            say(ax, x + w / 2, y_mid + max(h, u) / 2 + 0.17, name.format(r="₀₁"[r]), ha="center")
            x += w + (gaps[k] if k < len(gaps) else 0)
            if k < len(ops) and ops[k]:
                say(ax, x - gaps[k] / 2, y_mid, ops[k], ha="center")
    z_part = label_w + sum(w for _, w, *_ in items[:4]) + sum(gaps[:4])
    say(ax, z_part + u + 0.31, 2.5 - row_h / 2, "all-\nreduce", ha="center")
    for r in range(t):
        arrow(ax, z_part + u + 0.05, 2.5 - r * row_h, z_part + u + 0.57, 2.5 - r * row_h)
    key = [("whole on every GPU", CAT["activations"], 1.0), ("1/t per GPU", CAT["activations"], LIGHT),
           ("weights, 1/t per GPU", CAT["parameters"], 1.0), ("partial sums", CAT["communication"], 1.0)]
    for m, (label, color, alpha) in enumerate(key):
        kx, ky = 0.1 + (m % 2) * 2.75, 0.75 - 0.3 * (m // 2)
        box(ax, kx, ky - 0.08, 0.16, 0.16, color, alpha, outline=False)
        say(ax, kx + 0.24, ky, label)
    return trim(fig, ax)


def one_f_one_b(stages: int, micro: int, backward: int = 2) -> dict[int, list[tuple[str, int, int, int]]]:
    """The 1F1B schedule (Narayanan et al. 2021): per stage, its ops ``(kind, micro-batch, start,
    length)`` in time units, a forward taking 1 and a backward ``backward``. Stage i runs
    ``stages - 1 - i`` forwards to fill the pipeline, then alternates one forward and one backward,
    then drains; each op waits for its input from the neighbouring stage."""
    order = {}
    for i in range(stages):
        warm = min(stages - 1 - i, micro)
        ops = [("F", j) for j in range(warm)]
        for j in range(micro - warm):
            ops += [("F", warm + j), ("B", j)]
        ops += [("B", j) for j in range(micro - warm, micro)]
        order[i] = ops
    end: dict[tuple[str, int, int], int] = {}
    out: dict[int, list] = {i: [] for i in range(stages)}
    free, pos = dict.fromkeys(range(stages), 0), dict.fromkeys(range(stages), 0)
    while any(pos[i] < len(order[i]) for i in range(stages)):
        for i in range(stages):
            while pos[i] < len(order[i]):
                kind, j = order[i][pos[i]]
                need = ("F", i - 1, j) if kind == "F" and i else ("B", i + 1, j) if kind == "B" and i < stages - 1 \
                    else ("F", i, j) if kind == "B" else None
                if need is not None and need not in end:
                    break
                start = max(free[i], end.get(need, 0))
                length = 1 if kind == "F" else backward
                out[i].append((kind, j, start, length))
                end[(kind, i, j)] = free[i] = start + length
                pos[i] += 1
    return out


def in_flight(ops: list[tuple[str, int, int, int]]) -> int:
    """The most micro-batches a stage has run forward and not yet backward: whose activations it holds."""
    held = most = 0
    for kind, *_ in sorted(ops, key=lambda op: op[2]):
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def pipeline_1f1b():
    """The 1F1B schedule of 4 stages and 6 micro-batches, and how many micro-batches' activations
    each stage holds at most: p - i on stage i, p on the first, as Lab 01's ``Layout.in_flight``
    counts for the activation formula (checked here against the schedule)."""
    lab01 = labs.load(1)
    p, m = 4, 6
    schedule = one_f_one_b(p, m)
    held = [in_flight(schedule[i]) for i in range(p)]
    assert held[0] == lab01.Layout(pp=p).in_flight, (held, lab01.Layout(pp=p).in_flight)
    span = max(start + length for ops in schedule.values() for _, _, start, length in ops)
    label_w, right_w, ch = 0.72, 0.62, 0.3
    cw = (WIDTH - label_w - right_w - 0.1) / span
    fig, ax = canvas(2.75)
    y_top = 2.2
    for i, ops in schedule.items():
        y = y_top - (i + 1) * ch
        say(ax, label_w - 0.08, y + ch / 2, f"stage {i + 1}", ha="right")
        for kind, j, start, length in ops:
            box(ax, label_w + start * cw, y, length * cw, ch, PHASE["forward" if kind == "F" else "backward"], lw=0.5)
            say(ax, label_w + (start + length / 2) * cw, y + ch / 2, str(j + 1), ha="center")
        say(ax, WIDTH - 0.1 - right_w / 2, y + ch / 2, str(held[i]), ha="center")
    say(ax, WIDTH - 0.1 - right_w / 2, y_top + 0.2, "held", ha="center")
    say(ax, label_w, y_top + 0.2, "time →")
    box(ax, label_w, y_top - p * ch, span * cw, p * ch, lw=0.6)
    for m_, (label, color) in enumerate((("forward of micro-batch n", PHASE["forward"]),
                                         ("backward", PHASE["backward"]))):
        kx = 0.1 + m_ * 2.9
        box(ax, kx, 0.55, 0.16, 0.16, color)
        say(ax, kx + 0.24, 0.63, label)
    return trim(fig, ax)


def context_parallel_ring():
    """Ring attention over c = 4 GPUs: each keeps its chunk of the queries and, step by step, passes
    the keys and values it holds to the next GPU, so every query chunk meets every key chunk while
    no GPU holds more than two chunks of K and V (its own and the one arriving)."""
    c = 4
    label_w, cw, ch = 1.05, 0.78, 0.32
    fig, ax = canvas(2.75)
    y_top = 2.15
    say(ax, label_w, y_top + 0.22, "K, V chunk each GPU attends to, step by step")
    for r in range(c):
        y = y_top - (r + 1) * ch
        say(ax, label_w - 0.08, y + ch / 2, f"GPU {r}: Q{r}", ha="right")
        for step in range(c):
            chunk = (r - step) % c
            box(ax, label_w + step * cw, y, cw, ch, CAT["kv_cache"], 1.0 if chunk == r else LIGHT, lw=0.5)
            say(ax, label_w + (step + 0.5) * cw, y + ch / 2, f"KV{chunk}", ha="center")
    for step in range(c):
        say(ax, label_w + (step + 0.5) * cw, y_top - c * ch - 0.2, f"step {step + 1}", ha="center")
    say(ax, 0.1, 0.35, "after each step, every GPU sends its chunk to the next")
    return trim(fig, ax)


FIGURES = {
    "model-state-bytes": model_state_bytes,
    "step-lifetimes": step_lifetimes,
    "autocast-saved": autocast_saved,
    "checkpoint-schedule": checkpoint_schedule,
    "attention-tiles": attention_tiles,
    "accumulation-lanes": accumulation_lanes,
    "offload-placement": offload_placement,
    "residency-schedule": residency_schedule,
    "activation-offload-flow": activation_offload_flow,
    "ddp-buckets": ddp_buckets,
    "zero-stages": zero_stages,
    "paged-block-table": paged_block_table,
    "fragmented-segment": fragmented_segment,
    "tensor-parallel-mlp": tensor_parallel_mlp,
    "pipeline-1f1b": pipeline_1f1b,
    "context-parallel-ring": context_parallel_ring,
}
