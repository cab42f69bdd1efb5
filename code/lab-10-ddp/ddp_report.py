"""Lab 10's harness: what one rank measured, the result and its JSON summary, the tables the
console and the page show, the human report.

Bookkeeping only; the lesson is in ``train_ddp.py``. The tables read a summary (the JSON object
rank 0 prints under ``--json``), so a notebook that launched torchrun builds the same tables as
the console.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from labkit import labs, provenance
from labkit.table import Table, by_category, format_bytes
from labkit.timeline import Timeline

#: the categories of the memory table's total (no host copies in this lab)
TOTAL = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication", "other")
MODEL_STATE = ("parameters", "gradients", "optimizer_state", "communication")


@dataclass
class RankRun:
    """What one rank's training left: its DDP model, its ledger and timeline, what the hooks saw."""

    ddp: torch.nn.Module
    ledger: object
    timeline: Timeline
    backwards: list[list[dict]]  # each backward's buckets, as the communication hook saw them
    ready: list[str]  # parameter names in the order their gradients became ready in step 0
    names: list[str]  # parameter names in definition order
    losses: list[float]
    identical: dict[str, bool]
    wall_time_s: float
    cuda: dict | None


def memory_report(tl: Timeline, rank: int, cuda: dict | None) -> dict:
    """One rank's device bytes by category: at its peak, at each phase's peak, at the end; on CUDA,
    the ledger against the allocator over the last step (``labkit.cuda.ledger_vs_allocator``)."""
    return {"rank": rank, "peak": tl.peak(), "peaks_by_phase": tl.peaks_by_phase(), "at_end": tl.at_end(),
            "events": len(tl), "cuda": cuda}


def compare(ddp_model, ddp_losses, ref_model, ref_start, ref_losses, tolerance: dict) -> dict:
    """DDP against one process: losses, last gradients, parameters (train_ddp.TOLERANCE says why).

    ``ddp_model``, ``ddp_losses``: rank 0's module and global losses; ``ref_model``, ``ref_start``,
    ``ref_losses``: the single-process replay, its initial parameters and its losses;
    ``tolerance``: the allowed ratio for each of ``loss``, ``grads``, ``params``."""
    named = [(n, a, b) for (n, a), b in zip(ddp_model.named_parameters(), ref_model.parameters())]
    diffs = {"loss": (max(abs(a - b) for a, b in zip(ddp_losses, ref_losses)), max(abs(v) for v in ref_losses)),
             "grads": (max((a.grad - b.grad).abs().max().item() for _, a, b in named),
                       max(b.grad.abs().max().item() for _, _, b in named)),
             "params": (_norm(a - b for _, a, b in named), _norm(b - s for (_, _, b), s in zip(named, ref_start)))}
    out = {k: {"diff": d, "scale": s, "ratio": d / s, "within": d <= tolerance[k] * s} for k, (d, s) in diffs.items()}
    worst = max(named, key=lambda t: (t[1] - t[2]).abs().max().item())
    return out | {"tolerance": tolerance, "reference_losses": ref_losses,
                  "largest_element_diff": {"param": worst[0], "abs": (worst[1] - worst[2]).abs().max().item()},
                  "bit_exact": all(torch.equal(a, b) for _, a, b in named)}


def _norm(tensors) -> float:
    return sum(t.double().square().sum() for t in tensors).sqrt().item()


def ddp_reported(ddp, names: list[str]) -> dict | None:
    """DDP's own account of its rebuilt buckets. ``_get_ddp_logging_data`` is a private prototype
    API (DDP's docstring shows it), so it is guarded: None when it is absent, has changed, or has
    not logged the rebuilt buckets yet (it does so in the third step's forward)."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = [int(s) for s in str(data["rebuilt_bucket_sizes"]).split(",")]
        indices = [[int(i) for i in b.split()] for b in str(data["rebuilt_per_bucket_param_indices"]).split(",")]
        return {"bytes": sizes, "params": [[names[i] for i in b] for b in indices],
                "cap_bytes": int(data["bucket_cap_bytes"])}
    except (AttributeError, KeyError, ValueError, IndexError, RuntimeError):
        return None


def bucket_report(trained: RankRun, cap: int, derive) -> dict:
    """The buckets DDP reduced in the last step against the layouts ``derive`` gives
    (``train_ddp.derive_buckets``, with a cap of ``cap`` bytes) and against DDP's own account."""
    sizes = {n: p.numel() * p.element_size() for n, p in trained.ddp.module.named_parameters()}
    seen = trained.backwards[-1]
    reverse = derive([(n, sizes[n]) for n in reversed(trained.names)], cap)
    ready = derive([(n, sizes[n]) for n in trained.ready], cap)
    reported = ddp_reported(trained.ddp, trained.names)
    return {"cap_bytes": cap, "first_backward": trained.backwards[0], "buckets": seen,
            "ready_order": trained.ready, "derived_reverse_order": reverse, "param_bytes": sizes,
            "derived_reverse_order_bytes": [sum(sizes[n] for n in b) for b in reverse],
            "bytes_match_reverse_order": [sum(sizes[n] for n in b) for b in reverse] == [b["bytes"] for b in seen],
            "params_match_ready_order": ready == [b["params"] for b in seen],
            "ddp_reported": reported,
            "ddp_reported_matches": None if reported is None else (
                reported["bytes"] == [b["bytes"] for b in seen] and reported["params"] == [b["params"] for b in seen])}


def model_settings(config) -> dict:
    """The model a run trained: TinyGPT's shape, or the zoo entry ``--model`` names (and the tokens
    per sequence)."""
    spec = config.model_spec()
    return asdict(config.model_config()) if spec is None else asdict(spec) | {"seq_len": config.seq_len}


@dataclass
class Result:
    """Rank 0's view of the run: its own training, every rank's memory, the replay's comparison."""

    config: object  # train_ddp.Config
    trained: RankRun
    device: torch.device
    backend: str
    buckets: dict  # bucket_report
    per_rank: list[dict]  # memory_report of every rank, with the buckets it saw
    reference: dict | None  # compare(), None under --no-reference

    @property
    def identical(self) -> dict[str, bool]:
        return self.trained.identical

    def summary(self) -> dict:
        params = list(self.trained.ddp.module.parameters())
        c = self.config
        return {
            "lab": labs.slug(__file__), "device": str(self.device), "backend": self.backend,
            "world_size": len(self.per_rank), "model": c.model, "config": model_settings(c),
            "batch_per_rank": c.batch_size, "steps": c.steps, "lr": c.lr,
            "params": sum(p.numel() for p in params), "param_tensors": len(params),
            "bucket_cap_mb": c.bucket_cap_mb, "grad_as_bucket_view": c.grad_as_bucket_view,
            "losses": self.trained.losses, "replicas_identical": self.identical,
            "buckets": self.buckets,
            "buckets_equal_on_all_ranks": all(r["buckets"] == self.buckets["buckets"] for r in self.per_rank),
            "reference": self.reference,
            "memory": [{k: v for k, v in r.items() if k != "buckets"} for r in self.per_rank],
            "not_seen": f"{self.backend}'s own buffers (allocated outside PyTorch's dispatcher)",
            "provenance": provenance.collect(__file__, self.device, self.trained.wall_time_s),
        }


# ---------------------------------------------------------------------- tables, from summaries
def memory_table(runs: dict[str, dict]) -> Table:
    """Each rank's bytes in the optimizer phase of each run (``runs``: name -> summary), under the
    model-state formulas: P parameters in T tensors."""
    first = next(iter(runs.values()))
    p, t = first["params"], first["param_tensors"]
    table = Table(["run, rank", ("parameters (4P)", "B"), ("gradients (4P)", "B"), ("AdamW state (8P + 4T)", "B"),
                   ("buckets (4P)", "B"), ("the rest", "B"), ("total", "B")],
                  [["derived, without the rest", 4 * p, 4 * p, 8 * p + 4 * t, 4 * p, None, 20 * p + 4 * t]])
    for name, summary in runs.items():
        for m in summary["memory"]:
            phase = m["peaks_by_phase"]["optimizer"]
            rest = phase["activations"] + phase["temporaries"] + phase["other"]
            table.add(f"{name}, {m['rank']}", *(phase[c] for c in MODEL_STATE), rest, sum(phase[c] for c in TOTAL))
    return table


def peaks_table(runs: dict[str, dict]) -> Table:
    """The peak of each rank in each run, by category."""
    return by_category({f"{name}, {m['rank']}": m["peak"] for name, s in runs.items() for m in s["memory"]},
                       label="run, rank")


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


def buckets_table(summary: dict) -> Table:
    """Each bucket of the last step: the hook's bytes, the derived bytes, DDP's logged bytes, and
    its parameters in layout order."""
    b = summary["buckets"]
    logged = (b["ddp_reported"] or {}).get("bytes") or [None] * len(b["buckets"])
    return Table([("bucket", "int"), ("hook saw", "int"), ("derived", "int"), ("DDP's log", "int"),
                  "parameters, in layout order"],
                 [[x["index"], x["bytes"], derived, log, compact(x["params"])]
                  for x, derived, log in zip(b["buckets"], b["derived_reverse_order_bytes"], logged)])


def bucket_checks_table(summary: dict) -> Table:
    b = summary["buckets"]
    return Table(["check", ("result", "yes")], [
        ["bytes per bucket = derived from sizes in reverse order", b["bytes_match_reverse_order"]],
        ["parameters per bucket = derived from the step-0 ready order", b["params_match_ready_order"]],
        ["DDP's logging data (private API) agrees", b["ddp_reported_matches"]],
        ["every rank saw the same buckets", summary["buckets_equal_on_all_ranks"]]])


def identical_table(summary: dict) -> Table:
    return Table(["moment", ("all ranks bit-identical", "yes")], [list(kv) for kv in summary["replicas_identical"].items()])


def reference_table(summary: dict) -> Table:
    """DDP against the single-process replay: each ratio, its tolerance, and the largest element."""
    ref = summary["reference"]
    what = {"loss": "losses, every step: max abs diff / max abs loss",
            "grads": "last gradients: max abs diff / max abs gradient",
            "params": "parameters: norm of diff / norm of how far they moved"}
    worst = ref["largest_element_diff"]
    return Table(["quantity", ("measured", "sci:1"), ("allowed", "sci:0"), ("within", "yes"), ("in", "code")],
                 [[what[k], ref[k]["ratio"], ref["tolerance"][k], ref[k]["within"], None] for k in what]
                 + [["largest single parameter difference (not checked: see the text)", worst["abs"], None, None,
                     worst["param"]]])


def losses_table(summary: dict) -> Table:
    ref = summary["reference"]
    return Table([("step", "int"), ("DDP, global loss", "float:7"), ("one process", "float:7"), ("difference", "sci:1")],
                 [[i, a, b, a - b] for i, (a, b) in enumerate(zip(summary["losses"], ref["reference_losses"]))])


# ---------------------------------------------------------------------- the report
def report(result: Result) -> None:
    print_summary(result.summary())


def print_summary(r: dict) -> None:
    """The human report of a summary (what ``--json`` prints)."""
    print(f"Lab 10 on {r['device']}: {r['world_size']} ranks ({r['backend']}), TinyGPT with {r['params']:,} "
          f"parameters, AdamW, {r['steps']} steps of {r['batch_per_rank']} sequences per rank")
    same = r["replicas_identical"]
    for step, loss in enumerate(r["losses"]):
        print(f"  step {step}  global loss {loss:.4f}  replicas identical: {same[f'step {step}']}")
    print(f"  replicas identical before DDP(): {same['before DDP']} (seed + rank); "
          f"after DDP(): {same['after DDP()']} (rank 0's weights broadcast)")
    b = r["buckets"]
    print(f"\nBuckets (cap {b['cap_bytes']:,} B) as the comm hook saw them in the last step "
          f"(step 0 had {len(b['first_backward'])}):")
    for bucket in b["buckets"]:
        p = bucket["params"]
        print(f"  bucket {bucket['index']}: {bucket['bytes']:>10,} B  {len(p):2d} tensors  {p[0]} ... {p[-1]}")
    print(bucket_checks_table(r).text())
    if r["reference"]:
        ref = r["reference"]
        print(f"\nOne process on the concatenated batch ({r['world_size']} x {r['batch_per_rank']} sequences), "
              f"difference / scale; bit for bit equal: {ref['bit_exact']}")
        print(reference_table(r).text())
    print("\nDevice bytes per rank at its peak and in the optimizer phase (ledger, measured):")
    print(by_category({f"rank {m['rank']} {what}": row for m in r["memory"]
                       for what, row in (("peak", m["peak"]), ("optimizer", m["peaks_by_phase"]["optimizer"]))},
                      label="rank, moment").text())
    print(f"communication = DDP's gradient buckets: {format_bytes(r['memory'][0]['at_end']['communication'])} "
          f"per rank. Not seen: {r['not_seen']}.")
    for m in r["memory"]:
        if m["cuda"]:
            c = m["cuda"]
            print(f"rank {m['rank']} CUDA, last step: max allocated {format_bytes(c['max_memory_allocated'])} "
                  f"(of which {format_bytes(c['unseen_before_window'])} unseen by the ledger before it), "
                  f"ledger peak / the rest = {c['ledger_over_allocator']:.3f}")
