"""Lab 13 - the plumbing of a trace: the model built on fake storage, the fake process group, the
optimizer of rank 0's shards, its state made before the step, and the ledger told what is what.

None of it is the lesson (``fit.py`` is); each piece says why it is needed on fake tensors.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh

from labkit import dist as dist_kit
from labkit import fake, labs, marks
from labkit.ledger import Ledger
from labkit.traffic import Traffic

lab07 = labs.load(7)  # OptimizerOffload: its host buffers and state are labelled host_copies
lab15 = labs.load(15)  # frozen: a LoRA's frozen weights and NF4's quantization constants


def holder(optimizer):
    """The ``torch.optim`` optimizer that holds the state: the one inside Lab 07's engine,
    ZeroRedundancyOptimizer or :class:`ShardOptimizer`, or the optimizer itself."""
    for name in ("optimizer", "optim", "inner"):
        inner = getattr(optimizer, name, None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return optimizer


def create_state(optimizer) -> None:
    """The optimizer's state (AdamW's moments, SGD's momentum), made now by one step on zero gradients,
    as a real run's first step makes it: the traced step is then the steady state, step 1 on."""
    inner = holder(optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    inner.step()
    inner.zero_grad(set_to_none=True)


class ShardOptimizer:
    """The optimizer of rank 0's local shards of FSDP2's (or tensor parallelism's) parameters.

    DTensor's own optimizer step runs exactly these local ops; it also propagates the sharding
    (global shapes, metadata only), which on fake tensors is slow and, under an ambient fake mode,
    is counted as if allocated. ``make(params)``: the optimizer; ``host``: the shards live on the
    host (FSDP2's CPU offload), where the step then runs."""

    def __init__(self, params, make, host: bool = False) -> None:
        self.params = list(params)
        self.local = [getattr(p, "_local_tensor", p) for p in self.params]  # a plain tensor is its own shard
        self.inner, self.host = make(self.local), host

    def step(self) -> None:
        for p, local in zip(self.params, self.local):
            if p.grad is not None and hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)  # as DTensor's own step would, first
            local.grad = None if p.grad is None else getattr(p.grad, "_local_tensor", p.grad)
        with marks.category("host_copies") if self.host else contextlib.nullcontext():
            self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, local in zip(self.params, self.local):
            p.grad = local.grad = None


@contextlib.contextmanager
def fake_process_group(world: int | None, device: str, tp: int = 1, replicate: int = 1):
    """``world`` ranks that exchange nothing (labkit.dist.fake_group: collectives return at once),
    and their device mesh; no group at all for ``None``. With ``tp`` > 1 or ``replicate`` > 1: ``world`` x
    ``tp`` ranks, as a 3-D mesh whose dimensions are named ``replicate``, ``shard`` (``world`` / ``replicate``
    ranks each) and ``tp`` (``world`` None: one data-parallel rank)."""
    if world is None and tp == 1:
        yield None
        return
    with dist_kit.fake_group((world or 1) * tp, device=device) as mesh:
        yield mesh if tp == replicate == 1 else init_device_mesh(
            torch.device(device).type, (replicate, (world or 1) // replicate, tp), mesh_dim_names=("replicate", "shard", "tp"))


def build(spec, dtype: torch.dtype, device: str):
    """``spec``'s model on meta, then with (fake or real) storage on ``device``, in ``dtype``."""
    return fake.materialize(spec.build, device=device, dtype=dtype).train()


class WeightCasts:
    """Which of the ``ledger``'s storages are dtype casts of a weight: a ``_to_copy`` of a leaf that
    requires grad (Lab 03's ``is_weight_copy`` reads the same fact from autograd's graph, after the
    op; at dispatch the graph is not built yet). Autocast makes them, and saves them for backward.
    The ledger calls it after each ``_to_copy`` it has counted (``Ledger.observe``): DTensor's local
    ops come to it as local tensors, and it is off while torch.compile compiles, as the ledger is."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger, self.sids = ledger, set()
        ledger.observe(torch.ops.aten._to_copy.default, self.seen)

    def seen(self, args, out) -> None:
        if args[0].is_leaf and args[0].requires_grad:
            sid = self.ledger.storage_id(out)
            if sid is not None:
                self.sids.add(sid)


def traffic():
    """labkit's ``Traffic``, which labels the buffers collectives fill as communication (Lab 11), where
    the trace has a process group (``fake_process_group``: ZeRO, --tp, --cp); without one no collective
    runs, and every op of the step passes one dispatch mode fewer."""
    return Traffic() if torch.distributed.is_available() and torch.distributed.is_initialized() else contextlib.nullcontext()


def label_gradients(model) -> None:
    """Label each gradient as backward makes it, for every ledger watching: hooks registered before
    Lab 07's, which copy the gradient to the host and drop it (a ledger's own hooks come after)."""
    def label(param) -> None:
        for instrument in marks.watching():
            if hasattr(instrument, "track") and param.grad is not None:
                instrument.track(param.grad, "gradients")

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(label)


def label(ledger: Ledger, model, optimizer) -> None:
    """Tell ``ledger`` the model state, from outside: parameters (under FSDP2, the local shards),
    gradients and optimizer state; what lives on the host is ``host_copies``; under LoRA, the frozen
    weights and the quantization constants (Lab 15). Inside the ledger, so that these storages are
    adopted as the timeline's first events."""
    ledger.track_module(model)
    for category, tensors in lab15.frozen(model).items():
        ledger.track(tensors, category)
    if optimizer is None:
        return
    if hasattr(optimizer, "each"):  # fit_backward.OptimizerInBackward: an optimizer per parameter
        for inner in optimizer.each.values():
            ledger.track_optimizer(inner)
        return
    inner = holder(optimizer)
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    on_host = isinstance(optimizer, lab07.OptimizerOffload) or isinstance(optimizer, ShardOptimizer) and optimizer.host
    if isinstance(optimizer, ShardOptimizer):
        kind = "host_copies" if on_host else "parameters"
        ledger.track(optimizer.local, kind)
        inner.register_step_pre_hook(lambda *_: ledger.track(
            [t.grad for t in optimizer.local if t.grad is not None], "host_copies" if on_host else "gradients"))
    if isinstance(optimizer, lab07.OptimizerOffload):
        ledger.track(optimizer.host_buffers(), "host_copies")
    if on_host:
        ledger.track(state, "host_copies")
    else:
        ledger.track_optimizer(inner)
