# %% [markdown]
# # Lab 12 · Memory debugging, measured
#
# This notebook runs the Lab 12 starter, `code/lab-12-memory-debugging/memory_debugging.py`, and
# its CUDA scenarios, `cuda_scenarios.py`. It is executed by `scripts/run_notebooks.py`, never
# edited by hand; the provenance cell below says where and when.
#
# What to look for:
#
# 1. Two leaking training loops and the fixed one, on one scale: the leaks climb step after step,
#    the fixed loop is flat.
# 2. The growth per step in bytes, measured by the ledger, next to the growth derived from the
#    shapes. On CPU they are equal to the byte.
# 3. The live-tensor table: what grew in the last step, by the line of code that allocated it
#    (inside the model) and by the line of the lab that called the model.
# 4. On a GPU only: allocated against reserved with and without `expandable_segments`, and real
#    `torch.OutOfMemoryError` messages read line by line. A CPU run says so and skips them.

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
from labkit.cuda import record_snapshot  # noqa: E402

lab = nbk.load_lab("lab-12-memory-debugging/memory_debugging.py")
cs = lab.cuda_scenarios
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
# Small on a CPU; GPU-sized on a GPU (the same code either way).
SIZE = (["--width", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512", "--batch-size", "8", "--steps", "4"]
        if ON_GPU else ["--width", "128", "--layers", "2", "--heads", "4", "--seq-len", "64", "--batch-size", "8",
                        "--steps", "6"])
args = lab.parse_args(["--device", DEVICE.type, "--json", "--top", "12", *SIZE])
print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Three loops under the ledger
#
# `lab.run_scenario` is what the command line runs. Each loop trains for a few steps and, after
# every step, computes a monitoring loss on a held-out batch. The three loops differ in what they
# get wrong: `leak-losses` computes the monitoring loss with autograd on and keeps the losses as
# tensors, `leak-activations` keeps every block's output from a forward hook, `fixed` computes the
# monitoring loss under `torch.no_grad()` and keeps numbers. Each run is read while what it kept is
# still alive, then dropped before the next one starts.

# %%
summaries, timelines = {}, {}
for name in lab.LEAKS:
    snapshot = OUT / "memory_snapshot.pickle" if ON_GPU and name == "leak-losses" else None
    with record_snapshot(snapshot):
        run = lab.run_scenario(args, name, DEVICE)
    summaries[name] = lab.summary(run, args)
    timelines[name] = run.ledger.timeline()
    del run
    s = summaries[name]
    print(f"{name:17s} live after each step: {[plot.format_bytes(b) for b in s['live_bytes_after_step']]}")

# %% [markdown]
# ## The timelines, on one scale
#
# Every allocation and free, stacked by category. Each step has four bands: the training forward,
# backward, the optimizer, and a second forward band for the monitoring loss.

# %%
ymax = max(max(tl.device_total()) for tl in timelines.values())
fig, axes = plt.subplots(3, 1, figsize=(10, 9), dpi=110, layout="constrained")
for i, (ax, (name, tl)) in enumerate(zip(axes, timelines.items())):
    plot.plot_timeline(tl, ax=ax, ymax_bytes=ymax, legend=(i == 0),
                       title=f"{name}: {args.steps} steps on {DEVICE.type} (measured by the ledger)")
plot.save(fig, OUT / "timelines.svg")

# %% [markdown]
# ## Growth per step: measured against derived
#
# The derived figures (Lab 01 counts what TinyGPT saves for backward on CPU, `tinygpt_activation_bytes`):
#
# - `leak-losses`: each kept monitoring loss pins its whole graph, all it saved for a backward that
#   never comes, plus the 4-byte training loss, whose graph `backward()` already emptied.
# - `leak-activations`: one fp32 block output per layer, layers x batch x seq x width x 4 B.
# - `fixed`: nothing.

# %%
FORMULAS = {"leak-losses": "saved by one TinyGPT forward (Lab 01) + 4 B",
            "leak-activations": "layers x batch x seq x width x 4 B", "fixed": "0"}
rows = ["| loop | growth per step, measured | derived | formula | equal |", "|---|---:|---:|---|:---:|"]
for name, s in summaries.items():
    measured, derived = sorted(set(s["growth_per_step_bytes"])), s["expected_growth_per_step_bytes"]
    equal = "yes" if derived is not None and measured == [derived] else ("n/a" if derived is None else "NO")
    rows.append(f"| `{name}` | {', '.join(f'{g:,} B' for g in measured)} | "
                f"{'-' if derived is None else f'{derived:,} B'} | {FORMULAS[name]} | {equal} |")
    if not ON_GPU:
        assert measured == [derived], (name, measured, derived)
growth_table = "\n".join(rows)
nbk.show_markdown(growth_table)

fig2, ax = plt.subplots(figsize=(8, 3.8), dpi=110, layout="constrained")
colors = {"leak-losses": "#C44E52", "leak-activations": "#DD8452", "fixed": "#4C72B0"}
for name, s in summaries.items():
    live = [b / 2**20 for b in s["live_bytes_after_step"]]
    ax.plot(range(len(live)), live, marker="o", color=colors[name], label=f"{name} (measured)")
    if s["expected_growth_per_step_bytes"] is not None:
        derived = [live[0] + k * s["expected_growth_per_step_bytes"] / 2**20 for k in range(len(live))]
        ax.plot(range(len(live)), derived, ls="--", lw=1, color="black",
                label="derived" if name == "leak-losses" else None)
ax.set(xlabel="step", ylabel="live device MiB after the step", title="Live bytes after each step")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plot.save(fig2, OUT / "growth.svg")

# %% [markdown]
# ## The tool: what grew, by the line that allocated it
#
# `ledger.live_by_origin()` groups what is alive by category, by the line that allocated it and,
# when that line is inside the model (labkit's `models.py`), by the lab line that called the model
# (the ledger runs with `stacks=True`). Comparing the readings after the last two steps
# (`lab.what_grew`) leaves only what the loop gained in one step: the leak, where in the model
# each piece was made, and the lab line it came from.

# %%
grew_rows = ["| loop | category | allocated at (file:line in function: code) | called from | tensors | bytes |",
             "|---|---|---|---|---:|---:|"]
for name in ("leak-losses", "leak-activations"):
    for r in summaries[name]["grew_in_last_step"]:
        grew_rows.append(f"| `{name}` | {r['category']} | {lab.code_cell(r['where'])} | "
                         f"{lab.code_cell(r['called_from'])} | {r['tensors']:,} | {r['bytes']:,} |")
grew_table = "\n".join(grew_rows)
nbk.show_markdown(grew_table)
grew_losses = summaries["leak-losses"]["grew_in_last_step"]
graph = [r for r in grew_losses if "val_loss = model(*val)[1]" in r["called_from"]]
assert all(r["where"].startswith("models.py:") for r in grew_losses)  # every piece made inside the model
if not ON_GPU:  # the monitoring graph is what Lab 01 counts; the training loss adds its 4 bytes
    assert sum(r["bytes"] for r in graph) + 4 == summaries["leak-losses"]["expected_growth_per_step_bytes"]
(top_acts,) = summaries["leak-activations"]["grew_in_last_step"]
assert "loss = model(x, y)[1]" in top_acts["called_from"] and top_acts["tensors"] == args.layers

# %% [markdown]
# What is alive at the end of the last step of `leak-losses` and of `fixed`. Parameters show the
# line that registered them with the ledger (they existed before it started). `fixed` holds no
# graph: its only activations are the two 4-byte losses.

# %%
alive_losses = lab.origin_table(summaries["leak-losses"]["live_at_end"], args.top)
alive_fixed = lab.origin_table(summaries["fixed"]["live_at_end"], args.top)
fixed_acts = [r for r in summaries["fixed"]["live_at_end"] if r["category"] == "activations"]
assert [r["tensors"] for r in fixed_acts] == [1, 1]  # the training loss and the monitoring loss, no graph
nbk.show_markdown("**leak-losses**\n\n" + alive_losses + "\n\n**fixed**\n\n" + alive_fixed)

# %% [markdown]
# ## Fragmentation: allocated against reserved (GPU only)
#
# `cuda_scenarios.changing_batch` grows the batch by one sample per iteration, once with the default
# caching allocator and once with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, each in a
# fresh process (the allocator reads the setting when CUDA starts). A CPU has no caching allocator:
# this cell says so and writes a note for the page instead of figures.

# %%
NOT_YET = ("*Not measured yet: {what} come from the GPU run of this notebook "
           "(`scripts/run_notebooks.py --device cuda lab-12-memory-debugging`). The run that wrote this "
           "page was on CPU, which has no CUDA caching allocator.*\n")
if ON_GPU:
    frag = cs.fragmentation(args.frag_iters, args.frag_layers)
    fig3, axes3 = plt.subplots(1, 2, figsize=(11, 3.6), dpi=110, layout="constrained", sharey=True)
    frag_rows = ["| allocator | peak allocated | peak reserved | reserved / allocated | segments | "
                 "cached after the last free |", "|---|---:|---:|---:|---:|---:|"]
    for ax3, r in zip(axes3, frag):
        batch = [row["batch"] for row in r["rows"]]
        ax3.plot(batch, [row["allocated"] / 2**30 for row in r["rows"]], marker="o", label="memory_allocated")
        ax3.plot(batch, [row["reserved"] / 2**30 for row in r["rows"]], marker="s", label="memory_reserved")
        ax3.set(title=r["alloc_conf"], xlabel="batch size", ylabel="GiB")
        ax3.grid(alpha=0.3)
        ax3.legend(fontsize=8)
        pa, pr = max(x["allocated"] for x in r["rows"]), max(x["reserved"] for x in r["rows"])
        frag_rows.append(f"| `{r['alloc_conf']}` | {plot.format_bytes(pa)} | {plot.format_bytes(pr)} | "
                         f"{pr / pa:.2f} | {r['segments']} | {plot.format_bytes(r['after']['reserved'])} |")
    plot.save(fig3, OUT / "fragmentation.svg")
    fig_md = ('<figure markdown>\n[![Allocated and reserved bytes per batch size, default allocator and '
              'expandable segments](../results/lab-12-memory-debugging/fragmentation.svg)]'
              '(../results/lab-12-memory-debugging/fragmentation.svg "open the figure full size")\n'
              '<figcaption markdown><span class="il-tag il-tag--measured">measured</span> **Notice** the gap '
              'between the two lines on the left: memory the allocator keeps cached in segments of sizes '
              'that no later request fits.</figcaption>\n</figure>\n\n')
    frag_md = fig_md + "\n".join(frag_rows) + "\n"
    nbk.show_markdown("\n".join(frag_rows))
else:
    frag = None
    frag_md = NOT_YET.format(what="the allocated-against-reserved figures")
    print("CPU run: no CUDA caching allocator here, so no fragmentation measurement.")

# %% [markdown]
# ## An out-of-memory error, caught and read (GPU only)
#
# `cuda_scenarios.oom_experiments` caps the allocator with `set_per_process_memory_fraction` (so
# the error is cheap on a big GPU) and, in fresh processes: fills it with live buffers; fragments
# it so that half is free but not in one piece; and repeats the fragmented pattern with
# expandable segments. Every `torch.OutOfMemoryError` message is split into its sentences by
# `read_oom`, and `next_levers` names the pattern. On CPU there is no such error to catch, and
# none is invented here.

# %%
if ON_GPU:
    ooms = cs.oom_experiments(args.cap_mb)
    parts = []
    for r in ooms:
        head = f"**{r['pattern']} pattern, {r['alloc_conf']} allocator**: "
        if not r["oom"]:
            parts.append(head + f"no error; the request fitted ({plot.format_bytes(r['allocated'])} allocated).")
            continue
        lines = ["| sentence of the message | number | what it is |", "|---|---:|---|"]
        for line in r["reading"]["lines"]:
            nums = line["numbers"] or [{"bytes": None, "meaning": ""}]
            for k, n in enumerate(nums):
                text = f"`{line['text']}`" if k == 0 else ""
                value = plot.format_bytes(n["bytes"]) if n["bytes"] is not None else ""
                lines.append(f"| {text} | {value} | {n['meaning']} |")
        levers = "\n".join(f"- {lv['pattern']}: **{lv['lever']}**" for lv in r["levers"])
        parts.append(head + "`torch.OutOfMemoryError` caught.\n\n" + "\n".join(lines) + "\n\n" + levers)
    oom_md = "\n\n".join(parts) + "\n"
    nbk.show_markdown(oom_md)
    frag_oom = next(r for r in ooms if r["pattern"] == "fragmented" and r["alloc_conf"] == "default")
    assert all(r["oom"] for r in ooms[:2]) and frag_oom["reading"]["values"]["unallocated"] >= frag_oom[
        "reading"]["values"]["request"]
else:
    ooms = None
    oom_md = NOT_YET.format(what="real `torch.OutOfMemoryError` messages and their readings")
    print("CPU run: no CUDA allocator, so no out-of-memory error to catch. None is faked.")

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {"device": str(DEVICE), "steps": args.steps, "scenarios": summaries,
           "fragmentation": frag, "oom": ooms, "snapshot": "memory_snapshot.pickle" if ON_GPU else None}
wall = sum(s["wall_time_s"] for s in summaries.values())
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE, wall))
tables = {"growth": growth_table, "grew": grew_table, "alive_losses": alive_losses, "alive_fixed": alive_fixed,
          "fragmentation": frag_md, "oom": oom_md}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text.rstrip("\n") + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
