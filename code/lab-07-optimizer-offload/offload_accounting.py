"""Lab 07 - what optimizer offload should move, derived, against what the run measured.

The starter (``optimizer_offload.py``) trains; this file reads its measurements: the model state
between steps (``after_step``), the bytes per parameter each mode keeps on the device and the host
(``bytes_per_param``), each byte formula against the ledger and the copy counter (``checks``,
``BusCopies``), how far two trainings ended apart (``largest_difference``, ``tolerance``), and the
real-scale table of a traced run (``real_scale``). The console report, the notebook and the tests
all use these, so the page and the command line cannot disagree.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.table import Table

MODEL_STATE = ("parameters", "gradients", "optimizer_state")
TITLES = {"none": "device AdamW", "optimizer": "optimizer offload", "gradients": "gradient offload"}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
#: What every traced figure is, said once.
TRACED = "traced on fake tensors: bytes, no values, no time"


def derived_bytes_per_param(mode: str, precision: str) -> tuple[int, int, int, int]:
    """Bytes per parameter between steps, derived: (device parameters, gradients, optimizer state;
    host). ``w`` bytes per device weight; below fp32 the optimizer also keeps an fp32 master (4 B),
    and the offload engine a staging copy on the host in the device dtype (``w`` B) for the bus."""
    w = ELEMENT_BYTES[precision]
    master = 4 if w < 4 else 0
    host = 4 + 4 + 8 + (w if master else 0)  # master, fp32 gradients, two moments (+ staging)
    return {"none": (w, w, 8 + master, 0), "optimizer": (w, w, 0, host), "gradients": (w, 0, 0, host)}[mode]


class BusCopies(TorchDispatchMode):
    """Bytes copied between the device and the storages of ``buffers`` while entered: ``into`` them
    (device to host) and ``out_of`` them (host to device), whatever code made the copies.

    As ``labkit.schedule.Copies``, less the copies between two of the buffers: those are the
    host's own work (bf16 to fp32 and back) and do not cross the bus. Storages are told apart by
    identity (a fake storage has no address). A dispatch mode costs time on every op: count in a
    run that is not timed.
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.host = {b.untyped_storage()._cdata for b in buffers}
        self.out_of = self.into = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            to_host, from_host = (t.untyped_storage()._cdata in self.host for t in (dst, src))
            self.into += dst.nbytes if to_host and not from_host else 0
            self.out_of += src.nbytes if from_host and not to_host else 0
        return func(*args, **(kwargs or {}))


def after_step(ledger) -> dict[str, int]:
    """Device bytes by category at the end of the last optimizer phase: the model state between steps."""
    tl = ledger.timeline()
    return tl.row(max((s for s in tl.spans if s.name == "optimizer"), key=lambda s: s.end).end - 1)


def largest_difference(model, reference) -> tuple[float, str]:
    """The largest parameter difference between two models, and where: the parameter's name, and
    for attention's fused q, k, v projection which third of it."""
    diffs = {name: (p.float() - q.float()).abs() for (name, p), q in zip(model.named_parameters(), reference.parameters())}
    name = max(diffs, key=lambda n: diffs[n].max().item())
    d = diffs[name]
    if name.endswith("qkv.bias"):
        name += f" ({('query', 'key', 'value')[int(d.argmax()) * 3 // d.numel()]} part)"
    return d.max().item(), name


def tolerance(lr: float, steps: int) -> float:
    """Two orders of fp32 arithmetic agree within 1 % of what AdamW can move a parameter in
    ``steps`` steps of learning rate ``lr`` (about ``lr`` per step)."""
    return 0.01 * lr * steps


def bytes_per_param(modes: dict[str, dict], precision: str = "fp32") -> Table:
    """Derived against measured bytes per parameter, per mode (``modes``: the mode summaries;
    ``precision``: of the device weights): device bytes between steps, host bytes at the end."""
    p = next(iter(modes.values()))["params"]
    narrow = precision != "fp32"
    rows = [["device", f"parameters ({precision})"], ["device", f"gradients ({precision})"],
            ["device", ("fp32 master, " if narrow else "") + "AdamW moments (2 x fp32) and step"],
            ["host", "master, gradients, AdamW state" + (f", {precision} staging" if narrow else "")],
            ["device", "total between steps"]]
    for mode, s in modes.items():
        derived = derived_bytes_per_param(mode, precision)
        measured = [s["device_after_step"][c] / p for c in MODEL_STATE] + [s["host_bytes"] / p]
        for k, row in enumerate(rows[:4]):
            row += [derived[k], measured[k]]
        rows[4] += [sum(derived[:3]), sum(measured[:3])]
    return Table(["where", "what", *((f"{TITLES[m]}{part}", kind) for m in modes
                                     for part, kind in ((": derived", "int"), (": measured", "float:4")))], rows)


def checks(modes: dict[str, dict], engine, precision: str = "fp32") -> Table:
    """Each byte formula against the measurement, equal to the byte on CPU. ``modes``: the three mode
    summaries; ``engine``: the optimizer-offload run's engine (its host buffers' planned sizes);
    ``precision``: of the device weights."""
    p, t = modes["none"]["params"], modes["none"]["tensors"]
    opt, grads = modes["optimizer"], modes["gradients"]
    w = ELEMENT_BYTES[precision]
    state = 8 + (4 if w < 4 else 0)  # AdamW's moments, and the fp32 master below fp32
    staging = engine.staging.nbytes if engine.staging else 0
    rows = [["device bytes saved by optimizer offload", f"{state} B x P + 4 B x T", state * p + 4 * t,
             opt["device_saved_bytes"]],
            ["device bytes saved by gradient offload", f"{state + w} B x P + 4 B x T", (state + w) * p + 4 * t,
             grads["device_saved_bytes"]]]
    if w == 4:  # the step's peak carries the state; in bf16 device AdamW also widens the gradients for the step
        rows += [["peak device bytes: device AdamW minus optimizer offload", "8 B x P + 4 B x T", 8 * p + 4 * t,
                  modes["none"]["peak_device_bytes"] - opt["peak_device_bytes"]]]
    rows += [["host bytes of optimizer offload", "2 x flat buffer + " + ("staging + " if staging else "")
              + "8 B x P + 4 B x T", 2 * engine.master.nbytes + staging + 8 * p + 4 * t, opt["host_bytes"]],
             ["flat host buffer (Lab 08's HostMaster, fp32)", "4 B x P + 64-byte alignment", engine.master.nbytes,
              engine.master.flat.nbytes],
             ["device to host per step", f"{w} B x P", w * p, opt["d2h_bytes_per_step"]],
             ["host to device per step", f"{w} B x P", w * p, opt["h2d_bytes_per_step"]]]
    return Table(["quantity", "formula", ("derived", "B"), ("measured", "B")], rows)


def real_scale(modes: dict[str, dict]) -> dict[str, dict[str, int]]:
    """What a real-scale answer quotes, per mode (``modes``: the mode summaries of a run, traced or
    measured): the device peak and the activations in it, the model state between steps, the host
    bytes (pinned on a GPU) and the bytes that cross the bus per step, each way. ``peak_phase``: the
    phase the device peak falls in (a phase's peak counts the row it was entered in: a peak at the
    start of backward is the end of forward plus the loss's gradient)."""
    return {mode: {"peak_phase": s["peak_phase"], "peak_device_bytes": s["peak_device_bytes"],
                   "activations_at_peak": s["device_at_peak"]["activations"],
                   "device_between_steps": sum(s["device_after_step"][c] for c in MODEL_STATE),
                   "host_bytes": s["host_bytes"], "down_per_step": s["d2h_bytes_per_step"],
                   "up_per_step": s["h2d_bytes_per_step"]} for mode, s in modes.items()}


def real_scale_table(numbers: dict[str, dict[str, int]]) -> Table:
    """:func:`real_scale`'s numbers as the page's table, one row per mode."""
    keys = ("peak_phase", "peak_device_bytes", "activations_at_peak", "device_between_steps", "host_bytes", "down_per_step",
            "up_per_step")
    return Table(["mode", "device peak in", ("device peak", "bytes"), ("activations at the peak", "bytes"),
                  ("device between steps", "bytes"),
                  ("host (pinned on a GPU)", "bytes"), ("down per step (gradients)", "bytes"),
                  ("up per step (weights)", "bytes")],
                 [[TITLES[mode], *(row[k] for k in keys)] for mode, row in numbers.items()], unit="GiB")
