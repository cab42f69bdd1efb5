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
import importlib.util
import sys
import warnings

from IPython.display import display

from labkit import labs, notebook, plot
from labkit.provenance import REPO_ROOT
from labkit.table import Table

warnings.filterwarnings("ignore", message="IProgress not found")  # transformers' tqdm.auto, in a kernel without widgets
nb = notebook.setup(15)
lab = nb.lab
scale = labs.load(15, "finetune_scale")
lab13, report13 = labs.load(13), labs.load(13, "fit_report")
GPUS = labs.load(13, "fit_gpus").GPUS
fit, Inputs = labs.load(1, "fit_formula"), labs.load(1, "fit_inputs").Inputs  # the calculator's formulas

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
notebook.show(fig_toy, alt="Stacked memory timeline of one measured toy QLoRA step with the 8-bit AdamW by category: "
                           "frozen NF4 weights, constants, adapters, dequantized weights, activations")

# %% [markdown]
# ## At real size: the page's questions
#
# Each of `finetune_scale.ANSWERS` through Lab 13: the model on fake tensors, Lab 15's `prepare` applied
# (QLoRA: every linear of the blocks in NF4, rank-16 adapters on q, k, v, o, gate, up and down), one
# steady-state step under the ledger, rounded as the CUDA allocator rounds, and the step in reserved
# bytes with the CUDA context (Lab 16's model of the allocator) against the GPU's total: traced once.
# Where it does not fit, the lever is the calculator's ladder (Lab 13's levers, cheapest first, on the
# formulas: derived); Lab 13's own ladder re-traces each rung, several minutes of CPU for Llama-3-70B.
#
# One question is answered by the calculator's formulas alone (derived): the full fine-tune with the
# 8-bit AdamW. Its trace runs the optimizer over all 8 billion values in chunks of 524,288, about 15,000
# chunks of some 60 operations each, twice (the state's first step, then the traced one): minutes of
# CPU for one number. `tests/test_fit_formula.py` holds the same formulas to Lab 13's trace of the same
# code (a full fine-tune with the 8-bit AdamW among them) within 0.5 % on a small model.

# %%
spec = importlib.util.spec_from_file_location("fit_table", REPO_ROOT / "scripts" / "fit_table.py")
fit_table = sys.modules["fit_table"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
spec.loader.exec_module(fit_table)  # the calculator's ladder: Lab 13's levers on the formulas
DERIVED = ("full_8bit_h100",)
answers = {name: lab13.run(lab13.Config(levers="none", **flags)) for name, (_, flags) in scale.ANSWERS.items()
           if name not in DERIVED}


def inputs(flags: dict):
    return Inputs(**{k: v for k, v in flags.items() if k != "gpu"})


def lever(flags: dict, fits: bool) -> tuple[str, int | None]:
    """The calculator's ladder for a step that does not fit: the levers it keeps, and the peak then (derived)."""
    if fits:
        return "-", None
    rungs = [r for r in fit_table.ladder(inputs(flags), flags["gpu"]) if r["kept"]]
    if not rungs or not rungs[-1]["fits"]:
        return "no lever fits", None
    return "with " + " and ".join(r["name"] for r in rungs), rungs[-1]["total"]


def traced_answer(name: str, result) -> dict:
    t, g, flags = result.trace, GPUS[result.config.gpu], scale.ANSWERS[name][1]
    text, then = lever(flags, t.fits)
    return {"how": "traced", "peak": t.per_rank_peak_bytes, "need": t.reserved["need_bytes"], "gpu": result.config.gpu,
            "total": g.total_bytes, "capacity": g.capacity_bytes, "fits": t.fits, "lever": text, "to_fit": then,
            "by_category": t.derived["peak"], "seconds": t.seconds}


def derived_answer(flags: dict) -> dict:
    """The calculator's formulas (Lab 01's fit_formula.py) for Lab 13's flags: the peak, and whether it is
    within the GPU's usable bytes (its total less the CUDA context and the allocator's headroom, derived)."""
    g, verdict = GPUS[flags["gpu"]], fit_table.verdict(inputs(flags), flags["gpu"])
    text, then = lever(flags, verdict["fits"])
    return {"how": "derived", "peak": verdict["total"], "need": None, "gpu": flags["gpu"], "total": g.total_bytes,
            "capacity": g.capacity_bytes, "fits": verdict["fits"], "lever": text, "to_fit": then,
            "by_category": fit.estimate(inputs(flags)), "moment": verdict["moment"]}


said = {n: traced_answer(n, r) for n, r in answers.items()} | {n: derived_answer(scale.ANSWERS[n][1]) for n in DERIVED}
questions = Table(["question", "how", ("peak", "bytes"), ("with the allocator and context", "bytes"), "GPU",
                   ("its total", "bytes"), ("fits", "yes"), "to fit (the calculator's ladder)", ("then, derived", "bytes")],
                  [[scale.ANSWERS[n][0], a["how"], a["peak"], a["need"], a["gpu"], a["total"], a["fits"], a["lever"],
                    a["to_fit"]] for n, a in ((n, said[n]) for n in scale.ANSWERS)], unit="GiB")
display(questions)
q2k = answers["qlora_8b_2k"].trace
fig_8b = plot.plot_timeline(q2k.timeline.step_window(1), title="Llama-3-8B, QLoRA r16, 2,048 tokens (traced)")
notebook.show(fig_8b, alt="Stacked memory timeline of one traced Llama-3-8B QLoRA rank-16 step at 2,048 tokens by "
                          "category: a thin frozen NF4 base under activations that rise through forward")
phases_8b = report13.phases_table(q2k)
display(phases_8b)

# %% [markdown]
# ## The rank against the tokens
#
# QLoRA on Llama-3-8B at ranks 8, 16 and 64 at 2,048 tokens, and at rank 16 from 1,024 to 8,192 tokens,
# by the calculator's formulas (derived; within 0.1 % of the traces above where they meet): the
# adapters' bytes follow the rank; the activations follow the tokens.

# %%
sweep = {}
for rank, seq in ((8, 2048), (16, 2048), (64, 2048), (16, 1024), (16, 4096), (16, 8192)):
    x = Inputs(model="llama-3-8b", method="qlora", precision="bf16", lora_rank=rank, seq=seq)
    sweep[(rank, seq)] = fit.estimate(x)
for (rank, seq), name in (((16, 2048), "qlora_8b_2k"), ((16, 8192), "qlora_8b_8k")):  # the formula against its trace
    traced, derived = said[name]["peak"], sum(sweep[(rank, seq)].values())
    assert abs(derived - traced) <= 1e-3 * traced, (name, derived, traced)
order = sorted(sweep, key=lambda k: (k[1], k[0]))
ranks = Table(["rank", ("tokens", "int"), ("adapters", "bytes"), ("frozen weights", "bytes"), ("activations", "bytes"),
               ("peak", "bytes")],
              [[r, s, sweep[(r, s)]["parameters"], sweep[(r, s)]["frozen_weights"], sweep[(r, s)]["activations"],
                sum(sweep[(r, s)].values())] for r, s in order], unit="GiB")
display(ranks)

# %% [markdown]
# ## The loss in chunks
#
# The 8,192-token QLoRA step with every block checkpointed (as torchtune's single-device QLoRA recipes set
# it), traced twice: with the model's own loss (every token's logits at once, their float32 copy and
# gradient) and with Lab 13's chunked loss (`--loss chunked`: 8 chunks, each recomputed in backward).

# %%
loss_8b_8k = {loss: lab13.trace(lab13.Config(model="llama-3-8b", method="qlora", precision="bf16", seq=8192,
                                              checkpointing="full", loss=loss, levers="none")).per_rank_peak_bytes
              for loss in ("full", "chunked")}
print({k: f"{v / 2**30:.1f} GiB" for k, v in loss_8b_8k.items()})

# %% [markdown]
# ## Published peaks beside their traces
#
# Each published single-GPU LoRA or QLoRA peak whose whole configuration is published, traced the same
# way (`finetune_scale.PUBLISHED`), with what the published stack does that the trace does not: each
# difference cited, sized from the shapes where it can be, and what is left unexplained said as such.
# Rows that cannot be expressed yet say why.

# %%
compared = scale.compare()
published = scale.published_table(compared)
sources = scale.sources_table(compared)
display(published, sources)

# %%
real_scale = [{"name": n, "inputs": {k: v for k, v in scale.ANSWERS[n][1].items() if k != "gpu"},
               "per_rank_peak_bytes": r.trace.per_rank_peak_bytes, "peak_phase": r.trace.derived["peak_phase"],
               "by_category": r.trace.derived["peak"]} for n, r in answers.items()]
d2k = q2k.derived
notebook.publish(
    nb, tables={"toy": toy, "checks": checks, "questions": questions, "phases_8b": phases_8b, "ranks": ranks,
                "published": published, "sources": sources},
    figures={"timeline_toy": fig_toy, "timeline_8b": fig_8b},
    toy=qlora_toy.summary(), real_scale=real_scale, answers=said, loss_8b_8k=loss_8b_8k,
    activations_8b_2k=d2k["category_max"]["activations"], frozen_8b=d2k["category_max"]["frozen_weights"],
    constants_8b=d2k["category_max"]["quant_constants"], adapters_8b=d2k["category_max"]["parameters"],
    dequantized_8b=d2k["category_max"]["dequantized"],
    published_rows=[{"name": c.row.name, "published": c.row.published, "traced": None if c.traced is None else
                     c.traced.per_rank_peak_bytes, "gap": c.gap, "remainder": c.remainder} for c in compared])
