# %% [markdown]
# # Lab 10 · Data parallel (DDP), measured per rank
#
# This notebook launches the Lab 10 starter, `code/lab-10-ddp/train_ddp.py`, with `torchrun` on
# two processes (ranks) and draws what they reported: rank 0's JSON summary, and the memory
# ledger each rank wrote for itself. It is executed by `scripts/run_notebooks.py`, never edited by
# hand; the provenance cell below says where and when. On a CPU the two ranks talk through gloo
# and the byte counts are exact; speed and NCCL need a GPU run.
#
# What to look for:
#
# 1. Every rank holds the same bytes: the whole model, its gradients, AdamW's moments, and on top
#    of them DDP's gradient buckets, 4 bytes per parameter, the `communication` category.
# 2. Step 0 reduces one bucket holding every gradient; from step 1 on, DDP has rebuilt its buckets
#    in the order the gradients became ready, each closed at `--bucket-cap-mb`.
# 3. The replicas are bit-identical after every step, and training equals one process on the
#    concatenated batch up to rounding.

# %%
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-10-ddp/train_ddp.py")
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
# Small on a CPU; GPU-sized on a GPU (the same code either way).
SIZE = (["--width", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512", "--batch-size", "8",
         "--bucket-cap-mb", "25"]
        if ON_GPU else ["--width", "64", "--layers", "2", "--heads", "4", "--seq-len", "32", "--batch-size", "4",
                        "--bucket-cap-mb", "0.05"])
BASE = ["--device", DEVICE.type, "--json", "--steps", "3", *SIZE]
print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Two runs under torchrun
#
# The starter cannot run in this kernel: DDP needs one process per rank, started by `torchrun`.
# So the notebook launches it twice, at the same time (each launch is mostly process start-up):
# once as it is, with gradients copied into the buckets, and once with `--grad-as-bucket-view`,
# where the gradients are views into the buckets. Only rank 0 prints, one JSON object; with
# `--ledger-dir` every rank of the first run also writes its own ledger.

# %%
LEDGERS = OUT / "ledger"
SNAPSHOT = ["--snapshot", str(OUT / "memory_snapshot.pickle")] if ON_GPU else []  # one pickle per rank
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "code" / "lab-10-ddp" / "train_ddp.py")]
env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
commands = {"copy": [*TORCHRUN, *BASE, "--ledger-dir", str(LEDGERS), *SNAPSHOT],
            "view": [*TORCHRUN, *BASE, "--grad-as-bucket-view"]}
procs = {mode: subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
         for mode, cmd in commands.items()}
import matplotlib.pyplot as plt  # noqa: E402  (while the ranks start: the plotting tools)
import torch  # noqa: E402
from labkit.ledger import Timeline  # noqa: E402

runs = {}
for mode, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    runs[mode] = json.loads(stdout)
print("torchrun --standalone --nproc_per_node=2 code/lab-10-ddp/train_ddp.py", " ".join(BASE))
r = runs["copy"]
P, T = r["params"], r["param_tensors"]
print(f"{r['world_size']} ranks over {r['backend']}; TinyGPT with {P:,} parameters in {T} tensors; "
      f"global losses {[round(v, 4) for v in r['losses']]}")
assert runs["view"]["losses"] == r["losses"], "gradient views change where gradients live, not the arithmetic"

# %% [markdown]
# ## Each rank's memory, over time
#
# Every rank ran its own ledger and wrote its timeline. The phases are Lab 02's, plus `wrap`
# (the `DDP(...)` call: rank 0's weights are broadcast and the first bucket is allocated) and
# `check` (the replica digests and the global loss). The dashed line is **derived**, not
# measured: parameters and buckets (4 + 4 bytes per parameter) from the start, gradients (4 bytes
# per parameter) from the end of backward to the next `zero_grad`, and AdamW's moments
# (8 bytes per parameter + 4 per tensor) from the first optimizer step.

# %%
def model_state_prediction(tl: Timeline, P: int, T: int) -> list[int]:
    """Derived bytes per row: 4P params + 4P buckets (after wrap) + 4P grads (when alive) + AdamW."""
    rows, grads, adam, wrapped = [0] * len(tl), False, False, False
    for span in sorted(tl.spans, key=lambda s: s.start):
        if span.name == "zero_grad":
            grads = False
        for i in range(span.start, len(tl)):
            rows[i] = 4 * P + (4 * P if wrapped or span.name == "wrap" else 0) + (4 * P if grads else 0) \
                + ((8 * P + 4 * T) if adam else 0)
        wrapped = wrapped or span.name == "wrap"
        grads = grads or span.name == "backward"
        adam = adam or span.name == "optimizer"
    return rows


ledgers = {rank: json.loads((LEDGERS / f"rank{rank}.json").read_text()) for rank in (0, 1)}
fig, axes = plt.subplots(2, 1, figsize=(10, 7.6), dpi=110, layout="constrained", sharex=True)
for ax, (rank, data) in zip(axes, ledgers.items()):
    tl = Timeline.from_dict(data["timeline"])
    predicted = model_state_prediction(tl, P, T)
    plot.plot_timeline(tl, ax=ax, title=f"rank {rank} of 2 on {DEVICE.type} (measured by its own ledger)",
                       overlay={"derived: params + buckets + grads + AdamW": predicted}, legend=rank == 0)
    if DEVICE.type == "cpu":  # the model state is exact wherever no activation or temporary is alive
        quiet = [i for i in range(len(tl)) if tl.phase[i] == "check"]
        state = ("parameters", "gradients", "optimizer_state", "communication")
        assert all(sum(tl.device[c][i] for c in state) == predicted[i] for i in quiet)
axes[1].set_xlabel("ledger events of each rank (every allocation and free, in order)")
plot.save(fig, OUT / "timeline.svg")

# %% [markdown]
# ## Memory per rank, by category
#
# Two moments of each rank: its peak (here at the turn from forward to backward, where the
# activations are) and the optimizer phase, where the whole model state is alive. Left: buckets
# separate from the gradients (DDP's default). Right: `--grad-as-bucket-view`.

# %%
CATS = ["parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication", "other"]
moments = [(mode, m["rank"], what, row) for mode in ("copy", "view") for m in runs[mode]["memory"]
           for what, row in (("peak", m["peak"]), ("optimizer", m["peaks_by_phase"]["optimizer"]))]
unit, size = plot.pick_unit(max(sum(row[c] for c in CATS) for *_, row in moments))
fig2, axes2 = plt.subplots(1, 2, figsize=(11, 3.8), dpi=110, layout="constrained", sharey=True)
for ax, mode in zip(axes2, ("copy", "view")):
    bars = [(f"rank {rank}\n{what}", row) for m, rank, what, row in moments if m == mode]
    bottom = [0.0] * len(bars)
    for c in CATS:
        heights = [row[c] / size for _, row in bars]
        ax.bar(range(len(bars)), heights, bottom=bottom, color=plot.CATEGORY_COLORS[c], label=c.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    title = "gradients copied into buckets" if mode == "copy" else "--grad-as-bucket-view"
    ax.set_title(f"{title} (measured)", fontsize=10, loc="left")
    ax.grid(axis="y", alpha=0.3)
axes2[0].set_ylabel(f"device bytes per rank ({unit})")
axes2[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
plot.save(fig2, OUT / "memory_per_rank.svg")

# %% [markdown]
# The optimizer phase of each rank, byte for byte, next to the formulas (**derived**; P parameters
# in T tensors): on CPU they must be equal, and the notebook asserts it. `copy` is DDP's default,
# `view` the run with `--grad-as-bucket-view`; "the rest" is activations, temporaries and other.

# %%
derived = {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P + 4 * T, "communication": 4 * P}
rows = ["| run, rank | parameters (4P) | gradients (4P) | AdamW state (8P + 4T) | buckets (4P) | the rest | total |",
        "|---|---:|---:|---:|---:|---:|---:|"]
rows.append(f"| derived | {4 * P:,} | {4 * P:,} | {8 * P + 4 * T:,} | {4 * P:,} | | {20 * P + 4 * T:,} + the rest |")
for mode in ("copy", "view"):
    for m in runs[mode]["memory"]:
        opt = m["peaks_by_phase"]["optimizer"]
        rest = opt["activations"] + opt["temporaries"] + opt["other"]
        rows.append(f"| {mode}, {m['rank']} | {opt['parameters']:,} | {opt['gradients']:,} | "
                    f"{opt['optimizer_state']:,} | {opt['communication']:,} | {rest:,} | {sum(opt[c] for c in CATS):,} |")
        if DEVICE.type == "cpu":
            expect = dict(derived, gradients=0) if mode == "view" else derived
            assert all(opt[c] == v for c, v in expect.items()), (mode, m["rank"], opt)
memory_table = "\n".join(rows)
nbk.show_markdown(memory_table)
peak_table = plot.peak_table({f"{mode}, {m['rank']}": m["peak"] for mode in ("copy", "view") for m in runs[mode]["memory"]},
                             label="run, rank")
nbk.show_markdown(peak_table)
print("Not seen by the ledger:", r["not_seen"])

# %% [markdown]
# ## The buckets
#
# What the communication hook saw in the last step: each bucket's parameters in the order DDP laid
# them out, and its bytes. The layout is **derived** twice: from the parameter sizes in reverse
# definition order (the bytes must match), and from the order in which gradients became ready in
# step 0, which a post-accumulate-grad hook recorded (the parameters must match, in order). DDP's
# own logging data (a private API, read guardedly) must agree as well.

# %%
b = r["buckets"]
with torch.device("meta"):  # the same model, shapes only: every parameter's bytes without memory
    shapes = lab.TinyGPT(lab.GPTConfig(**r["config"]))
nbytes = {n: p.numel() * p.element_size() for n, p in shapes.named_parameters()}
reported = b["ddp_reported"]


def group(name: str) -> str:
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "MLP"
    return "norms" if "ln" in name else "embeddings, head"


GROUP_COLORS = {"embeddings, head": "#4C72B0", "attention": "#DD8452", "MLP": "#55A868", "norms": "#C44E52"}
fig3, ax3 = plt.subplots(figsize=(10, 0.5 * len(b["buckets"]) + 1.4), dpi=110, layout="constrained")
unit3, size3 = plot.pick_unit(max(x["bytes"] for x in b["buckets"]))
for row, bucket in enumerate(b["buckets"]):
    left = 0
    for name in bucket["params"]:
        ax3.barh(row, nbytes[name] / size3, left=left / size3, color=GROUP_COLORS[group(name)], edgecolor="white", lw=0.6)
        left += nbytes[name]
    assert left == bucket["bytes"], "the bucket holds exactly its parameters' gradients"
ax3.axvline(b["cap_bytes"] / size3, color="black", ls="--", lw=1.2, label=f"cap: --bucket-cap-mb {r['bucket_cap_mb']}")
ax3.set_yticks(range(len(b["buckets"])), [f"bucket {x['index']}" for x in b["buckets"]])
ax3.invert_yaxis()
ax3.set_xlabel(f"bytes ({unit3}), parameters in the order DDP laid them out")
ax3.set_title("DDP's buckets after the rebuild, as the communication hook saw them (measured)", loc="left", fontsize=10)
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in GROUP_COLORS.values()]
ax3.legend(handles + ax3.get_legend_handles_labels()[0], [*GROUP_COLORS, ax3.get_legend_handles_labels()[1][0]],
           loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
ax3.grid(axis="x", alpha=0.3)
plot.save(fig3, OUT / "buckets.svg")

def compact(names: list[str]) -> str:
    """`blocks.1.mlp.down.bias`, `blocks.1.mlp.down.weight` -> `blocks.1.mlp.down.{bias,weight}`."""
    groups: list[tuple[str, list[str]]] = []
    for name in names:
        module, _, leaf = name.rpartition(".")
        if groups and groups[-1][0] == module:
            groups[-1][1].append(leaf)
        else:
            groups.append((module, [leaf]))
    return " ".join(f"`{m}.{leaves[0]}`" if len(leaves) == 1 else f"`{m}.{{{','.join(leaves)}}}`"
                    for m, leaves in groups)


derived_bytes = [sum(nbytes[n] for n in bucket) for bucket in b["derived_reverse_order"]]
rows = ["| bucket | hook saw | derived | DDP's log | parameters, in layout order |", "|---:|---:|---:|---:|---|"]
for i, bucket in enumerate(b["buckets"]):
    logged = f"{reported['bytes'][i]:,}" if reported else "n/a"
    rows.append(f"| {bucket['index']} | {bucket['bytes']:,} | {derived_bytes[i]:,} | {logged} | "
                f"{compact(bucket['params'])} |")
buckets_table = "\n".join(rows)
nbk.show_markdown(buckets_table)
checks = {"bytes per bucket = derived from sizes in reverse order": b["bytes_match_reverse_order"],
          "parameters per bucket = derived from the step-0 ready order": b["params_match_ready_order"],
          "DDP's logging data (private API) agrees": b["ddp_reported_matches"],
          "every rank saw the same buckets": r["buckets_equal_on_all_ranks"]}
bucket_checks_table = "\n".join(["| check | result |", "|---|:---:|"]
                                 + [f"| {k} | {'yes' if v else ('n/a' if v is None else 'NO')} |" for k, v in checks.items()])
nbk.show_markdown(bucket_checks_table)
print("buckets in step 0:", len(b["first_backward"]), "| after the rebuild:", len(b["buckets"]),
      "| sum of bucket bytes:", f"{sum(x['bytes'] for x in b['buckets']):,}", "= 4P:", f"{4 * P:,}")
assert len(b["first_backward"]) == 1 and sum(x["bytes"] for x in b["buckets"]) == 4 * P
assert b["bytes_match_reverse_order"] and b["params_match_ready_order"] and b["ddp_reported_matches"] is not False


# %% [markdown]
# ## Identical replicas, every step
#
# After each step every rank hashes its parameters' bytes (SHA-256) and the digests are
# all-gathered. The ranks start from different seeds on purpose (`seed + rank`): `DDP(...)`
# broadcasts rank 0's weights, and from then on the averaged gradients keep them equal.

# %%
identical_table = "\n".join(["| moment | all ranks bit-identical |", "|---|:---:|"]
                            + [f"| {k} | {'yes' if v else 'no'} |" for k, v in r["replicas_identical"].items()])
nbk.show_markdown(identical_table)
assert not r["replicas_identical"]["before DDP"]
assert all(v for k, v in r["replicas_identical"].items() if k != "before DDP")

# %% [markdown]
# ## One process on the concatenated batch
#
# Rank 0 replays the training in one process on both ranks' sequences at once, from the same
# initial weights. The result is equal up to rounding, not bit for bit: a weight gradient is a sum
# over every token, which DDP computes as two per-rank sums added by the all-reduce, in another
# order than one sum over the whole batch. The tolerance is stated in the starter (`TOLERANCE`).

# %%
ref = r["reference"]
what = {"loss": "losses, every step: max abs diff / max abs loss",
        "grads": "last gradients: max abs diff / max abs gradient",
        "params": "parameters: norm of diff / norm of how far they moved"}
reference_table = "\n".join(
    ["| quantity | measured ratio | allowed | within |", "|---|---:|---:|:---:|"]
    + [f"| {what[k]} | {ref[k]['ratio']:.1e} | {ref['tolerance'][k]:.0e} | {'yes' if ref[k]['within'] else 'NO'} |"
       for k in ("loss", "grads", "params")])
w = ref["largest_element_diff"]
reference_table += (f"\n| largest single parameter difference (not checked: see the text) | {w['abs']:.1e} "
                    f"in `{w['param']}` | | |\n| bit for bit equal | {'yes' if ref['bit_exact'] else 'no'} | | |")
nbk.show_markdown(reference_table)
losses_table = "\n".join(
    ["| step | DDP, global loss | one process | difference |", "|---:|---:|---:|---:|"]
    + [f"| {i} | {a:.7f} | {c:.7f} | {a - c:+.1e} |" for i, (a, c) in enumerate(zip(r["losses"], ref["reference_losses"]))])
nbk.show_markdown(losses_table)
assert all(ref[k]["within"] for k in ("loss", "grads", "params"))

# %% [markdown]
# ## Allocated against reserved (CUDA only)
#
# On a GPU each rank's ledger also samples `torch.cuda.memory_allocated`, and the run can export
# one `_record_memory_history` snapshot per rank. Each rank holds its ledger against the
# allocator over the last step: the allocator's peak is reset as the step starts, and the bytes
# it already held that the ledger never saw (memory a library allocates inside a kernel call and
# keeps, such as a matmul workspace) are set aside.
# On a CPU run there is no caching allocator.

# %%
if ON_GPU:
    for m in r["memory"]:
        c = m["cuda"]
        print(f"rank {m['rank']}, last step: max allocated {plot.format_bytes(c['max_memory_allocated'])}, "
              f"of which unseen by the ledger before it {plot.format_bytes(c['unseen_before_window'])}; "
              f"ledger peak / the rest = {c['ledger_over_allocator']:.4f}")
else:
    print("CPU run: no CUDA allocator here, so no allocated/reserved lines and no snapshot.")

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {k: v for k, v in r.items() if k != "provenance"}
summary["grad_as_bucket_view_run"] = {"losses": runs["view"]["losses"], "memory": runs["view"]["memory"]}
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE, r["provenance"]["wall_time_s"]))
tables = {"memory": memory_table, "peaks": peak_table, "buckets": buckets_table, "bucket_checks": bucket_checks_table,
          "identical": identical_table,
          "reference": reference_table, "losses": losses_table}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
