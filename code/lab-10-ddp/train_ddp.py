"""Lab 10 - data parallel training with DistributedDataParallel (DDP), measured per rank.

Lab 02's loop on N processes ("ranks"). Every rank holds the whole model and optimizer and trains
on its own slice of the batch. During backward, DDP copies gradients into flat *buckets* of about
``bucket_cap_mb`` and all-reduces each bucket as soon as it is full, so communication overlaps the
rest of backward. After the all-reduce every rank holds the same averaged gradient, takes the same
optimizer step, and the replicas stay identical.

What it checks and measures, on every rank:
  * the buckets (a communication hook sees each one: parameters and bytes), against the layout
    derived from the parameter sizes, and against what DDP itself reports;
  * that all ranks hold bit-identical parameters after every step (digests, all-gathered);
  * that training equals one process on the concatenated batch, within a stated tolerance;
  * memory per rank from a labkit Ledger, with the buckets as their own "communication" category.

Run it (gloo on CPU, NCCL when there is one GPU per rank):
    torchrun --nproc_per_node=2 code/lab-10-ddp/train_ddp.py --device cpu
    torchrun --nproc_per_node=2 code/lab-10-ddp/train_ddp.py --device cpu --grad-as-bucket-view
    torchrun --standalone --nproc_per_node=2 code/lab-10-ddp/train_ddp.py --device cpu --json
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable
sys.path.insert(0, str(Path(__file__).resolve().parent))  # and the report next to this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab-02-single-gpu-training"))  # Lab 02's step

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import positive_float, positive_int  # noqa: E402
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak  # noqa: E402
from labkit.dist import CheckFailed, ranked, start, writable_dir  # noqa: E402
from ddp_report import compare, memory_report, report, summary  # noqa: E402
from train_single_gpu import train_step  # noqa: E402  (Lab 02's step, unchanged: it gets the DDP model)

LAB = "lab-10-ddp"
SCRIPT = "code/lab-10-ddp/train_ddp.py"
MIB = 1024 * 1024
# DDP against one process is not bit-exact (see single_process_reference). Allowed differences:
# losses and last gradients, max |diff| / max |value| (a few fp32 roundings); parameters,
# ||diff|| / ||how far training moved them||. Not max |diff| for parameters: where a true gradient
# is zero (attention's key bias), AdamW divides rounding noise by eps and one weight may move apart.
TOLERANCE = {"loss": 1e-5, "grads": 1e-4, "params": 1e-2}


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Train a toy GPT data parallel with DDP: buckets, identical replicas, memory per rank.")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--width", type=positive_int, default=64)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=128)
    p.add_argument("--bucket-cap-mb", type=positive_float, default=0.05,
                   help="DDP bucket size cap in MiB (PyTorch's default is 25; tiny here to get several)")
    p.add_argument("--grad-as-bucket-view", action="store_true",
                   help="gradients become views into the buckets instead of separate tensors")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="auto: nccl with one GPU per rank, else gloo")
    p.add_argument("--ledger-dir", type=Path, help="every rank writes its ledger here as rank<N>.json")
    p.add_argument("--no-reference", action="store_true", help="skip rank 0's single-process replay")
    p.add_argument("--snapshot", type=Path, help="CUDA only: memory_viz pickles, one per rank")
    args = p.parse_args(argv)
    if args.steps < 2:
        raise UsageError("--steps must be at least 2: DDP rebuilds its buckets after the first backward")
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.snapshot and pick_device(args.device).type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (a CUDA allocator feature)")
    for flag, folder in (("--ledger-dir", args.ledger_dir), ("--snapshot", args.snapshot and args.snapshot.parent)):
        if folder:
            writable_dir(folder, flag)  # before training: a bad path must not cost a run
    return args
# --8<-- [end:config]


# --8<-- [start:hook]
class BucketLog:
    """What the hook below saw: for every backward, each bucket's parameters and bytes."""

    def __init__(self, ledger: Ledger, names: dict[int, str]):
        self.ledger, self.names, self.backwards = ledger, names, []


def logged_allreduce(log, bucket):  # no annotations: a string one (lazy annotations) fails DDP's check
    """A DDP communication hook: average the bucket with all_reduce, as DDP does by default, and
    record which parameters it holds and its bytes (``dist.GradBucket`` is a public API)."""
    buffer = bucket.buffer()  # (1)!
    log.ledger.track(buffer, "communication")  # (2)!
    if bucket.index() == 0:
        log.backwards.append([])  # buckets are reduced in index order: 0 opens a backward
    log.backwards[-1].append({"index": bucket.index(), "bytes": buffer.numel() * buffer.element_size(),
                              "params": [log.names[id(p)] for p in bucket.parameters()]})
    buffer.div_(dist.get_world_size())  # (3)!
    work = dist.all_reduce(buffer, async_op=True)  # (4)!
    return work.get_future().then(lambda fut: fut.value()[0])
# --8<-- [end:hook]


# --8<-- [start:derive]
def derive_buckets(sizes: list[tuple[str, int]], cap_bytes: int, first_cap_bytes: int | None = None):
    """DDP's rule: walk the gradients in the order they become ready, fill a bucket, and close it
    as soon as it holds at least the cap (the first bucket may have its own cap)."""
    buckets, current, filled = [], [], 0
    for name, nbytes in sizes:
        current.append(name)
        filled += nbytes
        cap = first_cap_bytes if first_cap_bytes and not buckets else cap_bytes
        if filled >= cap:  # (1)!
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])
# --8<-- [end:derive]


def ddp_reported(ddp: DDP, names: list[str]) -> dict | None:
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


def replicas_identical(module: torch.nn.Module) -> bool:
    """True when every rank's parameters are bit for bit the same: a digest per rank, all-gathered."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    return len(set(digests)) == 1


# --8<-- [start:train]
def train(args, device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width, layers=args.layers,
                    heads=args.heads, dropout=0.0)  # no dropout: each rank would draw its own masks
    torch.manual_seed(args.seed + rank)  # (1)!
    model = TinyGPT(cfg).to(device)
    names = [n for n, _ in model.named_parameters()]
    identical = {"before DDP": replicas_identical(model)}
    data = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=args.seed)
    ledger = Ledger(device)
    ledger.track_module(model)
    log, ready = BucketLog(ledger, {id(p): n for n, p in model.named_parameters()}), []
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: ready.append(n))
             for n, p in model.named_parameters()]  # (2)!
    reset_peak(device)
    losses, t0 = [], time.perf_counter()
    with record_snapshot(_per_rank(args.snapshot, rank)), ledger:
        with ledger.phase("wrap"), ledger.category("communication"):
            ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb,  # (3)!
                      gradient_as_bucket_view=args.grad_as_bucket_view)
        ddp.register_comm_hook(state=log, hook=logged_allreduce)
        identical["after DDP()"] = replicas_identical(ddp.module)  # (4)!
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        ledger.track_optimizer(optimizer)
        for step in progress(range(args.steps), total=args.steps, desc=f"rank {rank}", quiet=args.json or rank != 0):
            if step == args.steps - 1:
                reset_peak(device)  # CUDA: the allocator's peak over the last step, as the ledger's below
            x, y = data.batch(step * world + rank, args.batch_size, device)  # (5)!
            loss = train_step(ddp, optimizer, x, y, step)  # (6)!
            with ledger.phase("check", step):
                total = torch.tensor([loss], device=device)
                dist.all_reduce(total)  # the global loss: the mean of the ranks' means
                losses.append(total.item() / world)
                identical[f"step {step}"] = replicas_identical(ddp.module)
            if step == 0:
                for h in hooks:
                    h.remove()  # the ready order is learned once, in the first backward
    wall = time.perf_counter() - t0
    tl = ledger.timeline()
    last = min(s.start for s in tl.spans if s.step == args.steps - 1)
    return {"cfg": cfg, "ddp": ddp, "ledger": ledger, "log": log, "ready": ready, "names": names,
            "losses": losses, "identical": identical, "wall": wall,
            "cuda": ledger_vs_allocator(tl, allocator_stats(device), last)}
# --8<-- [end:train]


def _per_rank(path: Path | None, rank: int) -> Path | None:
    return None if path is None else path.with_name(f"{path.stem}_rank{rank}{path.suffix}")


# --8<-- [start:reference]
def single_process_reference(args, cfg, device, world: int):
    """The same training in one process on the concatenated batch: world x batch-size sequences.

    Equal up to rounding, not bit for bit: the weight gradient is a sum over the batch's tokens,
    which DDP splits into per-rank GEMMs and then adds across ranks, in another order than one
    GEMM over the whole batch; fp32 addition is not associative."""
    torch.manual_seed(args.seed)  # rank 0's weights: the ones DDP broadcast
    model = TinyGPT(cfg).to(device)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data, losses = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=args.seed), []
    for step in range(args.steps):
        shards = [data.batch(step * world + r, args.batch_size, device) for r in range(world)]
        x, y = (torch.cat(t) for t in zip(*shards))  # (1)!
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, start, losses
# --8<-- [end:reference]


def bucket_report(run: dict, args) -> dict:
    """The buckets DDP reduced in the last step against the derived layouts and DDP's own account."""
    sizes = {n: p.numel() * p.element_size() for n, p in run["ddp"].module.named_parameters()}
    cap = int(args.bucket_cap_mb * MIB)
    seen = run["log"].backwards[-1]
    reverse = derive_buckets([(n, sizes[n]) for n in reversed(run["names"])], cap)
    ready = derive_buckets([(n, sizes[n]) for n in run["ready"]], cap)
    reported = ddp_reported(run["ddp"], run["names"])
    return {"cap_bytes": cap, "first_backward": run["log"].backwards[0], "buckets": seen,
            "ready_order": run["ready"], "derived_reverse_order": reverse,
            "bytes_match_reverse_order": [sum(sizes[n] for n in b) for b in reverse] == [b["bytes"] for b in seen],
            "params_match_ready_order": ready == [b["params"] for b in seen],
            "ddp_reported": reported,
            "ddp_reported_matches": None if reported is None else (
                reported["bytes"] == [b["bytes"] for b in seen] and reported["params"] == [b["params"] for b in seen])}


def check(result: dict) -> None:
    """The lab's two promises, checked after the report so that the numbers that broke them are on
    screen. A broken promise is not bad input: CheckFailed is one line and exit code 1, not 2."""
    differ = [k for k, same in result["replicas_identical"].items() if k != "before DDP" and not same]
    if differ:
        raise CheckFailed(f"the replicas are not bit-identical at: {', '.join(differ)}")
    ref = result["reference"] or {}
    over = [f"{k} {ref[k]['ratio']:.1e} (allowed {ref['tolerance'][k]:.0e})"
            for k in ("loss", "grads", "params") if k in ref and not ref[k]["within"]]
    if over:
        raise CheckFailed(f"DDP differs from one process beyond the stated tolerance: {'; '.join(over)}")


def main(argv=None) -> None:
    args = parse_args(argv)
    device, backend = start(SCRIPT, args.device, args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    run = train(args, device)
    mine = memory_report(run["ledger"], rank, run["cuda"])
    if args.ledger_dir:
        timeline = run["ledger"].timeline().to_dict()
        (args.ledger_dir / f"rank{rank}.json").write_text(json.dumps(mine | {"timeline": timeline}))
    per_rank, buckets = [None] * world, bucket_report(run, args)
    dist.all_gather_object(per_rank, mine | {"buckets": buckets["buckets"]})
    result = None
    if rank == 0:
        reference = None
        if not args.no_reference:
            ref_model, ref_start, ref_losses = single_process_reference(args, run["cfg"], device, world)
            reference = compare(run["ddp"].module, run["losses"], ref_model, ref_start, ref_losses, TOLERANCE)
        result = summary(LAB, args, run, device, backend, buckets, per_rank, reference)
        result["provenance"] = provenance.collect(LAB, device, run["wall"])
        emit_json(result) if args.json else report(result)
    dist.barrier()  # the ranks leave together: gloo aborts a process whose peer has already gone
    if result:
        check(result)


if __name__ == "__main__":
    run_lab(ranked(main))
