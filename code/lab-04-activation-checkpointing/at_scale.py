"""Lab 04 at real size: the four strategies and the segment rule on Llama 3 8B and 70B, traced.

``checkpointing.run`` with ``--model``, ``--fake`` and ``--dtype bfloat16`` runs the lab's own
strategies on a zoo model: pure bf16 weights and activations (no autocast), batch 1, the model's
fp32 upcast of the logits for the loss. Every figure is *traced on fake tensors* (``labkit.fake``):
the ledger counts each storage the step would hold, rounded as the CUDA caching allocator rounds, and
``FlopCounterMode`` counts FLOPs from shapes; there are no values and no time. The trace follows the
CPU dispatch (CPU flash attention, see ``labkit/fake.py``) and leaves out what no tensor holds: the
CUDA context, cuBLAS workspaces, NCCL buffers, allocator fragmentation.

Llama 3's published context is 8,192 tokens; 32,768 is Llama 3.1's territory (the same shapes, a
longer RoPE schedule), and the bytes are those of the same blocks.
"""

from __future__ import annotations

from checkpointing import Config, Result, run
from model_setup import build_for
from segments import compare, sweep

from labkit.table import Table

# What the notebook traces (about 60 s on one CPU core: a 70B run of the four strategies takes 30 s).
# Llama-3-70B at 32,768 tokens is one command away:
#   .venv/bin/python code/lab-04-activation-checkpointing/checkpointing.py --model llama-3-70b --fake \
#       --dtype bfloat16 --seq-len 32768 --batch-size 1
CONFIGS = (("llama-3-8b", 8192), ("llama-3-8b", 32768), ("llama-3-70b", 8192))


def config(model: str, seq_len: int, **fields) -> Config:
    """The lab's Config for ``model`` at ``seq_len`` tokens, batch 1, bf16, on fake tensors."""
    return Config(model=model, fake=True, dtype="bfloat16", seq_len=seq_len, batch_size=1, **fields)


def trace(model: str, seq_len: int) -> Result:
    """``checkpointing.run`` of all four strategies, k = round(sqrt(layers)) for every-k."""
    return run(config(model, seq_len))


def key(name: str) -> str:
    """A name as a key of the published numbers (a page's placeholders take letters, digits and _)."""
    return name.replace("-", "_").replace(".", "_")


def numbers(traced: dict[tuple[str, int], Result]) -> dict:
    """What a page quotes: per model, per length, per strategy, the bytes and the recompute."""
    out: dict = {}
    for (model, n), result in traced.items():
        out.setdefault(key(model), {})[str(n)] = {key(s): {k: r[k] for k in (
            "kept_bytes", "activation_peak_bytes", "peak_bytes", "activation_reduction", "recompute_flops",
            "recompute_flops_of_forward")} for s, r in result.results.items()} | {"every": result.every}
    return out


def table(traced: dict[tuple[str, int], Result]) -> Table:
    """One row per model, length and strategy."""
    rows = []
    for (model, n), result in traced.items():
        for s, r in result.results.items():
            rows.append([model, n, f"every-k (k = {result.every})" if s == "every-k" else s, r["kept_bytes"],
                         r["activation_peak_bytes"], r["activation_reduction"], r["peak_bytes"],
                         r["recompute_flops"], r["recompute_flops_of_forward"]])
    return Table(["model", ("tokens", "int"), "strategy", ("activations kept after forward", "size"),
                  ("activation peak", "size"), ("reduction", "pct:0"), ("step peak", "size"),
                  ("recompute FLOPs", "sci:2"), ("of forward", "pct:0")], rows)


def segment_rule(result: Result, ks: tuple[int, ...]) -> dict:
    """``segments.compare`` with the head's peak (``head=True``) on the model of ``result`` (a
    :func:`trace`): none, k = 1 (full) and k = every come from ``result``, every other k in ``ks``
    is traced here, one step each. G is read at the largest k, so ``ks`` should end where the
    recompute window is the higher peak (k = every is, at 80 layers)."""
    c, r = result.config, result.results
    memory = {"none": r["none"], 1: r["full"], result.every: r["every-k"]}
    with c.tensors():
        model, x, y = build_for(c, "cpu")
        memory |= sweep(model, x, y, [k for k in ks if k not in memory], none=False)
    keep = ("kept_bytes", "activation_peak_bytes", "peak_bytes")
    ordered = {"none": memory["none"]} | {k: memory[k] for k in sorted(k for k in memory if k != "none")}
    return compare({k: {name: m[name] for name in keep} for k, m in ordered.items()}, c.depth,
                   result.block_input_bytes, head=True)
