"""The toy GPT's side of the ledger: its shape, its parameter count, what it keeps for backward, and
one training step of it measured while the memory ledger watches.

``Shape`` and ``param_count`` describe a GPT-style decoder like ``labkit.TinyGPT`` (pre-norm blocks,
learned positions, an untied head), so a shape given on the command line has a parameter count and
``--measure`` can build it.

Korthikanti et al. (2022) count the tensors a *Megatron* layer saves, in 16-bit with 1-byte dropout
masks. TinyGPT is another implementation: fp32 by default, GELU, learned positions, an untied head,
PyTorch's CPU kernels. ``tinygpt_saved_tensors`` lists what each of its ops saves, so the sum can be
compared with the ledger's measurement to the byte (``measure_step``), and ``gap_to_paper`` says,
term by term, why that sum differs from the paper's formula.

Facts about PyTorch's CPU kernels this count relies on (torch 2.13; the tests check the sum):
  * ``nn.Dropout`` on CPU saves a noise tensor of the input's dtype (CUDA's fused kernel: a 1-byte mask);
  * ``F.scaled_dot_product_attention`` on CPU runs its flash kernel only without dropout; it saves
    q, k, v, the output and one fp32 log-sum-exp per row. With dropout it falls back to the math
    path, which keeps the s x s probabilities as ``attention="math"`` does;
  * ``native_layer_norm`` saves its input and a mean and 1/std per row, in the input's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from labkit import marks
from labkit.cuda import allocator_stats, record_snapshot, reset_peak
from labkit.ledger import Ledger, counted_bytes
from labkit.models import GPTConfig, SyntheticTokens, TinyGPT, gpt_param_count
from labkit.table import Table

INT64 = 8


@dataclass(frozen=True)
class Shape:
    """A GPT-style decoder (the shape of labkit's TinyGPT): pre-norm blocks, learned positions, untied head."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int  # sequences per rank (the micro-batch)
    vocab: int
    kv_heads: int | None = None  # grouped-query attention for the KV cache; None: one per head


def param_count(shape: Shape) -> int:
    """P for a shape: TinyGPT's closed form, 12*L*h^2 + 13*L*h + (V + s)*h + 2*h + h*V (labkit.models)."""
    return gpt_param_count(GPTConfig(vocab=shape.vocab, seq_len=shape.seq, width=shape.hidden,
                                     layers=shape.layers, heads=shape.heads))


def param_tensors(shape: Shape) -> int:
    """Parameter tensors in TinyGPT: 12 per block, plus 2 embeddings, the final norm (2) and the head."""
    return 12 * shape.layers + 5


# --8<-- [start:saved]
def tinygpt_saved_tensors(cfg: GPTConfig, batch: int, elem: int = 4) -> list[tuple[str, str, int]]:
    """(where, what, bytes) of every tensor TinyGPT keeps for backward on CPU.

    elem: bytes per element of the model's dtype (4 for fp32, 2 for bf16)."""
    b, s, h, a, v = batch, cfg.seq_len, cfg.width, cfg.heads, cfg.vocab
    drop = cfg.dropout > 0
    scores_kept = drop or cfg.attention == "math"  # (1)!
    f = elem if cfg.attention == "math" else 4  # (2)!
    bsh = b * s * h * elem  # one tensor shaped like the residual stream
    stats = 2 * b * s * elem  # a layer norm's mean and 1/std, one per row
    probs = a * b * s * s * f  # one s x s matrix per head
    rows = [("embedding", "position indices (int64)", s * INT64)]
    if drop:
        rows.append(("embedding", "dropout noise (input dtype, not 1 byte)", bsh))  # (3)!
    for i in range(cfg.layers):
        layer = f"layer {i}"
        rows += [(layer, "ln1 input: the residual stream", bsh),
                 (layer, "ln1 mean and 1/std", stats),
                 (layer, "ln1 output = qkv input", bsh)]
        if scores_kept:
            rows += [(layer, "q, k, v copied contiguous for the matmuls", 3 * b * s * h * f),
                     (layer, "softmax output (the attention probabilities)", probs)]
            if drop:
                rows += [(layer, "attention dropout noise", probs),
                         (layer, "dropped probabilities", probs)]
            if cfg.attention == "math":
                rows.append((layer, "causal mask (bool)", s * s))
            rows.append((layer, "attention output made contiguous = proj input", bsh))
        else:
            rows += [(layer, "qkv output: q, k, v are views of it", 3 * bsh),  # (4)!
                     (layer, "attention output = proj input", bsh),
                     (layer, "log-sum-exp per row (fp32)", a * b * s * 4)]
        if drop:
            rows.append((layer, "residual dropout noise", bsh))
        rows += [(layer, "ln2 input: the residual stream", bsh),
                 (layer, "ln2 mean and 1/std", stats),
                 (layer, "ln2 output = MLP up input", bsh),
                 (layer, "MLP up output = GELU input (4h wide)", 4 * bsh),
                 (layer, "GELU output = MLP down input (4h wide)", 4 * bsh)]
        if drop:
            rows.append((layer, "MLP dropout noise", bsh))
    rows += [("head", "final residual = ln_f input", bsh),
             ("head", "ln_f mean and 1/std", stats),
             ("head", "ln_f output = head input", bsh),
             ("head", "log-softmax output (vocab wide)", b * s * v * elem),  # (5)!
             ("head", "targets, copied contiguous (int64)", b * s * INT64),
             ("head", "loss and its total weight (scalars)", 2 * elem)]
    return rows
# --8<-- [end:saved]


def tinygpt_activation_bytes(cfg: GPTConfig, batch: int, elem: int = 4) -> dict[str, int]:
    """The saved bytes of :func:`tinygpt_saved_tensors` summed by part: embedding, layers, head, total."""
    out = {"embedding": 0, "layers": 0, "head": 0}
    for where, _what, nbytes in tinygpt_saved_tensors(cfg, batch, elem):
        out["layers" if where.startswith("layer") else where] += nbytes
    out["total"] = sum(out.values())
    return out


# --8<-- [start:gap]
def gap_to_paper(cfg: GPTConfig, batch: int, elem: int = 4) -> list[tuple[str, int]]:
    """Term by term, what TinyGPT keeps beyond the paper's formula (same element size).

    paper formula x layers + these terms = the total of tinygpt_saved_tensors."""
    b, s, h, a, n = batch, cfg.seq_len, cfg.width, cfg.heads, cfg.layers
    sbh, scores = b * s * h, a * b * s * s  # elements
    parts = tinygpt_activation_bytes(cfg, batch, elem)
    drop = cfg.dropout > 0
    scores_kept = drop or cfg.attention == "math"
    f = elem if cfg.attention == "math" else 4
    out = [("outside the layers: position indices, embedding dropout", parts["embedding"]),
           ("outside the layers: final norm, head, log-softmax, targets, loss", parts["head"]),
           ("layer norms keep a mean and 1/std per row; the paper omits them",
            n * 4 * b * s * elem)]
    if drop:  # (1)!
        out.append(("CPU dropout keeps noise in the data's dtype, the paper 1-byte masks",
                    n * ((elem - 1) * 2 * sbh + (f - 1) * scores)))
    if scores_kept and f != elem:  # (2)!
        out.append(("CPU SDPA's fallback computes attention in fp32: q, k, v, scores upcast",
                    n * (f - elem) * (3 * sbh + 2 * scores)))
    if not scores_kept:  # (3)!
        out.append(("CPU flash attention keeps a log-sum-exp per row, not the s x s scores",
                    n * (a * b * s * 4 - scores * elem)))
    if cfg.attention == "math":
        out.append(("the explicit causal mask, a bool s x s tensor per layer", n * s * s))
    return out
# --8<-- [end:gap]


# --8<-- [start:measure]
def train_step(model, optimizer, x, y, masters=()) -> float:
    with marks.phase("forward", 0):
        loss = model(x, y)[1]  # (1)!
    with marks.phase("backward", 0):
        loss.backward()
    with marks.phase("optimizer", 0):
        for p, master in zip(model.parameters(), masters):  # (2)!
            master.grad = p.grad.float()
        optimizer.step()  # (3)!
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters):
                p.copy_(master)  # the updated master, rounded into the 16-bit working copy
                master.grad = None
    return loss.item()


def measure_step(shape: Shape, dtype: torch.dtype = torch.float32, fp32_masters: bool = False,
                 optimizer: str = "adamw", dropout: float = 0.1, device: torch.device | str = "cpu",
                 seed: int = 0, snapshot: Path | None = None) -> Measurement:
    """One training step of TinyGPT with this shape while the ledger watches: bytes by category.

    dtype: the model's (its working copy, gradients and activations); fp32_masters: keep an fp32
    master copy of every parameter, which the optimizer updates; optimizer: sgd, momentum or
    adamw; dropout: TinyGPT's dropout probability; device: where to run; seed: for the weights and
    the batch; snapshot: a CUDA memory-history pickle to write (None: none)."""
    device = torch.device(device)
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab=shape.vocab, seq_len=shape.seq, width=shape.hidden,
                    layers=shape.layers, heads=shape.heads, dropout=dropout)
    model = TinyGPT(cfg).to(device=device, dtype=dtype)
    masters = [p.detach().float() for p in model.parameters()] if fp32_masters else []  # (4)!
    trained = masters or list(model.parameters())  # with masters the optimizer updates them
    opt = (torch.optim.AdamW(trained, lr=1e-3) if optimizer == "adamw" else
           torch.optim.SGD(trained, lr=1e-3, momentum=0.9 if optimizer == "momentum" else 0.0))
    x, y = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=seed).batch(0, shape.batch, device)
    ledger = Ledger(device).track_module(model).track_optimizer(opt)
    ledger.track(masters, "parameters")  # the ledger has no master category: counted apart below
    reset_peak(device)
    with record_snapshot(snapshot), ledger:
        loss = train_step(model, opt, x, y, masters)
    tl = ledger.timeline()
    forward = next(s for s in tl.spans if s.name == "forward")
    now = ledger.current()  # (5)!
    measured = {k: now[k] for k in ("parameters", "gradients", "optimizer_state")}
    measured["master_weights"] = sum(counted_bytes(m.untyped_storage().nbytes(), device) for m in masters)
    measured["parameters"] -= measured["master_weights"]
    measured["optimizer_state_on_host"] = tl.host["optimizer_state"][-1]  # (6)!
    measured["activations"] = tl.device["activations"][forward.end - 1]  # (7)!
    return Measurement(cfg, device, loss, measured, ledger, allocator_stats(device),
                       tinygpt_activations=tinygpt_activation_bytes(cfg, shape.batch, dtype.itemsize),  # (8)!
                       gap_to_paper=gap_to_paper(cfg, shape.batch, dtype.itemsize))
# --8<-- [end:measure]


@dataclass
class Measurement:
    """What one measured step of TinyGPT gave (:func:`measure_step`)."""

    model_config: GPTConfig
    device: torch.device
    loss: float
    measured: dict[str, int]  # bytes by category after the step; activations when forward ended
    ledger: Ledger
    cuda: dict | None  # the allocator's counters (CUDA only)
    tinygpt_activations: dict[str, int]  # tinygpt_saved_tensors summed by part
    gap_to_paper: list[tuple[str, int]]  # the terms between that sum and the paper's formula

    @property
    def exact(self) -> bool:
        """On CPU the ledger counts storage.nbytes(): formulas and measurement agree to the byte."""
        return self.device.type == "cpu"

    @property
    def host_counters(self) -> int:
        """AdamW's step counters on the host: those of CUDA parameters (torch/optim/adam.py)."""
        return self.measured["optimizer_state_on_host"]


def saved_table(cfg: GPTConfig, batch: int, elem: int = 4, parts=("embedding", "layer 0", "head")) -> Table:
    """What TinyGPT keeps for backward in some of its parts (default: the embedding, the first
    layer and the head), one row per tensor. cfg, batch, elem: as for tinygpt_saved_tensors."""
    return Table(["where", "tensor kept for backward", ("bytes", "B")],
                 [[where, what, nbytes] for where, what, nbytes in tinygpt_saved_tensors(cfg, batch, elem)
                  if where in parts])
