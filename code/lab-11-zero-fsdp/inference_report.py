"""Lab 11's inference harness: the result and its JSON summary, what one GPU holds and moves in
each placement, the tables the console and the page show, the human report, and what runs where.

Bookkeeping only; the lesson is in ``fsdp_inference.py``. The tables read a summary (the JSON
object rank 0 prints under ``--json``), so a notebook that launched torchrun builds the same tables
as the console.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from labkit import labs, provenance
from labkit.table import Table, format_bytes

WEIGHTS = ("text_encoder", "denoiser", "decoder")  # the components; denoiser_block is one of the denoiser's


@dataclass
class Result:
    """Rank 0's view of the run: every rank in every placement, and Lab 08 on one device."""

    config: object  # fsdp_inference.Config
    device: torch.device
    backend: str
    world_size: int
    weight_bytes: dict[str, int]  # each component, and one denoiser block
    output_atol: float
    placements: dict[str, list[dict]]  # placement -> fsdp_inference.run_placement of every rank
    lab08: dict[str, dict]  # Lab 08's mode -> its numbers (none, layerwise)
    timelines: dict[str, dict] | None  # rank 0's ledger timelines (Timeline.to_dict), when asked for
    wall_time_s: float

    def summary(self) -> dict:
        return {"lab": labs.slug(__file__), "device": str(self.device), "backend": self.backend,
                "world_size": self.world_size, "config": dict(self.config.pipeline().__dict__),
                "weight_bytes": self.weight_bytes, "output_atol": self.output_atol, "placements": self.placements,
                "lab08": self.lab08, **({"timelines": self.timelines} if self.timelines is not None else {}),
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


# ---------------------------------------------------------------------- what one GPU holds and moves
def host_to_device(measured: dict, placement: str, device: str) -> tuple[int, str]:
    """Bytes one rank copied from host to device for one image, and whether they were
    ``measured`` or ``derived``. On a GPU they are counted (``labkit.traffic``). On a CPU the
    device is host RAM and no byte crosses a bus, so with the shards offloaded they are derived:
    each rank copies its own shard to the device before it sends it, which is what it sent."""
    if device != "cpu":
        return measured["h2d_bytes_measured"], "measured"
    return (measured["sent_bytes"], "derived") if placement == "sharded+offload" else (0, "measured")


def per_gpu(summary: dict) -> dict[str, dict]:
    """Each placement as one GPU sees it (rank 0 of the sharded runs; Lab 08 on one device): peak
    device bytes, host bytes, host-to-device and received bytes per image, the worst difference
    from the unsharded output. Keys: sharded, offload, resident, layerwise (those that ran)."""
    out = {}
    for placement, ranks in summary["placements"].items():
        first = ranks[0]
        h2d, how = host_to_device(first, placement, summary["device"])
        out["offload" if placement == "sharded+offload" else "sharded"] = {
            "name": f"FSDP {placement} ({summary['world_size']} ranks)", "device": first["peak_device"]["total"],
            "host": first["peak_host"], "h2d": h2d, "h2d_is": how, "received": first["gathered_bytes"] - first["sent_bytes"],
            "max_abs_diff": max(r["max_abs_diff"] for r in ranks)}
    for mode, s in summary["lab08"].items():
        name = "Lab 08 all resident (1 device)" if mode == "none" else f"Lab 08 {mode} k={s['prefetch_depth']} (1 device)"
        out["resident" if mode == "none" else mode] = {
            "name": name, "device": s["peak_device_bytes"], "host": s["peak_host_copy_bytes"], "h2d": s["h2d_bytes"],
            "h2d_is": "measured", "received": 0, "max_abs_diff": s["max_abs_diff"]}
    return out


# ---------------------------------------------------------------------- tables, from a summary
def inference_table(summary: dict) -> Table:
    """Every placement per GPU (``per_gpu``)."""
    return Table(["placement", ("peak device bytes per GPU", "size"), ("host bytes per GPU", "size"),
                  ("host to device per image per GPU", "size"), "host to device is",
                  ("received from other GPUs per image", "size"), ("max abs diff", "sci:1")],
                 [[v["name"], v["device"], v["host"], v["h2d"], v["h2d_is"], v["received"], v["max_abs_diff"]]
                  for v in per_gpu(summary).values()])


def largest_unit(summary: dict) -> tuple[str, int]:
    """The largest unit FSDP gathers at once, U: the text encoder, a denoiser block or the decoder."""
    w = summary["weight_bytes"]
    units = {"text encoder": w["text_encoder"], "one denoiser block": w["denoiser_block"], "decoder": w["decoder"]}
    name = max(units, key=units.get)
    return name, units[name]


def units_table(summary: dict) -> Table:
    """The largest unit against the communication bytes at the peak of rank 0 with CPU offload."""
    name, size = largest_unit(summary)
    at_peak = summary["placements"]["sharded+offload"][0]["peak_device"]["communication"]
    return Table(["largest unit U", ("its weight bytes", "size"),
                  ("FSDP+offload: communication at the peak (rank 0)", "size"), ("ratio", "float:2")],
                 [[name, size, at_peak, at_peak / size]])


def support_table(train: dict, infer: dict, pinned: str) -> Table:
    """What ran on this machine: the features of both launches (``train``, ``infer``: their
    summaries), and ``pinned`` (:func:`pinned_offload_support`)."""
    where = f"this machine ({infer['device'].split(':')[0]}, torch {infer['provenance']['torch_version']})"
    pin = infer["device"] != "cpu"  # fsdp_inference.shard pins the shards when the mesh is CUDA
    return Table(["feature", where], [
        [f"FSDP2 `fully_shard`, `reshard_after_forward=True` and `False`, {train['backend']}",
         "works (stages 2 and 3 above)"],
        [f"`ZeroRedundancyOptimizer`, {train['backend']}", "works (stage 1 above)"],
        [f"`CPUOffloadPolicy(pin_memory={pin})`, {infer['backend']}", "works (inference above)"],
        ["`CPUOffloadPolicy()` (default `pin_memory=True`)", pinned]])


def pinned_offload_support() -> str:
    """Whether FSDP2's ``CPUOffloadPolicy()``, whose default is ``pin_memory=True``, can shard a
    layer here: tried in this process, on a one-rank gloo group. ``works``, or ``fails:`` and the
    error (on a CPU-only torch, pinning needs an accelerator)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(torch.nn.Linear(8, 8), mesh=init_device_mesh("cpu", (1,)), offload_policy=CPUOffloadPolicy())
        return "works"
    except Exception as err:  # the message is the result
        return f"fails: `{type(err).__name__}: {err}`"
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the report
def report(result: Result) -> None:
    print_summary(result.summary())


def print_summary(s: dict) -> None:
    """The human report of a summary (what ``--json`` prints)."""
    w = s["weight_bytes"]
    print(f"Lab 11 inference on {s['device']} ({s['backend']}, {s['world_size']} ranks): weights "
          f"{format_bytes(sum(w[k] for k in WEIGHTS))}, one denoiser block {format_bytes(w['denoiser_block'])}, "
          f"{s['config']['steps']} denoising steps, one prompt per rank")
    print("\nPer GPU: rank 0 of the sharded runs, Lab 08's engines on one device (measured):")
    print(inference_table(s).text())
    for placement, ranks in s["placements"].items():
        shards = ", ".join(f"rank {r} {m['shard_bytes']:,} B" for r, m in enumerate(ranks))
        print(f"{placement}: own shards {shards}; worst max abs diff {max(m['max_abs_diff'] for m in ranks):.1e}")
    if s["device"] == "cpu":
        print("(CPU: the device is host RAM, so no byte crosses a bus; the host-to-device bytes of sharded+offload "
              "are derived: each rank's shard goes to the device before it is sent)")
