"""Two gloo ranks run a small Llama's float8 step under --tp 2 (fit_float8_tp.py's styles, with and without --sp),
in fp32 (the casts are the same from any precision; in fp32 the ranks' partial sums round as one rank's sum does,
where in bf16 they round differently and move later float8 roundings by a step), and rank 0 writes, beside the same step on one rank, the loss and every gradient's largest difference
(the norm of the difference over the gradient's norm) as JSON to argv[1]. Run by tests/test_lab13_float8.py."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def step(sp: bool | None, mesh=None):
    from labkit import labs, zoo
    fit_float8, fit_parallel = labs.load(13, "fit_float8"), labs.load(13, "fit_parallel")
    torch.manual_seed(0)
    model = zoo.get("small-llama").build()
    fit_float8.convert(model)
    idx = torch.randint(0, model.spec.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    split = fit_parallel.tensor_parallel(model, mesh, sp, float8=True) if sp is not None else None
    with split if split is not None else torch.enable_grad():
        loss = model(idx, idx)[1]
        loss.backward()
    whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return whole(loss).float(), {n: whole(p.grad).float() for n, p in model.named_parameters()}


def rank(r: int, out: str, rendezvous: str) -> None:
    # a file the ranks meet at (argv[2], not there yet): no TCP port another process could take first
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=r, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    want, want_grads = step(None)
    result = {}
    for sp in (False, True):
        got, grads = step(sp, mesh)
        result[f"sp={sp}"] = {"loss": abs(got - want).item() / want.abs().item(),
                              "grads": {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in want_grads.items()}}
    if r == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1], sys.argv[2]), nprocs=2)
