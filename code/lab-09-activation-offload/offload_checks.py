"""Lab 09 - what the lab derives about offload, and the sweeps that test it.

With checkpointing, the hooks see only what ``checkpoint`` keeps: each block's input, I_blk bytes.
The last k_keep stay on the device, the other L − k_keep go to the host in forward. At the activation
peak (the recompute of the last block) checkpointing alone holds all L inputs; with the streamed hooks
the device holds the kept one(s) and the k_ahead inputs fetched ahead, ``blocks_held(k_keep, k_ahead)``
= max(k_keep, 1) + k_ahead. ``checks`` holds each formula against a run; ``depth_rule`` follows the
peak over depth, where checkpointing alone grows by I_blk per block and checkpointing + streamed does not; the knob tables
measure keep-last and min-bytes. ``tests/test_lab09.py`` asserts every one to the byte on a CPU.
"""

from __future__ import annotations

from dataclasses import replace

from labkit.table import Table

from activation_offload import Config, forward, lab04, measure
from offload_hooks import StreamedOffload

DEPTHS = (4, 8, 16, 32, 64)


# --8<-- [start:rule]
def blocks_held(keep_last: int, prefetch: int) -> int:
    """Block inputs on the device at the first recompute with the streamed hooks: the kept ones
    (k_keep = ``keep_last``, at least the last, which backward reads first) and the ones fetched
    ahead (k_ahead = ``prefetch``)."""
    return max(keep_last, 1) + prefetch


def depth_rule(sweep: dict, block_input_bytes: int, keep_last: int, prefetch: int) -> dict:
    """C′, what the activation peak holds besides the block inputs, from the shallowest run of a
    :func:`depth_sweep`, and the depth at which streaming halves checkpointing's peak:
    (C′ + held·I_blk) / (C′ + L·I_blk) = 1/2 at L = C′/I_blk + 2·held."""
    first, block_input = min(sweep), block_input_bytes
    c0 = sweep[first]["checkpoint"] - first * block_input
    return {"block_input_bytes": block_input, "outside_bytes": c0, "measured": sweep,
            "blocks_half": c0 / block_input + 2 * blocks_held(keep_last, prefetch)}


def depth_peak(rule: dict, blocks: int, held: int | None = None) -> int:
    """Derived activation peak at depth L = ``blocks``: C′ + L·I_blk for checkpointing alone,
    C′ + min(L, held)·I_blk with the inputs streamed (``held``: :func:`blocks_held`)."""
    return rule["outside_bytes"] + (blocks if held is None else min(blocks, held)) * rule["block_input_bytes"]
# --8<-- [end:rule]


def unfiltered_d2h_bytes(config: Config, device) -> int:
    """Bytes the streamed hooks copy out when they filter nothing (min-bytes 0, keep-last 0, nothing
    resident): every saved tensor, what ``save_on_cpu`` copies."""
    model, x, y = lab04.build(config, device)
    hooks = StreamedOffload(device, 0, 0, config.prefetch)
    forward(model, x, y, "streamed", hooks).backward()
    return hooks.d2h_bytes


def checks(result) -> Table:
    """Each formula against an ``activation_offload.run`` result of all five modes, to the byte on a CPU."""
    c, r = result.config, result.results
    blocks, keep, block_input = c.layers, c.keep_last, c.block_input_bytes
    C, S = r["checkpoint"], r["checkpoint+streamed"]
    held = min(blocks, blocks_held(keep, c.prefetch))
    offloaded = (blocks - keep) * block_input
    return Table(["quantity", "formula", ("derived", "B"), ("measured", "B")], [
        ["checkpoint+streamed: host copies after forward", "(L − k_keep)·I_blk", offloaded,
         S["host_bytes_after_forward"]],
        ["checkpoint+streamed: kept after forward", "checkpoint's − (L − k_keep)·I_blk", C["kept_bytes"] - offloaded,
         S["kept_bytes"]],
        ["checkpoint+streamed: activation peak", "checkpoint's − (L − max(k_keep,1) − k_ahead)·I_blk",
         C["activation_peak_bytes"] - (blocks - held) * block_input, S["activation_peak_bytes"]],
        ["streamed: host copies after forward (ledger)", "bytes the hooks copied", r["streamed"]["d2h_bytes"],
         r["streamed"]["host_bytes_after_forward"]],
        ["save_on_cpu: host copies after forward (ledger)", "bytes its pack hook copied", r["save_on_cpu"]["d2h_bytes"],
         r["save_on_cpu"]["host_bytes_after_forward"]],
        ["save_on_cpu: bytes moved", "every saved tensor, parameters included",
         unfiltered_d2h_bytes(c, result.device), r["save_on_cpu"]["d2h_bytes"]]])


def depth_sweep(config: Config, device, depths=DEPTHS) -> dict[int, dict[str, int]]:
    """The activation peak of ``checkpoint`` and ``checkpoint+streamed`` for ``config``'s shape on
    ``device``, at each depth of ``depths``."""
    out = {}
    for blocks in depths:
        deeper = replace(config, layers=blocks)
        model, x, y = lab04.build(deeper, device)
        out[blocks] = {m: measure(model, x, y, m, 0, **deeper.knobs)[0]["activation_peak_bytes"]
                  for m in ("checkpoint", "checkpoint+streamed")}
    return out


def depth_table(rule: dict, held: int) -> Table:
    rows = [[L, m["checkpoint"], depth_peak(rule, L), m["checkpoint+streamed"], depth_peak(rule, L, held),
             1 - m["checkpoint+streamed"] / m["checkpoint"]] for L, m in rule["measured"].items()]
    return Table([("blocks L", "int"), ("checkpoint: measured", "B"), ("derived", "B"),
                  ("checkpoint+streamed: measured", "B"), ("derived", "B"), ("reduction vs checkpoint", "pct:0")], rows)


def keep_last_table(config: Config, device, values=(0, 1, 2, 3)) -> Table:
    """``streamed`` and ``checkpoint+streamed`` measured at each keep-last k_keep of ``values``, for the
    model of ``config`` on ``device``, its other knobs as they are."""
    model, x, y = lab04.build(config, device)
    rows = []
    for mode in ("streamed", "checkpoint+streamed"):
        for k in values:
            r = measure(model, x, y, mode, 0, **replace(config, keep_last=k).knobs)[0]
            rows.append([mode, k, r["kept_bytes"], r["activation_peak_bytes"], r["d2h_bytes"], r["tensors_moved"]])
    return Table(["mode", ("keep-last k_keep", "int"), ("kept after forward", "B"), ("activation peak", "B"),
                  ("moved each way", "B"), ("tensors moved", "int")], rows)


def min_bytes_table(config: Config, device, values: tuple[int, ...]) -> Table:
    """``streamed`` measured at each min-bytes of ``values``, for the model of ``config`` on
    ``device``, its other knobs as they are."""
    model, x, y = lab04.build(config, device)
    rows = []
    for size in values:
        r = measure(model, x, y, "streamed", 0, **replace(config, min_bytes=size).knobs)[0]
        rows.append([size, r["tensors_moved"], r["d2h_bytes"], r["kept_bytes"], r["activation_peak_bytes"]])
    return Table([("min-bytes", "B"), ("tensors moved", "int"), ("moved each way", "B"),
                  ("kept after forward", "B"), ("activation peak", "B")], rows)


#: The sequence lengths of the real-scale section (Llama-3-8B, batch 1, bf16): Llama 3's 4k and 16k,
#: where the activations alone outgrow an 80 GB card.
REAL_SCALE_LENGTHS = (4096, 16384)
REAL_SCALE_KEYS = ("kept_bytes", "activation_peak_bytes", "peak_bytes", "host_peak_bytes", "d2h_bytes", "h2d_bytes")


def real_scale(traced: dict[int, object]) -> dict[str, dict[str, dict[str, int]]]:
    """What a real-scale answer quotes, from ``traced`` (sequence length -> an ``activation_offload.run``
    result): per length, per mode (``checkpoint+streamed`` as ``checkpoint_streamed``, a page's
    placeholders take no ``+``), the device activations kept after forward and at the peak, the
    step's device peak, the host bytes and the bytes moved each way."""
    return {str(tokens): {m.replace("+", "_"): {k: r[k] for k in REAL_SCALE_KEYS} for m, r in result.results.items()}
            for tokens, result in traced.items()}


def real_scale_table(traced: dict[int, object]) -> Table:
    """The real-scale table: one row per sequence length of ``traced`` (as :func:`real_scale`) and mode."""
    return Table([("tokens", "int"), "mode", ("activations kept after forward", "bytes"), ("activation peak", "bytes"),
                  ("step's device peak", "bytes"), ("host (pinned on a GPU)", "bytes"), ("moved each way", "bytes")],
                 [[tokens, m, *(r[k] for k in REAL_SCALE_KEYS[:5])] for tokens, result in traced.items()
                  for m, r in result.results.items()], unit="GiB")
