"""Lab 11 - ZeRO and FSDP: one training run at ZeRO stages 0 to 3, memory measured on every rank.

The same small GPT trains on N ranks (torchrun), each rank on its own micro-batch, four ways:

    stage 0  DistributedDataParallel: every rank holds every byte (the reference)
    stage 1  DDP + ZeroRedundancyOptimizer: each rank keeps the AdamW state of its own parameters
    stage 2  FSDP2 fully_shard(reshard_after_forward=False): parameters, gradients and AdamW state
             sharded; the gathered weights stay from forward until the end of backward
    stage 3  FSDP2 fully_shard(reshard_after_forward=True): each block's gathered weights are freed
             after its forward and gathered again for its backward

Every rank runs its own memory ledger (labkit). Rank 0 prints, for every stage and rank, the bytes of
parameters, gradients, optimizer state and communication buffers next to Lab 01's ZeRO formulas
(``zero_model_state``), and the losses next to DDP's. The other ranks print nothing.

Run it (gloo on CPU; on CUDA, NCCL with one GPU per rank, gloo when ranks share a GPU):
    torchrun --nproc_per_node=2 code/lab-11-zero-fsdp/zero_fsdp.py --device cpu
    torchrun --nproc_per_node=2 code/lab-11-zero-fsdp/zero_fsdp.py --device cpu --stage 3 --json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "lab-01-memory-accounting")]  # labkit, bench, Lab 01

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import positive_float, positive_int  # noqa: E402
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak  # noqa: E402
from labkit.dist import CheckFailed, ranked, start, writable_dir  # noqa: E402
from memory_accounting import zero_model_state  # noqa: E402  (Lab 01: the formulas we check)
from ranks import Traffic, cut, gather, local  # noqa: E402

LAB = "lab-11-zero-fsdp"
STAGES = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 reshard_after_forward=False",
          3: "FSDP2 reshard_after_forward=True"}
LOSS_RTOL = 1e-5  # losses (relative) and final parameters (absolute) against DDP; CPU runs measure 0
MODEL_STATE = ("parameters", "gradients", "optimizer_state")


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Train a toy GPT at ZeRO stages 0-3 under torchrun; memory per rank against Lab 01.")
    p.add_argument("--stage", choices=["0", "1", "2", "3", "all"], default="all",
                   help="which stage to run; all runs 0, 1, 2, 3 (stage 0 is the reference)")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps per stage")
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=positive_int, default=32)
    p.add_argument("--width", type=positive_int, default=64)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--timelines", action="store_true", help="--json: add rank 0's ledger timeline of the last step")
    p.add_argument("--snapshot", type=Path, help="CUDA only: memory history, one pickle per stage and rank (NAME.stageS.rankR.pickle)")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.snapshot and pick_device(args.device).type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    if args.snapshot:
        writable_dir(args.snapshot.parent, "--snapshot")  # before training: a bad path must not cost a run
    args.stages = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
    return args
# --8<-- [end:config]


# --8<-- [start:wrap]
def wrap(stage: int, model: TinyGPT, mesh, lr: float):
    """The only place the stages differ: which rank holds which bytes."""
    if stage <= 1:
        on_gpu = mesh.device_type == "cuda"
        ddp = DDP(model, device_ids=[torch.cuda.current_device()] if on_gpu else None)  # (1)!
        if stage == 0:
            return ddp, torch.optim.AdamW(model.parameters(), lr=lr)
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)  # (2)!
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=(stage == 3))  # (3)!
    fully_shard(model, mesh=mesh, reshard_after_forward=(stage == 3))  # (4)!
    return model, torch.optim.AdamW(model.parameters(), lr=lr)  # (5)!
# --8<-- [end:wrap]


# --8<-- [start:label]
def label_model_state(ledger: Ledger, model, optimizer) -> None:
    """Parameters, gradients and AdamW state, counted as what THIS rank holds."""
    opt = getattr(optimizer, "optim", optimizer)  # (1)!
    params = list(model.parameters())
    ledger.track([local(p) for p in params], "parameters")  # (2)!
    ledger.track([local(p.grad) for p in params if p.grad is not None], "gradients")
    ledger.track([local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
                 "optimizer_state")
# --8<-- [end:label]


# --8<-- [start:step]
def train_step(model, optimizer, x, y, ledger: Ledger, step: int) -> float:
    with ledger.phase("zero_grad", step):
        optimizer.zero_grad(set_to_none=True)
    with ledger.phase("forward", step):
        loss = model(x, y)[1]  # (1)!
    with ledger.phase("backward", step):
        loss.backward()  # (2)!
    with ledger.phase("optimizer", step):
        optimizer.step()  # (3)!
    label_model_state(ledger, model, optimizer)  # (4)!
    return loss.item()
# --8<-- [end:step]


def full_params(model) -> torch.Tensor:
    """Every parameter, whole, on every rank (DTensor.full_tensor() all-gathers a sharded one)."""
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().cpu()
                      for p in model.parameters()])


# --8<-- [start:run]
def run_stage(stage: int, args, device, mesh, rank: int, world: int) -> dict:
    torch.manual_seed(args.seed)  # the same initial weights on every rank and at every stage
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width, layers=args.layers,
                    heads=args.heads, dropout=0.0)
    model, optimizer = wrap(stage, TinyGPT(cfg).to(device), mesh, args.lr)
    data = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=args.seed)
    ledger = Ledger(device)
    label_model_state(ledger, model, optimizer)
    traffic = Traffic(ledger)  # (1)!
    snapshot = args.snapshot and args.snapshot.with_name(f"{args.snapshot.stem}.stage{stage}.rank{rank}.pickle")
    losses, t0 = [], time.perf_counter()
    with record_snapshot(snapshot), ledger, traffic:
        for step in progress(range(args.steps), total=args.steps, desc=f"stage {stage}", quiet=args.json or rank):
            if step == args.steps - 1:
                reset_peak(device)  # CUDA: the allocator's peak over the last step, like the ledger's
            x, y = data.batch(step * world + rank, args.batch_size, device)  # (2)!
            losses.append(train_step(model, optimizer, x, y, ledger, step))
    tl = ledger.timeline()
    last = [s for s in tl.spans if s.step == args.steps - 1]
    lo, hi = min(s.start for s in last), max(s.end for s in last)
    steady = cut(tl, lo, hi)  # (3)!
    moved = traffic.summary()
    scatter = moved["collectives"].get("_reduce_scatter_base_", {}).get("largest_in_bytes", 0)
    hidden = scatter if dist.get_backend() == "gloo" else 0  # gloo copies each reduce-scatter input
    return {"losses": losses, "at_end": ledger.at_end(), "peak_last_step": ledger.peak(steady),
            "peaks_by_phase_last_step": ledger.peaks_by_phase(steady), "traffic": moved,
            "cuda": ledger_vs_allocator(tl, allocator_stats(device), lo, hidden),  # (4)!
            "wall_time_s": time.perf_counter() - t0,
            "final_params": full_params(model), "timeline": steady.to_dict() if rank == 0 and args.timelines else None}
# --8<-- [end:run]


def report_stage(stage: int, ranks: list[dict], cfg: dict, reference: dict | None) -> dict:
    """Rank 0: the per-rank measurements of one stage, Lab 01's formulas, and the match with DDP."""
    world, params, tensors = len(ranks), cfg["params"], cfg["tensors"]
    derived = zero_model_state(params, "fp32", "adamw", zero_stage=stage, dp=world, tensors=tensors)  # (Lab 01)
    losses = [sum(r["losses"][i] for r in ranks) / world for i in range(len(ranks[0]["losses"]))]
    final = ranks[0]["final_params"]
    out = {"stage": stage, "name": STAGES[stage], "losses": losses,
           "lab01": {k: derived[k] for k in MODEL_STATE} | {"master_weights": derived["master_weights"]},
           "ranks": [{k: v for k, v in r.items() if k not in ("final_params", "timeline")} for r in ranks],
           "timeline": ranks[0]["timeline"], "max_loss_rel_diff_vs_ddp": None, "max_param_abs_diff_vs_ddp": None}
    if reference is not None:
        out["max_loss_rel_diff_vs_ddp"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
        out["max_param_abs_diff_vs_ddp"] = (final - reference["final_params"]).abs().max().item()
    return out


def train(args) -> dict:
    device, _ = start("code/lab-11-zero-fsdp/zero_fsdp.py", args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width, layers=args.layers, heads=args.heads)
    probe = TinyGPT(cfg)
    info = {"config": cfg.to_dict() | {"batch_size": args.batch_size, "steps": args.steps, "lr": args.lr},
            "params": sum(p.numel() for p in probe.parameters()), "tensors": len(list(probe.parameters()))}
    stages, reference, t0 = [], None, time.perf_counter()
    for stage in args.stages:
        ranks = gather(run_stage(stage, args, device, mesh, rank, world))  # (collective) every rank's numbers
        if rank == 0:
            stages.append(report_stage(stage, ranks, info, reference))
            if stage == 0:
                reference = {"losses": stages[-1]["losses"], "final_params": ranks[0]["final_params"]}
    dist.barrier()  # the ranks leave together: gloo aborts a process whose peer has already gone
    return {"lab": LAB, "device": str(device), "backend": dist.get_backend(), "world_size": world, "rank": rank,
            **info, "loss_rtol": LOSS_RTOL, "stages": stages,
            "provenance": provenance.collect(LAB, device, time.perf_counter() - t0)}


def print_report(result: dict) -> None:
    from labkit.plot import format_bytes  # matplotlib: only rank 0, only for the human report

    n, p = result["world_size"], result["params"]
    print(f"Lab 11 on {result['device']} ({result['backend']}, {n} ranks): TinyGPT with {p:,} parameters "
          f"in {result['tensors']} tensors, AdamW fp32, {result['config']['steps']} steps per stage")
    print("\nModel state per rank at the end of the run (ledger, measured) against Lab 01's zero_model_state "
          "(derived),\nand the peak of the last step with the communication buffers inside it:")
    print(f"{'stage':<6}{'rank':>4}  {'parameters':>23}  {'gradients':>23}  {'optimizer state':>23}  "
          f"{'comm @peak':>11}  {'peak':>10}")
    for s in result["stages"]:
        for r, rank in enumerate(s["ranks"]):
            cells = [f"{format_bytes(rank['at_end'][k])} / {format_bytes(s['lab01'][k])}" for k in MODEL_STATE]
            peak = rank["peak_last_step"]
            print(f"{s['stage']:<6}{r:>4}  " + "".join(f"{c:>23}  " for c in cells)
                  + f"{format_bytes(peak['communication']):>11}  {format_bytes(peak['total']):>10}")
    print("(each cell: measured / Lab 01)")
    for s in result["stages"]:
        diff = s["max_loss_rel_diff_vs_ddp"]
        match = "" if diff is None else f"; vs DDP: loss rel. diff {diff:.1e}, params {s['max_param_abs_diff_vs_ddp']:.1e}"
        print(f"stage {s['stage']} ({s['name']}): losses {[round(v, 4) for v in s['losses']]}{match}")


def check(result: dict) -> None:
    """Every stage must train like DDP within the stated tolerance. Checked after the report, so the
    numbers are on screen; a broken tolerance is not bad input: one line and exit code 1, not 2."""
    for s in result["stages"]:
        loss, params = s["max_loss_rel_diff_vs_ddp"], s["max_param_abs_diff_vs_ddp"]
        if loss is not None and not (loss <= LOSS_RTOL and params <= LOSS_RTOL):  # NaN fails too
            raise CheckFailed(f"stage {s['stage']} differs from DDP beyond {LOSS_RTOL:.0e}: "
                              f"loss rel. diff {loss:.1e}, params abs. diff {params:.1e}")


def main(argv=None) -> None:
    args = parse_args(argv)
    result = train(args)
    if result["rank"] != 0:
        return
    emit_json(result) if args.json else print_report(result)
    check(result)


if __name__ == "__main__":
    run_lab(ranked(main))
