"""Lab 01 · model parallelism: what ONE GPU holds when the model itself is split.

Data parallelism and ZeRO (``memory_accounting.zero_model_state``) split the model state and leave
every GPU a whole layer to run. Model parallelism splits the layers:

* **Tensor parallelism** (Megatron-LM; Shoeybi et al. 2019) splits each weight matrix of a layer
  across t GPUs: QKV and the MLP's first matrix by columns, the output projection and the MLP's
  second matrix by rows; a head lives on one GPU. Layer norms stay whole on every GPU.
* **Sequence parallelism** (Korthikanti et al. 2022, section 4.2.2) splits, along the sequence, the
  parts tensor parallelism leaves whole: the layer norms and the dropouts.
* **Pipeline parallelism** (1F1B, Narayanan et al. 2021) gives each of p stages L/p layers. Stage 0
  holds the embeddings and, to keep the pipeline full, the activations of p micro-batches.
* **Context parallelism** gives each of its GPUs s/cp tokens of every sequence.
* **Expert parallelism** gives each of its GPUs experts/ep of the experts of every MoE layer; the
  rest of the model is replicated across them.

The activation formula itself (Korthikanti et al. 2022, Table 2) lives in
``memory_accounting.activation_bytes_per_layer``, which takes t, sp and cp. This file holds the
layout and the parameters one GPU holds under it; ``estimate_bytes`` puts them together.
"""

from __future__ import annotations

from dataclasses import dataclass

from toy_gpt import Shape


# --8<-- [start:layout]
@dataclass(frozen=True)
class Layout:
    """How the model is split across GPUs (data parallelism and ZeRO aside). Figures are per GPU."""

    tp: int = 1  # t: tensor-parallel size
    sp: bool = False  # sequence parallelism, over the same t GPUs
    pp: int = 1  # p: pipeline stages, 1F1B; figures are stage 0's, the fullest
    cp: int = 1  # context-parallel size: each GPU holds s/cp tokens of every sequence
    experts: int = 0  # MoE: experts per layer, each an MLP of the dense size (0: dense)
    ep: int = 1  # expert-parallel size: each GPU holds experts/ep of every MoE layer

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations stage 0 holds under 1F1B: p (Korthikanti et al., 4.2.3)."""
        return self.pp  # (1)!


ONE_GPU = Layout()


def params_per_rank(shape: Shape, layout: Layout = ONE_GPU) -> dict[str, int]:
    """Parameters on one GPU of pipeline stage 0, for TinyGPT's layout split the Megatron way.

    shape: the model (its L, h, s, V); layout: the split. Returns ``dense`` (replicated across the
    expert-parallel GPUs), ``experts`` (divided across them) and ``tensors`` (parameter tensors on
    the GPU, for AdamW's step counters)."""
    h, t, layers = shape.hidden, layout.tp, shape.layers // layout.pp  # (2)!
    attn_split, attn_whole = 4 * h * h + 3 * h, 5 * h  # (3)!
    mlp_split, mlp_whole = 8 * h * h + 4 * h, h  # (4)!
    dense, tensors = layers * (attn_split // t + attn_whole), layers * 8
    experts = 0
    if layout.experts:
        mine = layout.experts // layout.ep  # (5)!
        dense += layers * h * layout.experts  # the router, whole on every GPU
        experts, tensors = layers * mine * (mlp_split // t + mlp_whole), tensors + layers * (1 + 4 * mine)
    else:
        dense, tensors = dense + layers * (mlp_split // t + mlp_whole), tensors + layers * 4
    vocab = -(-shape.vocab // t) * h  # (6)!
    dense, tensors = dense + vocab + shape.seq * h, tensors + 2  # token and position embeddings
    if layout.pp == 1:  # the final norm and the head sit on the last stage: here, the only one
        dense, tensors = dense + 2 * h + vocab, tensors + 3
    return {"dense": dense, "experts": experts, "tensors": tensors}
# --8<-- [end:layout]


def total_params(shape: Shape, experts: int = 0) -> int:
    """P of the whole model: TinyGPT's count, with every MLP an ``experts``-way MoE layer if given."""
    whole = params_per_rank(shape, Layout(experts=experts))
    return whole["dense"] + whole["experts"]


# ---------------------------------------------------------------------- how the report says it
def layout_text(layout: Layout) -> str:
    """One line naming the split, for the report's header ('' for one GPU)."""
    parts = [f"TP {layout.tp}" + (" + SP" if layout.sp else "")] if layout.tp > 1 else []
    parts += [f"PP {layout.pp} (stage 0, 1F1B)"] if layout.pp > 1 else []
    parts += [f"CP {layout.cp}"] if layout.cp > 1 else []
    parts += [f"{layout.experts} experts per layer, EP {layout.ep}"] if layout.experts else []
    return ", ".join(parts)


def activation_formula(recompute: str, dropout: bool, layout: Layout, units: str) -> str:
    """The activation formula the report prints, in the paper's units (e: bytes per element, m: per
    mask element; ``units`` says their values); for one GPU, the text Lab 01 always printed."""
    if layout.tp == 1 and layout.cp == 1:  # nothing splits the layer's activations
        one = {"none": "L x [sbh(16e+2m) + as^2b(2e+m)]", "selective": "L x sbh(16e+2m)"} if dropout else \
            {"none": "L x [sbh x 16e + as^2b x e]", "selective": "L x sbh x 16e"}
        text = (one | {"full": "L x sbh x e"})[recompute] + units
    else:
        whole, scores = ("sbh(4e+2m)", "as^2b(2e+m)") if dropout else ("sbh x 4e", "as^2b x e")
        t, sp, c = "/t" if layout.tp > 1 else "", "/t" if layout.sp else "", "/c" if layout.cp > 1 else ""
        terms = {"none": [whole + sp, "sbh x 12e" + t, scores + t], "selective": [whole + sp, "sbh x 12e" + t],
                 "full": ["sbh x e" + sp]}[recompute]
        text = "L x " + (f"[{' + '.join(terms)}]{c}" if len(terms) > 1 or c else terms[0])
        text += "".join(f", {k}={v}" for k, v in (("t", layout.tp), ("c", layout.cp)) if v > 1) + units
    if layout.pp > 1:
        text += f"; stage 0 of p={layout.pp}: p micro-batches x L/p layers"
    return text
