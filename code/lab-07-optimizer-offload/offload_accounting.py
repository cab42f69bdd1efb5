"""Lab 07 - what optimizer offload should move, derived, against what the run measured.

The starter (``optimizer_offload.py``) trains; this file reads its measurements: the model state
between steps (``after_step``), the bytes per parameter each mode keeps on the device and the host
(``bytes_per_param``), each byte formula against the ledger and the copy counter (``checks``), and
how far two trainings ended apart (``largest_difference``, ``tolerance``). The console report, the
notebook and the tests all use these, so the page and the command line cannot disagree.
"""

from __future__ import annotations

from labkit.table import Table

MODEL_STATE = ("parameters", "gradients", "optimizer_state")

#: bytes per parameter between steps, derived: (device parameters, gradients, AdamW moments; host)
DERIVED_BYTES_PER_PARAM = {"none": (4, 4, 8, 0), "optimizer": (4, 4, 0, 16), "gradients": (4, 0, 0, 16)}
TITLES = {"none": "device AdamW", "optimizer": "optimizer offload", "gradients": "gradient offload"}


def after_step(ledger) -> dict[str, int]:
    """Device bytes by category at the end of the last optimizer phase: the model state between steps."""
    tl = ledger.timeline()
    return tl.row(max((s for s in tl.spans if s.name == "optimizer"), key=lambda s: s.end).end - 1)


def largest_difference(model, reference) -> tuple[float, str]:
    """The largest parameter difference between two models, and where: the parameter's name, and
    for attention's fused q, k, v projection which third of it."""
    diffs = {name: (p - q).abs() for (name, p), q in zip(model.named_parameters(), reference.parameters())}
    name = max(diffs, key=lambda n: diffs[n].max().item())
    d = diffs[name]
    if name.endswith("qkv.bias"):
        name += f" ({('query', 'key', 'value')[int(d.argmax()) * 3 // d.numel()]} part)"
    return d.max().item(), name


def tolerance(lr: float, steps: int) -> float:
    """Two orders of fp32 arithmetic agree within 1 % of what AdamW can move a parameter in
    ``steps`` steps of learning rate ``lr`` (about ``lr`` per step)."""
    return 0.01 * lr * steps


def bytes_per_param(modes: dict[str, dict]) -> Table:
    """Derived against measured bytes per parameter, per mode (``modes``: the mode summaries):
    device bytes between steps, host bytes at the end."""
    p = next(iter(modes.values()))["params"]
    rows = [["device", "parameters (fp32)"], ["device", "gradients (fp32)"],
            ["device", "AdamW moments (2 x fp32) and step"], ["host", "master, gradients, AdamW state"],
            ["device", "total between steps"]]
    for mode, s in modes.items():
        derived = DERIVED_BYTES_PER_PARAM[mode]
        measured = [s["device_after_step"][c] / p for c in MODEL_STATE] + [s["host_bytes"] / p]
        for k, row in enumerate(rows[:4]):
            row += [derived[k], measured[k]]
        rows[4] += [sum(derived[:3]), sum(measured[:3])]
    return Table(["where", "what", *((f"{TITLES[m]}{part}", kind) for m in modes
                                     for part, kind in ((": derived", "int"), (": measured", "float:4")))], rows)


def checks(modes: dict[str, dict], master_bytes: int, flat_bytes: int) -> Table:
    """Each byte formula against the measurement, equal to the byte on CPU. ``modes``: the three mode
    summaries; ``master_bytes``: the HostMaster's planned size; ``flat_bytes``: its flat buffer's."""
    p, t = modes["none"]["params"], modes["none"]["tensors"]
    opt, grads = modes["optimizer"], modes["gradients"]
    return Table(["quantity", "formula", ("derived", "B"), ("measured", "B")], [
        ["device bytes saved by optimizer offload", "8 B x P + 4 B x T", 8 * p + 4 * t, opt["device_saved_bytes"]],
        ["device bytes saved by gradient offload", "12 B x P + 4 B x T", 12 * p + 4 * t, grads["device_saved_bytes"]],
        ["peak device bytes: device AdamW minus optimizer offload", "8 B x P + 4 B x T", 8 * p + 4 * t,
         modes["none"]["peak_device_bytes"] - opt["peak_device_bytes"]],
        ["host bytes of optimizer offload", "2 x flat buffer + 8 B x P + 4 B x T", 2 * master_bytes + 8 * p + 4 * t,
         opt["host_bytes"]],
        ["flat host buffer (Lab 08's HostMaster)", "4 B x P + 64-byte alignment", master_bytes, flat_bytes],
        ["device to host per step", "4 B x P", 4 * p, opt["d2h_bytes_per_step"]],
        ["host to device per step", "4 B x P", 4 * p, opt["h2d_bytes_per_step"]]])
