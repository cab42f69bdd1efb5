# %% [markdown]
# # Lab 01 · Memory accounting, derived and measured
#
# This notebook uses the Lab 01 starter, `code/lab-01-memory-accounting/memory_accounting.py`, in two
# ways. First as a calculator: the formulas for model state, ZeRO shards, activations and the KV cache,
# applied to a 7B-parameter model. Those figures are **derived**, not measured. Then as an experiment:
# `--measure` runs one training step of the toy GPT under the memory ledger, and the measured bytes are
# set next to the same formulas. It is executed by `scripts/run_notebooks.py`, never edited by hand;
# the provenance cell below says where and when.
#
# What to look for:
#
# 1. Mixed-precision AdamW costs 16 bytes per parameter, the same as fp32 AdamW: mixed precision shrinks
#    the activations that run in 16 bits (Lab 03 measures by how much), not model-state memory.
# 2. ZeRO divides that model state by the number of ranks, one category per stage.
# 3. Activations grow with the sequence, and with stored attention scores they grow with its square.
# 4. On CPU the ledger agrees with the formulas to the byte for parameters, gradients and optimizer
#    state, and with a per-op list of what TinyGPT saves for activations.

# %%
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

import matplotlib.pyplot as plt  # noqa: E402

from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-01-memory-accounting/memory_accounting.py")
toy = sys.modules["toy_gpt"]  # the starter's companion: TinyGPT's shape and what it saves
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
GB = 1e9
print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Bytes per parameter, by recipe (derived)
#
# `model_state_bytes(P, precision, optimizer)` for one parameter, and for a 7B model. The recipes are
# the `RECIPES` table in the starter: fp32; **mixed** (16-bit working weights and gradients, fp32
# master weights and fp32 optimizer moments, as in the ZeRO paper's accounting); pure **bf16** (every
# tensor in bf16, moments included).

# %%
P7 = 7_000_000_000
rows = ["| precision | optimizer | weights | grads | master | state | B/param | 7B model |",
        "|---|---|---:|---:|---:|---:|---:|---:|"]
per_param = {}
for precision in lab.RECIPES:
    for optimizer in lab.MOMENTS:
        one = lab.model_state_bytes(1, precision, optimizer)
        per_param[(precision, optimizer)] = sum(one.values())
        rows.append(f"| {precision} | {optimizer} | {one['parameters']} | {one['gradients']} | "
                    f"{one['master_weights']} | {one['optimizer_state']} | **{sum(one.values())}** | "
                    f"{sum(lab.model_state_bytes(P7, precision, optimizer).values()) / GB:,.0f} GB |")
recipes_table = "\n".join(rows)
nbk.show_markdown(recipes_table)
assert per_param[("mixed", "adamw")] == per_param[("fp32", "adamw")] == 16
assert sum(lab.estimate_bytes(params=P7, precision="mixed").values()) == 112 * 10**9

# %% [markdown]
# ## ZeRO stages 0–3 for a 7B model on 8 ranks (derived)
#
# `zero_model_state(P, "mixed", "adamw", stage, dp=8)`: stage 1 shards the optimizer state (the fp32
# master weights with it), stage 2 also the gradients, stage 3 also the parameters. Every rank keeps
# its own activations, so they are not part of this picture.

# %%
STATE = ("parameters", "gradients", "master_weights", "optimizer_state")
COLORS = {**plot.CATEGORY_COLORS, "master_weights": "#64B5CD"}
stages = {s: lab.zero_model_state(P7, "mixed", "adamw", s, 8) for s in range(4)}
fig, ax = plt.subplots(figsize=(8, 4), dpi=110, layout="constrained")
bottom = [0.0] * 4
for cat in STATE:
    values = [stages[s][cat] / GB for s in range(4)]
    ax.bar([f"stage {s}" for s in range(4)], values, bottom=bottom, color=COLORS[cat], label=cat.replace("_", " "))
    bottom = [b + v for b, v in zip(bottom, values)]
for s, top in enumerate(bottom):
    ax.text(s, top + 1.5, f"{top:.2f} GB", ha="center", fontsize=9)
ax.set(ylabel="model-state bytes per rank (GB, 1e9)", ylim=(0, 125),
       title="7B parameters, mixed precision AdamW, 8 data-parallel ranks (derived)")
ax.legend(fontsize=8, frameon=False)
ax.grid(axis="y", alpha=0.3)
plot.save(fig, OUT / "zero_stages.svg")

# %%
rows = ["| stage | also sharded | weights | grads | master | state | per rank |", "|---:|---|---:|---:|---:|---:|---:|"]
sharded = {0: "nothing", 1: "state, master", 2: "gradients", 3: "weights"}
for s, b in stages.items():
    rows.append(f"| {s} | {sharded[s]} | " + " | ".join(f"{b[c] / GB:.2f} GB" for c in STATE)
                + f" | **{sum(b.values()) / GB:.2f} GB** |")
zero_table = "\n".join(rows)
nbk.show_markdown(zero_table)
assert sum(stages[0].values()) == 112 * 10**9 and sum(stages[3].values()) == 14 * 10**9

# %% [markdown]
# ## Activations against sequence length (derived)
#
# Korthikanti et al.'s per-layer formula for a 7B-class shape (32 layers, hidden 4096, 32 heads, one
# sequence per rank) in mixed precision: 16-bit activations, 1-byte dropout masks. Three policies:
# keep everything (`none`, the `5as/h` term grows with the square of the sequence), recompute the
# attention scores (`selective`), or keep only each layer's input and recompute the rest (`full`).

# %%
SHAPE7 = dict(layers=32, hidden=4096, heads=32, batch=1, vocab=50304)
seqs = [512, 1024, 2048, 4096, 8192, 16384, 32768]
act = {r: [lab.estimate_bytes(shape=toy.Shape(seq=s, **SHAPE7), precision="mixed", recompute=r)["activations"]
           for s in seqs] for r in ("none", "selective", "full")}
state7 = sum(lab.model_state_bytes(toy.param_count(toy.Shape(seq=2048, **SHAPE7)), "mixed", "adamw").values())
fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110, layout="constrained")
for r, style in (("none", "-o"), ("selective", "-s"), ("full", "-^")):
    ax.plot(seqs, [v / GB for v in act[r]], style, label=f"recompute={r}", ms=4)
ax.axhline(state7 / GB, color="#8172B3", ls="--", lw=1.2, label="model state, mixed AdamW (16 B x P)")
ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="activation bytes (GB, 1e9)",
       title="Activations of a 7B-class model, batch 1, mixed precision (derived)")
ax.set_xticks(seqs, [str(s) for s in seqs])
ax.legend(fontsize=8, frameon=False)
ax.grid(alpha=0.3, which="both")
plot.save(fig, OUT / "activations_vs_seq.svg")

# %%
rows = ["| sequence | none (keep all) | selective (scores) | full (all) |", "|---:|---:|---:|---:|"]
for i, s in enumerate(seqs):
    rows.append(f"| {s} | " + " | ".join(f"{act[r][i] / GB:,.2f} GB" for r in ("none", "selective", "full")) + " |")
act_table = "\n".join(rows)
nbk.show_markdown(act_table)
s2048 = seqs.index(2048)
assert act["selective"][s2048] == 32 * 34 * 2048 * 4096 and act["full"][s2048] == 32 * 2 * 2048 * 4096

# %% [markdown]
# ## KV cache for inference (derived)
#
# `kv_cache_bytes`: a key and a value per layer, token and KV head, in bf16. Grouped-query attention
# (8 KV heads for 32 query heads) divides it by 4. Each cache is set against the bf16 weights of a 7B
# model, 2 B × 7e9. Sizes in GB (1e9 bytes), like the other 7B tables.

# %%
weights_bf16 = 2 * P7
rows = ["| sequence | batch | 32 KV heads (MHA) | 8 KV heads (GQA) | MHA ÷ bf16 weights | GQA ÷ bf16 weights |",
        "|---:|---:|---:|---:|---:|---:|"]
kv = {}
for s, b in ((4096, 1), (4096, 8), (32768, 1), (32768, 8)):
    mha, gqa = (lab.kv_cache_bytes(toy.Shape(layers=32, hidden=4096, heads=32, seq=s, batch=b, vocab=32000,
                                             kv_heads=k), act=2) for k in (32, 8))
    kv[(s, b)] = (mha, gqa)
    rows.append(f"| {s:,} | {b} | {mha / GB:,.2f} GB | {gqa / GB:,.2f} GB | {mha / weights_bf16:.2f}× "
                f"| {gqa / weights_bf16:.2f}× |")
kv_table = "\n".join(rows)
nbk.show_markdown(kv_table)
mha, gqa = kv[(32768, 8)]
assert mha == 4 * gqa
kv_claim = (f"At 32,768 tokens and batch 8 the cache takes {mha / GB:,.1f} GB with all 32 KV heads and "
            f"{gqa / GB:,.1f} GB with 8, against {weights_bf16 / GB:,.0f} GB of bf16 weights (2 B × 7e9): "
            f"grouped-query attention divides the cache by 4, and it is still {gqa / weights_bf16:.1f} times "
            f"{'the weights' if gqa > weights_bf16 else 'smaller than the weights'}.")
nbk.show_markdown(kv_claim)

# %% [markdown]
# ## One step of TinyGPT under the ledger (measured)
#
# `lab.measure` is what the `--measure` flag calls: the toy GPT of the default shape, fp32, one AdamW
# step. On CPU the ledger counts `storage.nbytes()` of every tensor, so formula and measurement must agree
# to the byte for parameters, gradients and optimizer state. For activations there are two derivations:
# the paper's formula, and the list in `toy_gpt.py` of what each op of TinyGPT saves. On a GPU, AdamW keeps
# its `step` counters on the host unless `capturable` or `fused` is set (`torch/optim/adam.py`), so the
# device's optimizer state is derived as 8 B × P there, and the counters get a row of their own.

# %%
SIZE = (["--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "512", "--batch", "8", "--vocab", "8192"]
        if ON_GPU else [])
args = lab.parse_args(["--device", DEVICE.type, "--measure", *SIZE])
shape = toy.Shape(**{n: getattr(args, n) for n in lab.SHAPE_FLAGS})
est = lab.estimate_bytes(shape=shape, precision=args.precision, optimizer=args.optimizer, dropout=args.dropout > 0)
run = lab.measure(args, shape)
m, tiny = run["measured"], run["tinygpt_activations"]
P = toy.param_count(shape)
print(f"TinyGPT {shape}: {P:,} parameters in {toy.param_tensors(shape)} tensors, loss {run['loss']:.4f}")
toy_config = (f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, sequence {shape.seq}, "
              f"batch {shape.batch}, vocabulary {shape.vocab}, dropout {args.dropout:g}, {args.precision}")

rows = ["| category | measured (B) | derived (B) | gap (B) | derived by |", "|---|---:|---:|---:|---|"]
T = toy.param_tensors(shape)
opt_check = ((est["optimizer_state"] - 4 * T, "8 B × P (the 4 B × T step counters sit on the host)") if ON_GPU
             else (est["optimizer_state"], f"8 B × P + 4 B × {T} tensors"))
checks = [("parameters", est["parameters"], "4 B × P"), ("gradients", est["gradients"], "4 B × P"),
          ("optimizer_state", *opt_check)]
checks += [("optimizer_state_on_host", 4 * T, f"4 B × {T} step counters, on the host")] if ON_GPU else []
checks += [
          ("activations", est["activations"], "the paper's formula, layers only, e=4, m=1"),
          ("activations", tiny["total"], "TinyGPT's saved tensors, op by op")]
for cat, derived, how in checks:
    rows.append(f"| {cat.replace('_', ' ')} | {m[cat]:,} | {derived:,} | {m[cat] - derived:+,} | {how} |")
measure_table = "\n".join(rows)
nbk.show_markdown(measure_table)
if run["exact"]:
    for cat in ("parameters", "gradients", "optimizer_state"):
        assert m[cat] == est[cat], cat
    assert m["activations"] == tiny["total"]

# %% [markdown]
# ### The mixed recipe, measured
#
# `--measure --precision mixed` runs the recipe the `mixed` row describes, on the same shape: a bf16
# working copy of the model (forward and backward run on it, so parameters, gradients and activations are
# 16-bit), an fp32 master copy of every parameter, and AdamW stepping the masters with fp32 moments. In the
# optimizer phase each bf16 gradient is copied to fp32 for its master (a temporary), and after the step
# each master is rounded back into the working copy. Model state should come to 2 + 2 + 4 + 8 = 16 bytes
# per parameter, plus the step counters.

# %%
mixed_args = lab.parse_args(["--device", DEVICE.type, "--measure", "--precision", "mixed", *SIZE])
mixed_est = lab.estimate_bytes(shape=shape, precision="mixed", optimizer=mixed_args.optimizer,
                               dropout=mixed_args.dropout > 0)
mixed = lab.measure(mixed_args, shape)
mm = mixed["measured"]
rows = ["| category | measured (B) | derived (B) | bytes per parameter | derived by |", "|---|---:|---:|---:|---|"]
mixed_checks = [("parameters", "2 B × P (bf16 working copy)"), ("gradients", "2 B × P (bf16)"),
                ("master_weights", "4 B × P (fp32)"), ("optimizer_state", f"8 B × P + 4 B × {T} tensors (fp32)")]
for cat, how in mixed_checks:
    rows.append(f"| {cat.replace('_', ' ')} | {mm[cat]:,} | {mixed_est[cat]:,} | {mm[cat] / P:.2f} | {how} |")
state_sum = sum(mm[cat] for cat, _ in mixed_checks)
rows.append(f"| **model state** | **{state_sum:,}** | **{sum(mixed_est[c] for c, _ in mixed_checks):,}** | "
            f"**{state_sum / P:.2f}** | 16 B × P + 4 B × {T} |")
mixed_table = "\n".join(rows)
nbk.show_markdown(mixed_table)
print(f"mixed: loss {mixed['loss']:.4f}; activations {mm['activations']:,} B against {m['activations']:,} B in fp32")
if mixed["exact"]:
    for cat, _ in mixed_checks:
        assert mm[cat] == mixed_est[cat], cat
    assert state_sum == 16 * P + 4 * T

# %% [markdown]
# ### Why TinyGPT keeps more than the paper's formula says (derived, term by term)
#
# The paper counts a Megatron layer in 16-bit with 1-byte masks and nothing outside the layers. The
# rows below are the differences, each computed by `gap_to_paper`; the paper's figure plus these rows
# is the measured figure.

# %%
rows = ["| term | bytes |", "|---|---:|", f"| paper's formula for the {shape.layers} layers (e=4, m=1) | "
        f"{est['activations']:,} |"]
rows += [f"| + {why} | {n:+,} |" for why, n in run["gap_to_paper"]]
rows.append(f"| **= TinyGPT's saved tensors** | **{est['activations'] + sum(n for _, n in run['gap_to_paper']):,}** |")
rows.append(f"| measured by the ledger at the end of forward | {m['activations']:,} |")
gap_table = "\n".join(rows)
nbk.show_markdown(gap_table)
if run["exact"]:
    assert est["activations"] + sum(n for _, n in run["gap_to_paper"]) == m["activations"]

# %% [markdown]
# ### What one layer saves, op by op
#
# `tinygpt_saved_tensors` for layer 0 of the same run, next to the paper's terms. The paper's sixteen
# `s·b·h` units are there: eight h-wide tensors and two 4h-wide ones (1 + 1 + 3 + 1 + 1 + 1 + 4 + 4);
# with dropout on, the CPU keeps
# noise tensors in fp32 where the paper keeps 1-byte masks, and the attention probabilities are
# materialised because PyTorch's CPU flash kernel does not do dropout.

# %%
cfg = lab.GPTConfig(vocab=shape.vocab, seq_len=shape.seq, width=shape.hidden, layers=shape.layers,
                    heads=shape.heads, dropout=args.dropout)
saved = toy.tinygpt_saved_tensors(cfg, shape.batch, elem=4)
rows = ["| where | tensor kept for backward | bytes |", "|---|---|---:|"]
rows += [f"| {w} | {what} | {n:,} |" for w, what, n in saved if w in ("embedding", "layer 0", "head")]
saved_table = "\n".join(rows)
nbk.show_markdown(saved_table)

# %% [markdown]
# ## The step on the ledger's timeline (measured)
#
# The two dashed lines are derived: parameters plus TinyGPT's saved tensors (the stack must touch it at
# the end of forward), and the model state after the step (parameters + gradients + AdamW state).

# %%
tl = run["ledger"].timeline()
forward = next(s for s in tl.spans if s.name == "forward")
n = len(tl)
fig = plot.plot_timeline(tl, title=f"Lab 01 · one AdamW step of TinyGPT on {DEVICE.type} (measured by the ledger)",
                         overlay={"derived: parameters + saved tensors": [est["parameters"] + tiny["total"]] * n,
                                  "derived: model state after the step": [est["parameters"] + est["gradients"]
                                                                          + est["optimizer_state"]] * n})
plot.save(fig, OUT / "timeline.svg")
total = tl.device_total()
print(f"at the end of forward: {total[forward.end - 1]:,} B live; peak {max(total):,} B at event {total.index(max(total))}")
if run["exact"]:
    assert total[forward.end - 1] == est["parameters"] + tiny["total"]
    assert total[-1] == est["parameters"] + est["gradients"] + est["optimizer_state"]  # the loss is gone too

# %% [markdown]
# ## Measured activations against sequence length (TinyGPT)
#
# The same measurement at several sequence lengths, with and without dropout. With dropout, PyTorch's
# CPU attention falls back to the math path and keeps the N×N probabilities: the curve bends up with
# the square of the sequence. Without dropout, the flash kernel keeps one number per row and the curve
# stays linear. The paper's formula is drawn for the matching policy: scores kept (`none`) with dropout,
# scores not kept (`selective`) without. Points are measured; lines are derived.

# %%
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--batch", "2", "--vocab", "64"]
sweep = [64, 128, 256, 512] if not ON_GPU else [256, 512, 1024, 2048]
curves = {}
for dropout in (0.1, 0.0):
    pts = []
    for s in sweep:
        a = lab.parse_args(["--device", DEVICE.type, "--measure", *SMALL, "--seq", str(s), "--dropout", str(dropout)])
        sh = toy.Shape(**{k: getattr(a, k) for k in lab.SHAPE_FLAGS})
        r = lab.measure(a, sh)
        policy = "none" if dropout else "selective"  # flash attention keeps no scores, like selective recompute
        paper = lab.estimate_bytes(shape=sh, dropout=dropout > 0, recompute=policy)["activations"]
        pts.append((s, r["measured"]["activations"], r["tinygpt_activations"]["total"], paper))
    curves[dropout] = pts
fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110, layout="constrained")
for (dropout, pts), color in zip(curves.items(), ("#C44E52", "#4C72B0")):
    label = "dropout 0.1: scores kept" if dropout else "dropout 0: flash, no scores"
    ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], "o", color=color, ms=7, label=f"measured, {label}")
    ax.plot([p[0] for p in pts], [p[2] / 2**20 for p in pts], "-", color=color, lw=1.2, label="derived: TinyGPT list")
    policy = "scores kept" if dropout else "scores not kept (selective)"
    ax.plot([p[0] for p in pts], [p[3] / 2**20 for p in pts], ":", color=color, lw=1.2,
            label=f"derived: paper, {policy}, e=4")
ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="activation bytes (MiB)",
       title=f"TinyGPT activations on {DEVICE.type}: measured points, derived lines")
ax.set_xticks(sweep, [str(s) for s in sweep])
ax.minorticks_off()
ax.legend(fontsize=7.5, frameon=False)
ax.grid(alpha=0.3, which="both")
plot.save(fig, OUT / "toy_activations_vs_seq.svg")

# %%
rows = ["| seq | dropout | measured (B) | TinyGPT list (B) | paper, e=4 (B) | measured / paper |",
        "|---:|---:|---:|---:|---:|---:|"]
for dropout, pts in curves.items():
    for s, meas, lst, paper in pts:
        rows.append(f"| {s} | {dropout} | {meas:,} | {lst:,} | {paper:,} | {meas / paper:.3f} |")
        if DEVICE.type == "cpu":
            assert meas == lst, (s, dropout)
sweep_table = "\n".join(rows)
nbk.show_markdown(sweep_table)

# %% [markdown]
# ## Results written for the page

# %%
import dataclasses  # noqa: E402

from labkit.provenance import write_results  # noqa: E402

summary = {
    "lab": lab.LAB, "device": str(DEVICE), "shape": dataclasses.asdict(shape),
    "params": P, "measured": m, "derived": est, "tinygpt_activations": tiny,
    "mixed": {"measured": mm, "derived": mixed_est, "peak_bytes": mixed["peak_bytes"]},
    "gap_to_paper": run["gap_to_paper"], "peak_bytes": run["peak_bytes"], "cuda": run["cuda"],
    "sweep": {str(k): v for k, v in curves.items()},
    "derived_7b": {"mixed_adamw_bytes": sum(stages[0].values()), "zero3_dp8_bytes_per_rank": sum(stages[3].values())},
}
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE))
tables = {"recipes": recipes_table, "zero_stages": zero_table, "activations_7b": act_table, "kv_cache": kv_table,
          "kv_claim": kv_claim, "toy_config": toy_config, "measure": measure_table, "measure_mixed": mixed_table,
          "gap": gap_table, "saved": saved_table, "sweep": sweep_table}
# sentences a page includes mid-paragraph: a final newline would end its paragraph there
PROSE = {"kv_claim", "toy_config"}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text if name in PROSE else text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
