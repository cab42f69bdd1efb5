# %% [markdown]
# # Lab 13 · Will it fit? Real models, traced at real size
#
# This notebook runs the Lab 13 starter, `code/lab-13-will-it-fit/fit.py`, on real architectures
# from `labkit.zoo`: Llama-3-8B, Llama-3-70B, Mixtral-8x7B, Llama-3.2-1B. It is executed by
# `scripts/run_notebooks.py`, never edited by hand; the table below says where and on which code.
#
# Every byte below is **traced on fake tensors**, not measured on a GPU: the model is built with
# `labkit.fake.materialize` inside `labkit.fake.tensors()`, one steady-state step runs (AdamW's state
# already exists), and the memory ledger counts every storage the step would hold, rounded to the
# CUDA caching allocator's 512-byte blocks. Nothing is allocated, so a 70B step traces on this
# laptop. The trace takes CPU dispatch (CPU autocast, CPU flash attention; `labkit/fake.py` says
# where that differs from CUDA) and does not see the CUDA context, cuBLAS workspaces, NCCL buffers
# or fragmentation: Lab 16 replays the trace through its model of the caching allocator, and the
# verdict holds the reserved bytes (simulated) plus the CUDA context against the GPU's total.
#
# What to look for:
#
# 1. The peak of a Llama-3-8B step under torch AMP is in the optimizer step, not at the turn from
#    forward to backward: CUDA's default AdamW (foreach) holds a copy of a moment there.
# 2. Lab 01's formulas against the trace, category by category, and why each differs (Megatron's
#    mixed precision is not torch AMP's; a Llama block is not a GPT block). Under torch AMP a third of
#    the "activations" are bf16 casts of the weights that autocast saves for backward: their own line.
# 3. Levers are pulled exact ones first (the same loss and gradients), each cheapest first, then those that
#    change the numerics; the first rung that fits is the cheapest way found.

# %%
import contextlib
from functools import partial

from IPython.display import display

from labkit import fake, labs, notebook, plot

nb = notebook.setup(13)
lab, tables = nb.lab, labs.load(13, "fit_report")
GPUS = ["h100-80gb", "h200-141gb", "a100-40gb", "l40s-48gb", "l4-24gb", "rtx4090-24gb"]

# %% [markdown]
# ## The trace is the real step
#
# Measured first: the same code path (`lab.trace`) on real CPU tensors and on fake ones, for a small
# Llama (`small-llama`, 2 blocks of width 64) in four configurations, both counted in exact bytes
# (no CUDA rounding on either side). `tests/test_lab13.py` holds them equal allocation by allocation
# in nine configurations; the table shows the per-rank peaks.

# %%
TWINS = {"AMP + AdamW": {}, "ZeRO-3 on 2 ranks, full checkpointing": dict(dp=2, zero_stage=3, checkpointing="full"),
         "optimizer offload (Lab 07)": dict(offload="optimizer"), "prefill": dict(task="infer")}
pairs = []
for label, fields in TWINS.items():
    config = lab.Config(model="small-llama", seq=64, batch=2, levers="none", **fields)
    pairs.append((label, lab.trace(config, tensors=contextlib.nullcontext),
                  lab.trace(config, tensors=partial(fake.tensors, block=None))))
twin = tables.twin_table(pairs)
display(twin)

# %% [markdown]
# ## Llama-3-8B: one training step at 4,096 tokens on an H100
#
# Batch 1, torch AMP (fp32 weights, bf16 autocast), AdamW as CUDA runs it by default (foreach), no
# checkpointing: the configuration people try first. `lab.run` is what the command line runs:
# `.venv/bin/python code/lab-13-will-it-fit/fit.py --model llama-3-8b --seq 4096 --gpu h100-80gb`.

# %%
llama8b = lab.run(lab.Config(model="llama-3-8b", seq=4096, gpu="h100-80gb"))
step = llama8b.trace.timeline.step_window(1)
fig = plot.plot_timeline(step, title="Llama-3-8B, AMP + AdamW, 4,096 tokens (traced)")
phases8b, gap8b, gpu8b = tables.phases_table(llama8b.trace), tables.gap_table(llama8b.trace), tables.gpu_table(llama8b)
levers8b = tables.levers_table(llama8b.levers)
display(phases8b, gpu8b)
print(tables.verdict(llama8b))
notebook.show(fig, alt="Stacked memory timeline of one traced Llama-3-8B training step by category, with "
                       "forward, backward, optimizer and zero_grad bands")

# %% [markdown]
# ## The trace against Lab 01's formulas
#
# For each category, the most it holds at any moment of the step (traced) against Lab 01's formula
# (`zero_model_state`, `activation_bytes_per_layer`), and why they differ. Lab 01's per-rank figure
# is a sum of categories; the trace's peak is one moment, when some of them are not alive. The line
# under activations counts the `_to_copy` casts of a weight (`fit_setup.WeightCasts`) saved for backward.
# The same step in fp32, for its activations: AMP saves bf16 activations but adds those casts.

# %%
display(gap8b)
fp32_8b = lab.trace(lab.Config(model="llama-3-8b", seq=4096, precision="fp32", levers="none"))
print("activations, fp32:", tables.format_bytes(fp32_8b.derived["category_max"]["activations"]))

# %% [markdown]
# ## The levers, exact ones first, each cheapest first
#
# Each lever is one change of configuration. The ladder pulls them in order of what they cost
# (`fit_levers.LEVERS` states each cost), keeps a lever when it lowers the peak, re-traces after each,
# and stops at the first rung that fits. A lever that cannot touch the phase holding the peak saves
# nothing there (derived, not traced).

# %%
display(levers8b)
to_fit = tables.to_fit(llama8b.levers)
print("to fit: " + " ".join(to_fit or ["nothing fits"]))

# %% [markdown]
# ## Llama-3-70B on 8 ranks, ZeRO-3
#
# The same step with FSDP2's `fully_shard` under PyTorch's fake process group, as rank 0 of 8:
# parameters, gradients and AdamW state sharded; each block gathered for its forward and again for its
# backward (the pink communication band). Mixed precision here is FSDP2's `MixedPrecisionPolicy`
# (bf16 gathers, fp32 gradient reduction), as torchtitan trains: no autocast, no bf16 copy of a weight kept.

# %%
llama70b = lab.run(lab.Config(model="llama-3-70b", seq=4096, dp=8, zero_stage=3, levers="none"))
fig70 = plot.plot_timeline(llama70b.trace.timeline.step_window(1), title="Llama-3-70B, ZeRO-3 over 8, rank 0 (traced)")
phases70b = tables.phases_table(llama70b.trace)
display(phases70b)
print(tables.verdict(llama70b))
notebook.show(fig70, alt="Stacked memory timeline of one traced Llama-3-70B ZeRO-3 step on rank 0 of 8, by "
                         "category, with phase bands")

# %% [markdown]
# ## Which zoo model fits which GPU
#
# One trace per row (levers off), held against each GPU's usable bytes. Training rows are one step
# at 4,096 tokens, batch 1 (the calculator's defaults: every preset it offers has its AMP row here);
# GPT-3's learned positions stop at its context, so the GPT rows are traced there. The inference row
# is a prefill of 8 prompts of 4,096 tokens in bf16 with their KV cache (derived from the shape: the
# zoo's models return none). This cell takes about a minute: 405B and GPT-3 are the slow rows.

# %%
CONFIGS = {
    "train: AMP + AdamW": {},
    "train: bf16, full checkpointing": dict(precision="bf16", checkpointing="full"),
    "train: bf16, fused AdamW, full checkpointing": dict(precision="bf16", optimizer="adamw-fused",
                                                         checkpointing="full"),
    "train: ZeRO-3 on 8 ranks, AMP, full checkpointing": dict(dp=8, zero_stage=3, checkpointing="full"),
    "prefill: bf16, 8 x 4,096 tokens": dict(task="infer", precision="bf16", batch=8),
    "train: AMP + AdamW, 2,048 tokens (its context)": dict(seq=2048),
    "train: AMP + AdamW, 128 tokens (its context)": dict(seq=128),
}
AMP, BF16_FULL, FUSED, ZERO3, PREFILL, AT_2048, AT_128 = CONFIGS
ROWS = {"llama-3.2-1b": [AMP, FUSED, PREFILL], "llama-3.2-3b": [AMP], "llama-3-8b": [AMP, BF16_FULL, FUSED, ZERO3, PREFILL],
        "llama-3.1-8b": [AMP], "mixtral-8x7b": [AMP, ZERO3], "llama-3-70b": [AMP, ZERO3], "llama-3.1-405b": [AMP],
        "gpt-3-175b": [AT_2048], "small-llama": [AMP], "small-mixtral": [AMP], "small-gpt": [AT_128]}


def zoo_config(model, label):
    if "seq" not in CONFIGS[label]:
        return lab.Config(model=model, seq=4096, levers="none", **CONFIGS[label])
    return lab.Config(**{"model": model, "levers": "none", **CONFIGS[label]})  # a context shorter than 4,096


traced = [(label, llama8b.trace if model == "llama-3-8b" and label == AMP else lab.trace(zoo_config(model, label)))
          for model, labels in ROWS.items() for label in labels]
zoo = tables.fits_table(traced, GPUS)
display(zoo)

# %% [markdown]
# ## Llama-3-8B on one GPU, or two
#
# What the interview answer quotes beside the ladder above. On two GPUs: ZeRO-3 (Lab 11's FSDP2 wrap)
# over 2 ranks with fused AdamW and full checkpointing, as rank 0 of 2, the fewest H100s that hold its
# full fine-tuning in mixed precision. On one, with 8-bit Adam on bf16 weights: no lab traces it yet, so
# it is derived from the traced pure-bf16 row of the table (fused AdamW, full checkpointing) less the
# byte per moment and parameter that 8-bit moments do not keep (a block's fp32 scale is 4 B per 2,048).

# %%
two_gpus = lab.trace(lab.Config(model="llama-3-8b", seq=4096, dp=2, zero_stage=3, optimizer="adamw-fused",
                                checkpointing="full", levers="none"))
print(f"two GPUs: {tables.format_bytes(two_gpus.per_rank_peak_bytes)} per rank, peak in {two_gpus.derived['peak_phase']}; "
      f"{tables.format_bytes(two_gpus.reserved['need_bytes'])} with the reserved bytes and the CUDA context, fits: {two_gpus.fits}")
assert two_gpus.fits, "the page says ZeRO-3 over two H100s fits in reserved bytes"
zoo_peaks = {(model, label): t.per_rank_peak_bytes
             for (model, label), (_, t) in zip([(m, x) for m, xs in ROWS.items() for x in xs], traced)}
bf16_fused_full_8b = zoo_peaks["llama-3-8b", FUSED]
adam8bit_8b = bf16_fused_full_8b - 2 * llama8b.trace.derived["params"]  # two moments: 2 B -> 1 B per parameter each
print(f"8-bit Adam on bf16 weights, full checkpointing (derived): {tables.format_bytes(adam8bit_8b)}")

# %% [markdown]
# ## The loss at 32k tokens: full, chunked, fused with the head
#
# Llama-3-8B at 32,768 tokens, AMP, fused AdamW, full checkpointing, traced three times with `--loss`
# (`fit_loss.py`): the model's own loss (every token's logits, their float32 copy and their gradient
# at once), the chunked loss (8 chunks, each recomputed in backward) and the fused linear +
# cross-entropy (gradients taken chunk by chunk in forward). `tests/test_lab13.py` holds both to the
# full loss's value and gradients.

# %%
LOSSES = ("full", "chunked", "fused-linear")
loss_traces = {loss: lab.trace(lab.Config(model="llama-3-8b", seq=32768, optimizer="adamw-fused", checkpointing="full",
                                          loss=loss, levers="none")) for loss in LOSSES}
loss_32k = tables.fits_table([(f"--loss {loss}", t) for loss, t in loss_traces.items()], ["h100-80gb", "h200-141gb",
                                                                                       "b200-180gb", "mi300x-192gb"])
display(loss_32k)

# %% [markdown]
# ## Checkpointing policies, the optimizer step in backward, activation offload
#
# Llama-3-8B at 4,096 tokens, AMP, fused AdamW, traced with each `--checkpointing` policy (named by what a block
# keeps: Lab 04's `run_blocks`; every-kth-block: `fit_every_kth.py`), then with the optimizer step in backward (`fit_backward.py`: each parameter
# stepped by its gradient's hook, which frees it) and with the activations offloaded (`fit_offload.py`: Lab 09's
# hooks around the blocks; `host_peak_bytes` is what waits on the host). `tests/test_fit_formula.py` holds the
# calculator's formulas within 0.1 % of traces like these.

# %%
FLAGS = {"none": {}, "save_matmuls": {"checkpointing": "save-matmuls"},
         "save_alternate": {"checkpointing": "save-alternate-matmuls"},
         "every_4": {"checkpointing": "every-k", "checkpoint_every": 4},
         "every_2nd_block": {"checkpointing": "every-kth-block", "checkpoint_every": 2},  # torchtitan's layer policy
         "full": {"checkpointing": "full"},
         "full_in_backward": {"checkpointing": "full", "optimizer_in_backward": True},
         "offload": {"offload_activations": True},
         "offload_in_backward": {"offload_activations": True, "optimizer_in_backward": True}}
flag_traces = {name: lab.trace(lab.Config(model="llama-3-8b", seq=4096, optimizer="adamw-fused", levers="none", **f))
               for name, f in FLAGS.items()}
flags_8b = tables.fits_table([(" ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in f.items())
                               or "(none of them)", flag_traces[name]) for name, f in FLAGS.items()],
                             ["h100-80gb", "h200-141gb", "b200-180gb"])
display(flags_8b)
print("offloaded activations on the host:", tables.format_bytes(flag_traces["offload"].derived["host_peak_bytes"]))

# %% [markdown]
# ## torch.compile: what AOTAutograd's partitioner saves
#
# Llama-3-8B at 4,096 tokens, AMP, fused AdamW (so the peak is the turn from forward to backward), traced
# eager and with `--compile` (`fit_compile.py`): every block compiled, its joint graph split by inductor's
# partitioner, both graphs run as Python on fake tensors. The saved activations are the compiled step's;
# inductor's fused kernels would allocate fewer temporaries than this trace does.

# %%
compile_traces = {c: lab.trace(lab.Config(model="llama-3-8b", seq=4096, optimizer="adamw-fused", compile=c,
                                          levers="none")) for c in (False, True)}
for c, t in compile_traces.items():
    print("--compile" if c else "eager    ", "activations", tables.format_bytes(t.derived["category_max"]["activations"]),
          "peak", tables.format_bytes(t.per_rank_peak_bytes), "at", t.derived["peak_phase"])
# with --checkpointing full inside each compiled block (torchtitan's order), at 8,192 tokens
compile_full = {c: lab.trace(lab.Config(model="llama-3-8b", seq=8192, optimizer="adamw-fused", compile=c,
                                        checkpointing="full", levers="none")) for c in (False, True)}
for c, t in compile_full.items():
    print("--compile --checkpointing full" if c else "eager --checkpointing full   ", "activations",
          tables.format_bytes(t.derived["category_max"]["activations"]), "forward",
          tables.format_bytes(max(t.timeline.window("forward").device_total())), "peak",
          tables.format_bytes(t.per_rank_peak_bytes))

# %% [markdown]
# ## float8 linears, torchao's tensorwise recipe
#
# torchao's `Float8Linear` with dynamic tensorwise scaling, in plain PyTorch (`fit_float8.py`): Llama-3-8B
# at 4,096 tokens with fused AdamW, under AMP and in pure bf16, each with and without float8 linears
# (traced). torchao saves the high-precision operands for backward, so a float8 linear keeps what a bf16
# one keeps; under AMP it keeps no bf16 cast of its weight. Then FSDP2's float8 all-gather, derived: one
# block's gathered weights on 8 ranks, and what each rank receives per step; and traced
# (`--float8 tensorwise-all-gather`, `fit_float8_gather.py`): the step's peak under ZeRO-3 on 8 ranks both ways.
# Last, float8 under tensor parallelism as torchtitan runs it (`fit_float8_tp.py`, torchao's float8 TP styles):
# one rank of Llama-3-70B at 8,192 tokens under --tp 8 --sp --dp 8 --zero-stage 3, with and without float8.

# %%
fit_float8 = labs.load(13, "fit_float8")
float8_8b = {(precision, f8): lab.trace(lab.Config(model="llama-3-8b", seq=4096, optimizer="adamw-fused", precision=precision,
                                                   float8=f8, levers="none")).per_rank_peak_bytes
             for precision in ("mixed", "bf16") for f8 in ("none", "tensorwise")}
gather_8b = fit_float8.fsdp_float8_all_gather(llama8b.config.spec, dp=8)
gather_traces = {f8: lab.trace(lab.Config(model="llama-3-8b", seq=4096, dp=8, zero_stage=3, float8=f8, levers="none"))
                 for f8 in ("tensorwise", "tensorwise-all-gather")}  # FSDP2's float8 all-gather, traced (ZeRO-3, 8 ranks)
for (precision, f8), peak in float8_8b.items():
    print(f"{precision:5} --float8 {f8:10} peak {tables.format_bytes(peak)} (traced)")
print(f"a block gathered: {tables.format_bytes(gather_8b['block_bf16'])} in bf16, {tables.format_bytes(gather_8b['block_float8'])} "
      f"with float8 all-gather; received per step per rank: {tables.format_bytes(gather_8b['received_bf16'])} -> "
      f"{tables.format_bytes(gather_8b['received_float8'])} (derived)")
for f8, t in gather_traces.items():
    print(f"--zero-stage 3 --dp 8 --float8 {f8:21} peak {tables.format_bytes(t.per_rank_peak_bytes)} (traced)")
tp_float8_70b = {f8: lab.trace(lab.Config(model="llama-3-70b", seq=8192, tp=8, sp=True, dp=8, zero_stage=3, float8=f8,
                                          levers="none")) for f8 in ("none", "tensorwise")}
for f8, t in tp_float8_70b.items():
    print(f"70B --tp 8 --sp --dp 8 --zero-stage 3 --float8 {f8:10} peak {tables.format_bytes(t.per_rank_peak_bytes)}, "
          f"activations {tables.format_bytes(t.derived['category_max']['activations'])} (traced)")

# %% [markdown]
# ## The embedding and the head as FSDP2 units of their own
#
# `--fsdp-units blocks` (Lab 11's wrap) leaves the embedding, final norm and head to the root, which ZeRO-3
# keeps gathered through all of backward; `blocks-embed-head` (torchtitan's units, `fit_units.py`) gathers the
# embedding only around its own forward and backward. Llama-3-8B and Llama-3-70B at 4,096 tokens, AMP under
# FSDP2's MixedPrecisionPolicy, ZeRO-3 over 8 ranks, both ways (traced), beside the calculator's formula.

# %%
fit_formula, fit_inputs = labs.load(1, "fit_formula"), labs.load(1, "fit_inputs")
units = {(m, u): lab.trace(lab.Config(model=f"llama-3-{m}", seq=4096, dp=8, zero_stage=3, fsdp_units=u, levers="none"))
         for m in ("8b", "70b") for u in ("blocks", "blocks-embed-head")}
for (m, u), t in units.items():
    formula = sum(fit_formula.estimate(fit_inputs.Inputs(model=f"llama-3-{m}", seq=4096, dp=8, zero_stage=3,
                                                         fsdp_units=u)).values())
    print(f"llama-3-{m:3} --fsdp-units {u:17} peak {tables.format_bytes(t.per_rank_peak_bytes)} (traced), at "
          f"{t.derived['peak_phase']}; formula {formula / t.per_rank_peak_bytes - 1:+.4%}")

# %% [markdown]
# ## One rank of a split model: tensor, sequence and pipeline parallelism
#
# `--tp` splits every block the Megatron way through DTensor's plan (`fit_parallel.py`), on a `--dp` x
# `--tp` mesh of the fake process group; `--sp` also splits the norms and the stream between sublayers
# along the sequence. `--pp` traces 1F1B's first stage (`fit_pipeline.py`): its blocks, and `--pp`
# micro-batches in flight. Llama-3-8B at 4,096 tokens, AMP; then one rank of Llama-3.1-405B as
# torchtitan would lay it out on 512 GPUs: TP 8 with SP, PP 16, ZeRO-3 over 8 data-parallel ranks; last, that rank
# with float8 linears (torchao's float8 TP styles: each linear's input saved in float8).

# %%
SPLITS = {"--tp 8 --sp": dict(model="llama-3-8b", tp=8, sp=True),
          "--pp 4 (8 micro-batches)": dict(model="llama-3-8b", pp=4, accumulation=8),
          "405B: --tp 8 --sp --pp 16 --dp 8 --zero-stage 3": dict(model="llama-3.1-405b", tp=8, sp=True, pp=16,
                                                                  accumulation=16, dp=8, zero_stage=3)}
SPLITS["405B, the same with --float8 tensorwise"] = SPLITS["405B: --tp 8 --sp --pp 16 --dp 8 --zero-stage 3"] | {
    "float8": "tensorwise"}
split_traces = {label: lab.trace(lab.Config(seq=4096, levers="none", **f)) for label, f in SPLITS.items()}
parallel = tables.fits_table(list(split_traces.items()), ["h100-80gb", "h200-141gb"])
display(parallel)

# %% [markdown]
# ## Context parallelism: one sequence over a ring of ranks
#
# `--cp` splits each sequence over its ranks (`fit_context.py`): each rank holds seq / cp tokens of every
# activation, attention passes K/V chunks round a ring, and FSDP shards over the dp x cp ranks. Llama-3.1-8B at
# 32,768 tokens, AMP, ZeRO-3, full checkpointing, on 16 GPUs both ways: a whole sequence per rank, or a quarter.
# Last, a long-context run as torchtitan combines them: Llama-3-70B's shapes at 131,072 tokens on 64 GPUs, each
# sequence over a ring of 4, each rank of the ring one of 8 tensor-parallel ranks (the ring on its 8 heads).

# %%
CONTEXT = {"--dp 16: a whole sequence per rank": dict(dp=16), "--dp 4 --cp 4: a quarter per rank": dict(dp=4, cp=4),
           "128k tokens, --tp 8 --sp --cp 4 --dp 2: 64 GPUs": dict(model="llama-3-70b", seq=131072, tp=8, sp=True,
                                                                   cp=4, dp=2)}
cp_traces = {label: lab.trace(lab.Config(**{"model": "llama-3.1-8b", "seq": 32768, "zero_stage": 3,
                                            "checkpointing": "full", "levers": "none"} | f))
             for label, f in CONTEXT.items()}
context = tables.fits_table(list(cp_traces.items()), ["h100-80gb", "h200-141gb"])
display(context)

# %%
d8, d70, summary8b = llama8b.trace.derived, llama70b.trace.derived, llama8b.summary()
notebook.publish(
    nb, tables={"twin": twin, "phases_8b": phases8b, "gap_8b": gap8b, "gpu_8b": gpu8b, "levers_8b": levers8b,
                "phases_70b": phases70b, "zoo": zoo, "loss_32k": loss_32k, "parallel": parallel, "context": context,
                "flags_8b": flags_8b},
    figures={"timeline_8b": fig, "timeline_70b": fig70},
    summary=summary8b, llama70b=llama70b.summary(), to_fit_8b=" ".join(to_fit or []),
    peak_8b=llama8b.trace.per_rank_peak_bytes, peak_70b=llama70b.trace.per_rank_peak_bytes,
    foreach_temporaries_8b=d8["by_phase"]["optimizer"]["temporaries"],
    activations_8b=d8["category_max"]["activations"], activations_70b=d70["category_max"]["activations"],
    weight_casts_8b=d8["weight_casts"]["at_activations_max"], weight_casts_70b=d70["weight_casts"]["max"],
    activations_less_casts_8b=d8["category_max"]["activations"] - d8["weight_casts"]["at_activations_max"],
    activations_formula_8b=summary8b["predicted"]["activations"],
    activations_fp32_8b=fp32_8b.derived["category_max"]["activations"], zoo_rows=len(traced),
    capacity_h100=summary8b["capacity_bytes"], reserved_8b=summary8b["reserved"]["reserved_bytes"],
    total_h100=summary8b["gpu_detail"]["total_bytes"], two_gpus_8b=two_gpus.per_rank_peak_bytes,
    two_gpus_need_8b=two_gpus.reserved["need_bytes"], two_gpus_fits_8b=two_gpus.fits,
    two_gpus_phase_8b=two_gpus.derived["peak_phase"], bf16_fused_full_8b=bf16_fused_full_8b, adam8bit_8b=adam8bit_8b,
    seconds_8b=llama8b.trace.seconds, seconds_70b=llama70b.trace.seconds,
    **{f"loss_{loss.replace('-', '_')}_32k": t.per_rank_peak_bytes for loss, t in loss_traces.items()},
    loss_peak_phase_full_32k=loss_traces["full"].derived["peak_phase"],
    **{f"flag_{name}_8b": t.per_rank_peak_bytes for name, t in flag_traces.items()},
    offload_host_8b=flag_traces["offload"].derived["host_peak_bytes"],
    **{f"{'compiled' if c else 'eager'}_{what}_8b": t.derived["category_max"]["activations"] if what == "activations"
       else t.per_rank_peak_bytes for c, t in compile_traces.items() for what in ("activations", "peak")},
    **{f"{'compiled' if c else 'eager'}_full_{what}_8k": t.derived["category_max"]["activations"] if what == "activations"
       else max(t.timeline.window("forward").device_total()) if what == "forward" else t.per_rank_peak_bytes
       for c, t in compile_full.items() for what in ("activations", "forward", "peak")},
    **{f"float8_{'amp' if p == 'mixed' else p}_{'on' if f8 != 'none' else 'off'}_8b": v for (p, f8), v in float8_8b.items()},
    float8_gather_on_8b=gather_8b["block_float8"], float8_gather_off_8b=gather_8b["block_bf16"],
    float8_gather_traced_on_8b=gather_traces["tensorwise-all-gather"].per_rank_peak_bytes,
    float8_gather_traced_off_8b=gather_traces["tensorwise"].per_rank_peak_bytes,
    **{f"float8_tp8_{'on' if f8 != 'none' else 'off'}_70b": t.per_rank_peak_bytes for f8, t in tp_float8_70b.items()},
    **{f"units_{u.replace('-', '_')}_{m}": t.per_rank_peak_bytes for (m, u), t in units.items()},
    tp8_sp_8b=split_traces["--tp 8 --sp"].per_rank_peak_bytes, pp4_8b=split_traces["--pp 4 (8 micro-batches)"].per_rank_peak_bytes,
    rank_405b=split_traces["405B: --tp 8 --sp --pp 16 --dp 8 --zero-stage 3"].per_rank_peak_bytes,
    rank_405b_float8=split_traces["405B, the same with --float8 tensorwise"].per_rank_peak_bytes,
    cp_off_32k=cp_traces["--dp 16: a whole sequence per rank"].per_rank_peak_bytes,
    cp4_32k=cp_traces["--dp 4 --cp 4: a quarter per rank"].per_rank_peak_bytes,
    twins_equal=all(real.derived["by_phase"] == traced.derived["by_phase"] for _, real, traced in pairs))
