# %% [markdown]
# # Lab 15 · Fine-tuning on one GPU, measured and traced
#
# This notebook runs the Lab 15 starter, `code/lab-15-fine-tuning/finetune.py`: LoRA, QLoRA's 4-bit
# NormalFloat base and the 8-bit AdamW on a small Llama (the zoo's architecture at toy width), every
# byte counted by the ledger in the categories a reader can name. Then the same pieces at real size,
# through Lab 13's trace on fake tensors (`finetune_scale.py`), and published single-GPU peaks held
# against their traces. It is executed by `scripts/run_notebooks.py`, never edited by hand.
#
# What to look for:
#
# 1. On the toy, each model-state category equals its formula to the byte, and QLoRA's frozen weights
#    are a quarter of LoRA's bf16 base.
# 2. At real size the 4-bit weights are the small part: activations grow with tokens x hidden size
#    whatever the rank, and they decide whether Llama-3-8B fits a 24 GB card.
# 3. Published peaks against traces: what the published stack does that the trace does not, sized.

# %%
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import Table

nb = notebook.setup(15)
lab = nb.lab
scale = labs.load(15, "finetune_scale")
GPUS = labs.load(13, "fit_gpus").GPUS

# %% [markdown]
# ## The toy: three methods, every category
#
# The same toy Llama (2 blocks of width 128, 4 sequences of 64 tokens) trained 4 steps with every
# weight (bf16, torch's AdamW), with LoRA on a bf16 base, and with QLoRA (NF4 base, bf16 adapters) and
# the 8-bit AdamW. Measured on this machine's tensors (exact bytes on a CPU).

# %%
METHODS = {"full, bf16, AdamW": dict(method="full", optimizer="adamw"),
           "LoRA r8, bf16, AdamW": dict(method="lora", optimizer="adamw"),
           "QLoRA r8, bf16, 8-bit AdamW": dict(method="qlora", optimizer="adamw8bit")}
toys = {name: lab.run(lab.Config(device=nb.device.type, precision="bf16", **fields)) for name, fields in METHODS.items()}
qlora_toy = toys["QLoRA r8, bf16, 8-bit AdamW"]
names = [c for c in lab.NAMES if any(max(r.ledger.timeline().device[c]) for r in toys.values())]
heads = lab.NAMES | {"parameters": "trained (adapters)", "gradients": "their gradients"}  # full trains every weight
toy = Table(["method", *((heads[c], "bytes") for c in names)],
            [[name, *(max(r.ledger.timeline().device[c]) for c in names)] for name, r in toys.items()], unit="KiB")
checks = qlora_toy.checks()
display(toy, checks)
fig_toy = plot.plot_timeline(qlora_toy.ledger.timeline().step_window(3), title="Toy Llama, QLoRA + 8-bit AdamW, one step (measured, CPU)")
fig_toy.set_layout_engine("none")

# %% [markdown]
# ## At real size: the page's questions
#
# Each of `finetune_scale.ANSWERS` through Lab 13: the model on fake tensors, Lab 15's `prepare` applied
# (QLoRA: every linear of the blocks in NF4, rank-16 adapters on q, k, v, o, gate, up and down), one
# steady-state step under the ledger, rounded as the CUDA allocator rounds. Where a step does not fit its
# GPU, Lab 13's ladder pulls levers, cheapest first, re-tracing each time.

# %%
answers = {name: scale.answer(name) for name in scale.ANSWERS}


def lever_text(result):
    fit = next((r for r in result.levers if r["together"] and r["together"]["fits"]), None)
    return "-" if result.trace.fits else ("with " + fit["name"]) if fit else "no lever fits"


def to_fit(result):
    fit = next((r for r in result.levers if r["together"] and r["together"]["fits"]), None)
    return fit["together"]["per_rank_peak_bytes"] if fit else None


questions = Table(["question", ("peak", "bytes"), "GPU", ("usable", "bytes"), ("fits", "yes"), "to fit", ("then", "bytes")],
                  [[scale.ANSWERS[n][0], r.trace.per_rank_peak_bytes, r.config.gpu,
                    GPUS[r.config.gpu].capacity_bytes, r.trace.fits, lever_text(r), to_fit(r)] for n, r in answers.items()],
                  unit="GiB")
display(questions)
q2k = answers["qlora_8b_2k"].trace
fig_8b = plot.plot_timeline(q2k.timeline.step_window(1), title="Llama-3-8B, QLoRA r16, 2,048 tokens (traced)")
fig_8b.set_layout_engine("none")
phases_8b = labs.load(13, "fit_report").phases_table(q2k)
display(phases_8b)

# %% [markdown]
# ## The rank against the tokens
#
# QLoRA on Llama-3-8B, traced at ranks 8, 16 and 64 at 2,048 tokens, and at rank 16 at 1,024 to 8,192
# tokens: the adapters' bytes follow the rank; the activations follow the tokens.

# %%
sweep = {}
for rank, seq in ((8, 2048), (64, 2048), (16, 1024), (16, 4096)):
    sweep[(rank, seq)] = labs.load(13).trace(labs.load(13).Config(model="llama-3-8b", method="qlora", precision="bf16",
                                                                  lora_rank=rank, seq=seq, levers="none"))
sweep[(16, 2048)], sweep[(16, 8192)] = q2k, answers["qlora_8b_8k"].trace
order = sorted(sweep, key=lambda k: (k[1], k[0]))
ranks = Table(["rank", ("tokens", "int"), ("adapters", "bytes"), ("frozen weights", "bytes"), ("activations", "bytes"),
               ("peak", "bytes")],
              [[r, s, sweep[(r, s)].derived["category_max"]["parameters"], sweep[(r, s)].derived["category_max"]["frozen_weights"],
                sweep[(r, s)].derived["category_max"]["activations"], sweep[(r, s)].per_rank_peak_bytes] for r, s in order],
              unit="GiB")
display(ranks)

# %% [markdown]
# ## Published peaks beside their traces
#
# Each published single-GPU LoRA or QLoRA peak whose whole configuration is published, traced the same
# way (`finetune_scale.PUBLISHED`), with what the published stack does that the trace does not: each
# difference cited, sized from the shapes where it can be, and what is left unexplained said as such.
# Rows that cannot be expressed yet say why. This cell takes a few minutes: Llama 2 7B and 13B in NF4.

# %%
compared = scale.compare()
published = scale.published_table(compared)
sources = scale.sources_table(compared)
display(published, sources)

# %%
real_scale = [{"name": n, "inputs": {k: v for k, v in scale.ANSWERS[n][1].items() if k != "gpu"},
               "per_rank_peak_bytes": r.trace.per_rank_peak_bytes, "peak_phase": r.trace.derived["peak_phase"],
               "by_category": r.trace.derived["peak"]} for n, r in answers.items()]
real_scale += [{"name": f"qlora_8b_r{r}_s{s}", "inputs": dict(model="llama-3-8b", method="qlora", precision="bf16",
                                                               lora_rank=r, seq=s),
                "per_rank_peak_bytes": t.per_rank_peak_bytes, "peak_phase": t.derived["peak_phase"],
                "by_category": t.derived["peak"]} for (r, s), t in sweep.items() if (r, s) not in ((16, 2048), (16, 8192))]
d2k = q2k.derived
notebook.publish(
    nb, tables={"toy": toy, "checks": checks, "questions": questions, "phases_8b": phases_8b, "ranks": ranks,
                "published": published, "sources": sources},
    figures={"timeline_toy": fig_toy, "timeline_8b": fig_8b},
    toy=qlora_toy.summary(), real_scale=real_scale,
    answers={n: {"peak": r.trace.per_rank_peak_bytes, "fits": r.trace.fits, "gpu": r.config.gpu,
                 "capacity": GPUS[r.config.gpu].capacity_bytes, "lever": lever_text(r), "to_fit": to_fit(r),
                 "by_category": r.trace.derived["peak"], "seconds": r.trace.seconds} for n, r in answers.items()},
    activations_8b_2k=d2k["category_max"]["activations"], frozen_8b=d2k["category_max"]["frozen_weights"],
    constants_8b=d2k["category_max"]["quant_constants"], adapters_8b=d2k["category_max"]["parameters"],
    dequantized_8b=d2k["category_max"]["dequantized"],
    published_rows=[{"name": c.row.name, "published": c.row.published, "traced": None if c.traced is None else
                     c.traced.per_rank_peak_bytes, "gap": c.gap, "remainder": c.remainder} for c in compared])
