"""Lab 10's reporting: what each rank's ledger measured, the JSON summary, the human report.

Bookkeeping only; the lesson is in ``train_ddp.py``.
"""

from __future__ import annotations

import torch

from labkit import Ledger
from labkit.plot import format_bytes, peak_table


def memory_report(ledger: Ledger, rank: int, cuda: dict | None) -> dict:
    """One rank's device bytes by category: at its peak, at each phase's peak, at the end; on CUDA,
    the ledger against the allocator over the last step (``labkit.cuda.ledger_vs_allocator``)."""
    tl = ledger.timeline()
    return {"rank": rank, "peak": ledger.peak(tl), "peaks_by_phase": ledger.peaks_by_phase(tl),
            "at_end": ledger.at_end(tl), "events": len(tl), "cuda": cuda}


def compare(ddp_model, ddp_losses, ref_model, ref_start, ref_losses, tolerance: dict) -> dict:
    """DDP against one process: losses, last gradients, parameters (train_ddp.TOLERANCE says why)."""
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


def summary(lab: str, args, run: dict, device, backend: str, buckets: dict, per_rank: list, reference) -> dict:
    params = list(run["ddp"].module.parameters())
    return {
        "lab": lab, "device": str(device), "backend": backend, "world_size": len(per_rank),
        "config": run["cfg"].to_dict(), "batch_per_rank": args.batch_size, "steps": args.steps, "lr": args.lr,
        "params": sum(p.numel() for p in params), "param_tensors": len(params),
        "bucket_cap_mb": args.bucket_cap_mb, "grad_as_bucket_view": args.grad_as_bucket_view,
        "losses": run["losses"], "replicas_identical": run["identical"],
        "buckets": buckets,
        "buckets_equal_on_all_ranks": all(r["buckets"] == buckets["buckets"] for r in per_rank),
        "reference": reference,
        "memory": [{k: v for k, v in r.items() if k != "buckets"} for r in per_rank],
        "not_seen": f"{backend}'s own buffers (allocated outside PyTorch's dispatcher)",
    }


def report(r: dict) -> None:
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
    print(f"  derived from sizes in reverse order, same bytes: {b['bytes_match_reverse_order']}; "
          f"from the step-0 ready order, same parameters: {b['params_match_ready_order']}; "
          f"DDP's logging data agrees: {_said(b['ddp_reported_matches'])}")
    if r["reference"]:
        ref = r["reference"]
        print(f"\nOne process on the concatenated batch ({r['world_size']} x {r['batch_per_rank']} sequences), "
              f"difference / scale (allowed):")
        print(f"  losses       max |diff| / max |loss|   {ref['loss']['ratio']:.1e} ({ref['tolerance']['loss']:.0e})")
        print(f"  gradients    max |diff| / max |grad|   {ref['grads']['ratio']:.1e} ({ref['tolerance']['grads']:.0e})")
        print(f"  parameters   ||diff|| / ||update||     {ref['params']['ratio']:.1e} ({ref['tolerance']['params']:.0e})")
        w = ref["largest_element_diff"]
        print(f"  largest single difference: {w['abs']:.1e} in {w['param']}; bit for bit equal: {ref['bit_exact']}")
    rows = {f"rank {m['rank']} {what}": row for m in r["memory"]
            for what, row in (("peak", m["peak"]), ("optimizer", m["peaks_by_phase"]["optimizer"]))}
    print("\nDevice bytes per rank at its peak and in the optimizer phase (ledger, measured):")
    print(peak_table(rows, label="rank, moment"))
    print(f"communication = DDP's gradient buckets: {format_bytes(r['memory'][0]['at_end']['communication'])} "
          f"per rank. Not seen: {r['not_seen']}.")
    for m in r["memory"]:
        if m["cuda"]:
            c = m["cuda"]
            print(f"rank {m['rank']} CUDA, last step: max allocated {format_bytes(c['max_memory_allocated'])} "
                  f"(of which {format_bytes(c['unseen_before_window'])} unseen by the ledger before it), "
                  f"ledger peak / the rest = {c['ledger_over_allocator']:.3f}")


def _said(matches: bool | None) -> str:
    return "n/a (DDP logs its rebuilt buckets in the third step's forward)" if matches is None else str(matches)
