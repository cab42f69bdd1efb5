"""Lab 13 - what is read from a trace, what is derived beside it, and Lab 01's formulas against it.

``derive(trace)`` reads the ledger's timeline of the traced step and adds what the trace cannot hold,
each addition labelled **derived**:

* ``kv_cache`` (``--task infer``): the zoo's models return no cache, so the K and V of every layer
  for ``--seq`` tokens are counted from the shape (a server holds them from the end of prefill on);
* DDP's gradient buckets (``--dp`` > 1 at ZeRO stage 0 or 1): a copy of every gradient that DDP
  keeps for its all-reduce (Lab 10 measures them); DDP's C++ reducer cannot run on fake tensors;
* ``--offload optimizer`` at a ZeRO stage: the optimizer state, and the optimizer step's
  temporaries, leave the device for the host (Lab 07's engine is single-rank, so it is derived);
* ``--offload params``: FSDP2 copies each block's shard from the host to the device before it
  gathers it; on a CPU trace host and device are one memory and no copy is made, so two blocks'
  shards (one gathering, one prefetched) are added to ``communication``.

It also counts, inside activations, the weights' bf16 casts that autocast saves for backward
(``weight_casts``: the storages ``fit_setup.WeightCasts`` saw made, alive at each row), traced.

``predicted(trace)`` is Lab 01's formula for each category, and ``reasons(trace)`` one line per
category on why the trace differs.
"""

from __future__ import annotations

from labkit import labs
from labkit.table import format_bytes
from labkit.timeline import CATEGORIES, HOST_COPIES, Timeline

lab01 = labs.load(1)  # zero_model_state, activation_bytes_per_layer, kv_cache_bytes, RECIPES
lab15 = labs.load(15)  # model_state: a LoRA's adapters and frozen base, NF4's constants, 8-bit AdamW's state
Shape = labs.load(1, "toy_gpt").Shape

KV_CACHE = "kv_cache"
WEIGHT_CASTS = "weight_casts"  # a part of activations (fit_setup.WeightCasts), reported on its own line
DEVICE_CATEGORIES = tuple(c for c in dict.fromkeys((*CATEGORIES, KV_CACHE)) if c != HOST_COPIES)  # each once
ELEMENT = {"fp32": 4, "bf16": 2, "mixed": 2}  # bytes of an activation (and a K or V) element
WEIGHT_OF = {"fp32": "fp32 adapters", "bf16": "bf16 adapters", "mixed": "fp32 adapters, PEFT's"}
WEIGHT = {"fp32": 4, "bf16": 2, "mixed": 4}  # bytes of a weight and of its gradient, as traced


def derive(trace) -> dict:
    """The per-rank peak of ``trace`` by category and by phase, the most each category held, what
    lives on the host, and where each category's figure comes from (traced or derived)."""
    c, tl = trace.config, trace.timeline
    params = c.spec.param_count()
    local = rank_params(trace) if c.tp > 1 or c.pp > 1 else params  # --tp, --pp: what the rank holds
    columns = {k: list(tl.device[k]) for k in tl.device if k != HOST_COPIES}
    host = list(tl.host_total())
    sources = {k: "traced" for k in columns}
    n = len(tl)
    if c.task == "decode":
        sources[KV_CACHE] = "traced: the cache preallocated to --kv-len tokens per sequence (fit_decode.py)"
    if c.task == "infer":
        columns[KV_CACHE] = [kv_cache_bytes(c)] * n
        sources[KV_CACHE] = "derived: 2 x layers x batch x seq x kv_heads x head_dim x element (no cache is returned)"
    if c.dp > 1 and c.zero_stage <= 1:
        buckets = local * WEIGHT[c.precision]
        columns["communication"] = [v + buckets for v in columns["communication"]]
        sources["communication"] = "derived: DDP's gradient buckets, one copy of every gradient (Lab 10)"
    if c.offload == "params":
        shards = 2 * -(-params // max(c.spec.layers, 1) // c.dp) * WEIGHT[c.precision]
        columns["communication"] = [v + shards for v in columns["communication"]]
        sources["communication"] = "traced + derived: two blocks' shards copied to the device, 2 x P / layers / dp x e"
    if c.offload == "optimizer" and c.zero_stage:
        in_step = optimizer_rows(tl)
        for i in range(n):
            moved = columns["optimizer_state"][i] + (columns["temporaries"][i] if i in in_step else 0)
            host[i] += moved
            columns["optimizer_state"][i] = 0
            if i in in_step:
                columns["temporaries"][i] = 0
        sources["optimizer_state"] = "derived: on the host (ZeRO-Offload); the step's temporaries with it"
    view = Timeline(categories=DEVICE_CATEGORIES, index=tl.index, phase=tl.phase, step=tl.step,
                    device={k: columns.get(k, [0] * n) for k in DEVICE_CATEGORIES}, spans=tl.spans)
    total = view.device_total()
    at = max(range(n), key=total.__getitem__) if n else 0
    casts = weight_casts(trace, n)
    return {"peak": view.peak(), "peak_phase": tl.phase[at] if n else None, "by_phase": view.peaks_by_phase(),
            "weight_casts": {"max": max(casts, default=0), "at_peak": casts[at] if n else 0,
                             "at_activations_max": casts[max(range(n), key=columns["activations"].__getitem__)]
                             if n else 0},
            "category_max": {k: max(v, default=0) for k, v in view.device.items()},
            "host_peak_bytes": max(host, default=0), "sources": {k: sources.get(k, "traced") for k in DEVICE_CATEGORIES},
            "params": params, "rank_params": local}


def rank_params(trace) -> int:
    """Parameters of the rank's slices (a DTensor's local shard; a whole norm weight), of the traced model."""
    return sum(getattr(p, "_local_tensor", p).numel() for p in trace.keep[0].parameters()) if trace.keep else 0


def weight_casts(trace, n: int) -> list[int]:
    """Bytes of the weights' dtype casts (``fit_setup.WeightCasts``) that the ledger counts as activations,
    at each row of the timeline: autocast saves them for backward, so they live until backward uses them."""
    ledger, out, live, sizes = trace.ledger, [], 0, {}
    if ledger is None or not trace.casts:
        return [0] * n
    counted = {sid for sid in trace.casts
               if ledger.category_of(ledger.records[sid]) == "activations" and ledger.scope_of(ledger.records[sid]) == "device"}
    for ev in ledger.events[:n]:
        if ev[1] in counted:
            if ev[0] == "alloc":
                sizes[ev[1]] = ev[2]
                live += ev[2]
            elif ev[0] == "free":
                live -= sizes.pop(ev[1], 0)
            else:
                live += ev[3] - sizes.get(ev[1], ev[2])
                sizes[ev[1]] = ev[3]
        out.append(live)
    return out


def optimizer_rows(tl: Timeline) -> set[int]:
    return {i for s in tl.spans if s.name == "optimizer" for i in range(s.start, s.end)}


def kv_cache_bytes(config) -> int:
    """Lab 01's KV cache, 2 x L x b x s x kv_heads x head_dim x e, for the zoo model's shape."""
    s = config.spec
    seq = (config.kv_len or config.seq) if config.task == "decode" else config.seq
    shape = Shape(layers=s.layers, hidden=s.head_dim * s.heads, heads=s.heads, seq=seq, batch=config.batch,
                  vocab=s.vocab, kv_heads=s.kv_heads)
    return lab01.kv_cache_bytes(shape, act=ELEMENT[config.precision])


# ----------------------------------------------------------------------------- Lab 01 beside the trace
def predicted(trace) -> dict[str, int | None]:
    """Lab 01's formula for each category, per rank (None: Lab 01 has none for it)."""
    c, s = trace.config, trace.config.spec
    params = trace.derived["params"]
    out: dict[str, int | None] = dict.fromkeys(DEVICE_CATEGORIES)
    if c.task != "train":
        out["parameters"] = lab01.RECIPES[c.precision].param * (-(-params // c.dp) if c.zero_stage == 3 else params)
        out[KV_CACHE] = kv_cache_bytes(c)
        return out
    if c.method != "full" or c.optimizer == "adamw8bit":  # Lab 15's formulas, from the traced model's shapes
        out |= {k: v for k, (_, v) in lab15.model_state(trace.keep[0], c.optimizer).items()}
    else:
        optimizer = "momentum" if c.optimizer == "sgd" else "adamw"
        state = lab01.zero_model_state(params, c.precision, optimizer, c.zero_stage, c.dp)
        out["parameters"] = state["parameters"] + state["master_weights"]
        out["gradients"], out["optimizer_state"] = state["gradients"], state["optimizer_state"]
    def layers(n: int, recompute: str) -> int:
        return n * lab01.activation_bytes_per_layer(c.seq, c.batch, s.width, s.heads, act=lab01.RECIPES[c.precision].act,
                                                    mask=None, recompute=recompute)
    kth = s.layers // c.checkpoint_every if c.checkpointing == "every-kth-block" else 0  # (fit_every_kth.py)
    out["activations"] = layers(kth, "full") + layers(s.layers - kth, "none") if kth else layers(s.layers, c.checkpointing)
    return out


def reasons(trace) -> dict[str, str]:
    """One line per category: why the trace and Lab 01's formula differ."""
    c, s = trace.config, trace.config.spec
    mixed = c.precision == "mixed"
    amp = mixed and c.zero_stage < 2  # torch AMP (autocast); under FSDP2, its MixedPrecisionPolicy instead
    shard = {k: f" / {c.dp}" if c.zero_stage >= lab01.ZERO_SHARDS[k] else "" for k in lab01.ZERO_SHARDS}
    logits = c.batch * c.seq * s.vocab * 4
    out = {
        "parameters": ("Lab 01's mixed is ZeRO's accounting: a bf16 copy (2 B) and an fp32 master (4 B) per parameter; torch AMP "
                       "keeps one fp32 copy (4 B) and casts each weight as forward uses it" if amp else
                       f"Lab 01's mixed is ZeRO's accounting (2 B + 4 B); FSDP2 keeps the fp32 shards (4 B x P{shard['parameters']}) "
                       "and gathers each block's weights in bf16 (communication)" if mixed else
                       f"{WEIGHT[c.precision]} B x P{shard['parameters']}: equal, but for 512-byte rounding per tensor"),
        "gradients": ("ZeRO's accounting keeps bf16 gradients (2 B; Megatron-Core's fp32 ones make 18 B/param); AMP's "
                       "have the weights' dtype (4 B)" if mixed else
                      f"{WEIGHT[c.precision]} B x P{shard['gradients']}, alive from backward to zero_grad"),
        "optimizer_state": (f"{'SGD momentum: one' if c.optimizer == 'sgd' else 'AdamW: two'} moment(s) in the "
                            f"weights' dtype{shard['optimizer_state']}" + ("; Lab 01 counts fp32 moments (ZeRO's accounting)"
                                                                           if c.precision == "bf16" else "")),
        "activations": (f"Korthikanti's formula is a GPT block (4h MLP, LayerNorm, dropout, s x s scores); this "
                        f"{s.family} block keeps a {s.ffn:,}-wide SwiGLU, fp32 RMSNorm inputs, RoPE'd q and k and "
                        f"SDPA's output and log-sum-exp, no scores; plus the loss's fp32 log-softmax, "
                        f"{format_bytes(logits)}" + ("; plus autocast's bf16 weight casts (next line)" if amp else "")
                        + ("; --compile: what AOTAutograd's partitioner saves, cheap pointwise ops recomputed in backward"
                           if getattr(c, "compile", False) else "")
                        if c.checkpointing != "full" else
                        "full checkpointing keeps each block's input in the residual stream's dtype "
                        f"({'fp32 under autocast' if amp else c.precision}); plus the loss's fp32 log-softmax, "
                        f"{format_bytes(logits)}"),
        WEIGHT_CASTS: ("autocast casts each fp32 weight to bf16 for its matmul and backward needs that cast: it is "
                       "saved, from forward until backward has used it (2 B x each linear's parameters); Lab 01 "
                       "has no such term" if amp else
                       "none: FSDP2's MixedPrecisionPolicy gathers bf16 weights (param_dtype) and reduces fp32 "
                       "gradients (reduce_dtype), so no autocast and no unsharded copy of a weight"
                       if mixed else "none: no autocast"),
        "temporaries": ("no formula in Lab 01: "
                        + ("foreach AdamW's intermediates (a copy of a moment), " if c.optimizer in ("adamw", "adamw-foreach")
                           else "") + ("autocast's cache: the bf16 cast of every weight until forward's autocast region ends (the "
                                       "casts backward needs are saved: activations), " if amp else "") + "the fp32 logits and their gradient, recomputed blocks"),
        "communication": "no formula in Lab 01: " + ("FSDP2's gathered blocks in flight and reduce-scatter inputs"
                                                     if c.zero_stage >= 2 else "DDP's gradient buckets (derived)"
                                                     if c.dp > 1 else "none on one rank"),
        "other": "the token ids of the batch",
        KV_CACHE: "derived from the shape: the same formula",
    }
    if c.method != "full":
        adapters = f"LoRA's A and B, rank {c.lora_rank}, on {','.join(c.lora_targets)} of every block"
        out |= {"parameters": f"{adapters} (Lab 15's formula): equal, but for 512-byte rounding per tensor",
                "gradients": f"the adapters' alone: the base is frozen ({WEIGHT_OF[c.precision]})",
                "frozen_weights": ("NF4 codes, n / 2 B per linear of the blocks, and the embedding, norms and head in "
                                   "bf16 (Lab 15)" if c.method == "qlora" else "the whole base, frozen (Lab 15)")
                + ": equal, but for 512-byte rounding per tensor",
                "quant_constants": "per NF4 linear: an 8-bit absmax per 64 weights, a float32 scale per 256 of those, a "
                                   "float32 offset (Lab 15); each tensor rounded to 512 B",
                "dequantized": "one linear's weight read back to bf16 for its matmul, and Lab 15's float32 working copies "
                               "(32 MiB chunks); no formula in Lab 01"}
    if c.method != "full" and c.optimizer != "adamw8bit":
        out["optimizer_state"] = f"AdamW's two moments of the adapters alone, in their dtype ({WEIGHT_OF[c.precision]}; Lab 15)"
    if c.optimizer == "adamw8bit":
        out["optimizer_state"] = ("two 1-byte codes per value and a float32 absmax per 2,048 for each moment (Lab 15's "
                                  "8-bit AdamW); float32 moments for tensors under 4,096 values")
    if c.offload == "optimizer":
        out["optimizer_state"] = "on the host (ZeRO-Offload): Lab 01 counts it on the device"
    if c.offload == "params":
        out["parameters"] = "the shards live on the host (FSDP2's CPU offload): Lab 01 counts them on the device"
    if c.task == "decode":
        out["temporaries"] = "no formula in Lab 01: a block's intermediates for the new tokens, and their logits"
        out[KV_CACHE] = "traced: the cache preallocated to --kv-len tokens per sequence; Lab 01's formula, equal"
    if c.task == "infer":
        out["activations"] = "none: a prefill under no_grad keeps nothing for a backward"
        out["temporaries"] = (f"no formula in Lab 01: the logits of every position, {format_bytes(logits // 4 * ELEMENT[c.precision])}"
                              ", and each block's intermediates while it runs")
    return out
