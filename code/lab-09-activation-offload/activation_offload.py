"""Lab 09 - activation offload: the tensors backward needs, kept on the host until it needs them.

Autograd keeps ("saves") tensors in forward for backward. Saved-tensor hooks decide where they
wait: ``pack`` runs when an op saves a tensor, ``unpack`` when backward asks for it. Five modes:

    none                 every saved tensor stays on the device (the reference)
    save_on_cpu          torch.autograd.graph.save_on_cpu: every saved tensor copied to the host in
                         forward, copied back when backward asks (the synchronous baseline)
    streamed             our hooks (offload_hooks.py): pinned host buffers, a copy stream, prefetch in
                         backward, the last few and the tiny saved tensors kept on the device
    checkpoint           Lab 04's full checkpointing: each block keeps only its input
    checkpoint+streamed  checkpointing, and the block inputs it keeps streamed to the host

A memory ledger, when one watches, measures device bytes and host copies; gradients are compared
with ``torch.equal``. The formulas, the depth sweep and the knobs: ``offload_checks.py``.
``--model llama-3-8b --fake --dtype bfloat16`` runs the same modes on a real architecture, traced
on fake tensors (bytes, no values, no time).

Run it:
    .venv/bin/python code/lab-09-activation-offload/activation_offload.py --device cpu
    .venv/bin/python code/lab-09-activation-offload/activation_offload.py --mode streamed --keep-last 0 --json
    .venv/bin/python code/lab-09-activation-offload/activation_offload.py --model llama-3-8b --fake --dtype bfloat16 --seq-len 4096 --batch-size 1
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from labkit import budget, cli, labs, marks, provenance
from labkit.config import MAX_BYTES, MAX_COUNT, MAX_LAYERS, MAX_STEPS, MAX_WIDTH, UsageError, option
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import TinyGPT, gpt_param_count
from labkit.scale import RealScale
from labkit.table import Table

from offload_hooks import LabelledSaveOnCpu, StreamedOffload

lab04 = labs.load(4)  # Lab 04: the same model set-up (build), the gradient check, the timing

MODES = ("none", "save_on_cpu", "streamed", "checkpoint", "checkpoint+streamed")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TRACED = "traced on fake tensors: bytes, no values, no time"


# --8<-- [start:forward]
def make_hooks(mode: str, model, batch, keep_last: int = 2, min_bytes: int = 4096, prefetch: int = 2):
    """The saved-tensor hooks of ``mode`` for one step of ``model`` on ``batch`` (its tensors), or
    None; ``keep_last``, ``min_bytes`` and ``prefetch`` are the streamed hooks' knobs."""
    device = batch[0].device
    if mode == "save_on_cpu":
        return LabelledSaveOnCpu(device)
    if mode.endswith("streamed"):
        resident = [*model.parameters(), *batch]  # (1)!
        return StreamedOffload(device, keep_last, min_bytes, prefetch, resident)
    return None  # none, checkpoint: no hooks of ours


def checkpointed(hooks=None):
    """TinyGPT's block loop with one checkpoint per block, under ``hooks`` when there are any."""
    def run_blocks(blocks, x):  # (2)!
        with hooks or contextlib.nullcontext():  # (3)!
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False)  # (4)!
        return x
    return run_blocks


def forward(model: TinyGPT, x, y, mode: str, hooks=None):
    """The loss of ``model`` on ``(x, y)`` in ``mode``, under ``hooks`` (from :func:`make_hooks`)."""
    if mode.startswith("checkpoint"):
        return model(x, y, run_blocks=checkpointed(hooks))[1]
    with hooks or contextlib.nullcontext():  # (5)!
        return model(x, y)[1]
# --8<-- [end:forward]


# --8<-- [start:step]
def train_step(model, x, y, mode: str, seed: int = 0, **knobs) -> tuple[torch.Tensor, object]:
    """One forward and backward in ``mode``, the generator reseeded with ``seed`` first (the same
    dropout masks in every mode); ``knobs``: ``keep_last``, ``min_bytes``, ``prefetch`` of
    :func:`make_hooks`. Returns the loss (a tensor; reading it waits for the device) and the step's
    hooks (their counters)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    hooks = make_hooks(mode, model, (x, y), **knobs)  # (1)!
    with marks.phase("forward", 0):
        loss = forward(model, x, y, mode, hooks)
    with marks.phase("backward", 0):
        loss.backward()  # (2)!
    return loss.detach(), hooks
# --8<-- [end:step]


# --8<-- [start:config]
@dataclass
class Config(RealScale, lab04.ModelShape):
    """Offload saved activations to the host: save_on_cpu, streamed, with checkpointing."""

    width: int = option(64, "model width", min=1, max=MAX_WIDTH)
    layers: int = option(8, "transformer blocks", min=1, max=MAX_LAYERS)
    mode: Literal["none", "save_on_cpu", "streamed", "checkpoint", "checkpoint+streamed", "all"] = option(
        "all", "measured against 'none' (checkpoint+streamed also against 'checkpoint')")
    dtype: Literal["float32", "bfloat16"] = option(
        "float32", "the weights, hence the whole step (no autocast); bfloat16 is how a real model trains")
    keep_last: int = option(2, "streamed: the last N offloadable saved tensors stay on the device",
                            min=0, max=MAX_COUNT)
    min_bytes: int = option(4096, "streamed: saved tensors smaller than this stay on the device", min=0, max=MAX_BYTES)
    prefetch: int = option(2, "streamed: saved tensors copied back ahead of backward's need", min=0, max=MAX_COUNT)
    steps: int = option(3, "timed forward+backward steps per mode", min=1, max=MAX_STEPS)

    @property
    def knobs(self) -> dict[str, int]:
        return {"keep_last": self.keep_last, "min_bytes": self.min_bytes, "prefetch": self.prefetch}
# --8<-- [end:config]

    @property
    def block_input_bytes(self) -> int:
        """b: one block's input, a (batch, seq_len, width) tensor in ``--dtype``."""
        width = self.width if self.model_spec() is None else self.model_spec().width
        return self.batch_size * self.seq_len * width * DTYPES[self.dtype].itemsize


# --8<-- [start:run]
def run(config: Config) -> Result:
    device = torch.device("cpu") if config.fake else cli.pick_device(config.device)  # a trace: CPU dispatch
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    modes = {"all": MODES, "none": ("none",), "checkpoint+streamed": ("none", "checkpoint", "checkpoint+streamed")
             }.get(config.mode, ("none", config.mode))
    seed, knobs, t0 = config.seed, config.knobs, time.perf_counter()
    results, ledgers = {}, {}
    with config.tensors():  # --fake: fake tensors, bytes only
        model, x, y = build(config, device)
        if not config.fake:
            train_step(model, x, y, "none", seed)
            reference = lab04.grads_of(model)  # a plain step: no hooks, checkpoint or ledger
        with record_snapshot(config.snapshot):
            for m in modes:
                reset_peak(device)
                results[m], ledgers[m] = measure(model, x, y, m, seed, **knobs)
                results[m]["cuda"] = ledger_vs_allocator(ledgers[m].timeline(), allocator_stats(device))
                if not config.fake:  # a trace has no values to compare
                    results[m] |= gradients_against(reference, model, x, y, m, seed, **knobs)  # (1)!
    times = None if config.fake else lab04.time_steps(
        {m: partial(waited_step, model, x, y, m, seed, **knobs) for m in modes}, config.steps)
    peak = {m: r["activation_peak_bytes"] for m, r in results.items()}
    step = {m: statistics.median(t) for m, t in (times or {}).items()}
    for m, r in results.items():
        r["activation_reduction"] = 1 - peak[m] / peak["none"]
        base = r["baseline"] = "checkpoint" if m == "checkpoint+streamed" else "none"  # (2)!
        r["reduction_vs_baseline"] = 1 - peak[m] / peak[base]
        if times:
            r["step_times_s"], r["step_time_s"] = times[m], step[m]
            r["time_overhead"] = step[m] / step["none"] - 1
            r["overhead_vs_baseline"] = step[m] / step[base] - 1
    return Result(config, device, model, results, ledgers, time.perf_counter() - t0)
# --8<-- [end:run]


def gradients_against(reference: list, model, x, y, mode: str, seed: int = 0, **knobs) -> dict:
    """The gradients the measured step left in ``model``, and those of the same step without the
    ledger (same arguments as :func:`train_step`), each against ``reference``, bit for bit."""
    equal, diff = lab04.grads_equal(lab04.grads_of(model), reference)
    train_step(model, x, y, mode, seed, **knobs)
    return {"grads_equal": equal, "max_abs_grad_diff": diff,
            "grads_equal_without_ledger": lab04.grads_equal(lab04.grads_of(model), reference)[0]}


def waited_step(*args, **knobs) -> float:
    """:func:`train_step` (same arguments), then its loss read: the host waits for the device, as a
    timer needs."""
    return train_step(*args, **knobs)[0].item()


def build(config: Config, device):
    """``(model, x, y)``: Lab 04's TinyGPT and batch for the lab's own run; with ``--model``, ``--fake``
    or ``--dtype bfloat16``, ``config.build_model``'s model in ``--dtype`` (fake with ``--fake``) and
    random token ids of its vocabulary: a byte count needs no learnable data."""
    spec, dtype = config.model_spec(), DTYPES[config.dtype]
    if spec is None and not config.fake and config.dtype == "float32":
        return lab04.build(config, device)
    n = gpt_param_count(config.model_config()) if spec is None else spec.param_count()
    if not config.fake:  # a trace allocates nothing; a real run must hold the weights and their gradients
        budget.require(2 * dtype.itemsize * n, device, f"weights and gradients, 2 x {dtype.itemsize} B x {n:,}")
    torch.manual_seed(config.seed)
    model = config.build_model(partial(TinyGPT, config.model_config()), dtype)
    model = (model if config.fake else model.to(device, dtype)).train()
    ids = torch.randint(config.vocab if spec is None else spec.vocab, (config.batch_size, config.seq_len + 1))
    return model, ids[:, :-1].to(device), ids[:, 1:].to(device)


# --8<-- [start:measure]
def measure(model, x, y, mode: str, seed: int = 0, **knobs) -> tuple[dict, Ledger]:
    """One :func:`train_step` (same arguments) under a memory ledger: device activations, host
    copies and what the hooks moved; returns them and the ledger."""
    ledger = Ledger(x.device)
    ledger.track_module(model)
    ledger.track((x, y), "other")
    with ledger:  # outermost: the hooks and checkpoint run inside it  (1)!
        _, hooks = train_step(model, x, y, mode, seed, **knobs)
    tl = ledger.timeline()
    fwd = next(s for s in tl.spans if s.name == "forward")
    host = tl.host["host_copies"]
    return lab04.activation_memory(tl) | {  # (2)!
        "host_bytes_after_forward": host[fwd.end - 1],  # (3)!
        "host_peak_bytes": max(host),
        "d2h_bytes": getattr(hooks, "d2h_bytes", 0),
        "h2d_bytes": getattr(hooks, "h2d_bytes", 0),
        "tensors_moved": getattr(hooks, "moved", 0),
        "fetched_on_demand": getattr(hooks, "on_demand", 0),
    }, ledger
# --8<-- [end:measure]


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Result:
    config: Config
    device: torch.device
    model: TinyGPT
    results: dict[str, dict]
    ledgers: dict[str, Ledger]
    wall_time_s: float

    def summary(self) -> dict:
        c, spec = self.config, self.config.model_spec()
        shape = asdict(c.model_config()) if spec is None else asdict(spec) | {"seq_len": c.seq_len}
        return {"lab": labs.slug(__file__), "device": str(self.device), "model": c.model, "dtype": c.dtype,
                "traced": TRACED if c.fake else None, "config": shape,
                "batch_size": c.batch_size, **c.knobs, "modes": list(self.results),
                "block_input_bytes": c.block_input_bytes,
                "activation_memory": "activation_peak_bytes: highest device activations + temporaries over forward "
                                     "and backward; host copies are counted apart (host_peak_bytes)",
                "timing": None if c.fake else
                f"median wall-clock seconds of {c.steps} forward+backward steps on {self.device.type}",
                "results": self.results, "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


def modes_table(result: Result, times: bool = True) -> Table:
    """Per mode: device bytes kept and peak, against the baseline, host copies, bytes and tensors
    moved; with ``times``, the step time and its overhead against the baseline."""
    rows = [[m, r["kept_bytes"], r["activation_peak_bytes"], None if m == "none" else -r["reduction_vs_baseline"],
             r["baseline"], r["peak_bytes"], r["host_peak_bytes"], r["d2h_bytes"], r["tensors_moved"]]
            + ([r["step_time_s"] * 1e3, r["overhead_vs_baseline"]] if times else [])
            for m, r in result.results.items()]
    return Table(["mode", ("kept after fwd", "bytes"), ("activation peak", "bytes"), ("vs baseline", "pct:0"),
                  "baseline", ("step's peak", "bytes"), ("host copies", "bytes"), ("moved", "bytes"), ("tensors", "int")]
                 + ([("step, ms", "float:1"), ("overhead", "pct:0")] if times else []), rows)


def gradients_table(result: Result) -> Table:
    return Table(["mode", ("under the ledger", "yes"), ("without the ledger", "yes"), ("max abs difference", "sci:1")],
                 [[m, r["grads_equal"], r["grads_equal_without_ledger"], r["max_abs_grad_diff"]]
                  for m, r in result.results.items() if m != "none"])


def report(result: Result) -> None:
    c, kind = result.config, result.device.type
    model = f"TinyGPT, {c.layers} blocks of width {c.width}" if c.model_spec() is None else c.model
    print(f"Lab 09 on {result.device}: {model}, {c.dtype}, batch {c.batch_size} x {c.seq_len} tokens; keep-last "
          f"{c.keep_last}, min-bytes {c.min_bytes}, prefetch {c.prefetch}" + (f" ({TRACED})" if c.fake else "") + "\n")
    print(modes_table(result, times=not c.fake).text())
    if not c.fake:
        print("\nGradients against none (torch.equal):\n" + gradients_table(result).text())
    for m, r in result.results.items():
        if r["cuda"]:
            print(f"{m}: CUDA max allocated {r['cuda']['max_memory_allocated']:,} B, ledger peak / (max allocated - "
                  f"unseen before) = {r['cuda']['ledger_over_allocator']:.3f}")
    print("\nactivation peak = highest device activations + temporaries over forward and backward (ledger); host "
          "copies = highest bytes labelled host_copies. vs baseline and overhead: against 'none' (checkpoint+streamed: "
          "against 'checkpoint')." + (" On CPU the host and the 'device' are the same RAM: the ledger keeps them apart "
                                      "by label, and step times are CPU wall clock (no GPU claim)."
                                      if kind == "cpu" and not c.fake else ""))
    if c.snapshot:
        print(f"memory history written to {c.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    cli.main(Config, run, report)
