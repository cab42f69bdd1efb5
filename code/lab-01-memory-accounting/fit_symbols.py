"""Lab 01 - will it fit? The calculator's vocabulary: the constant bytes its formulas add, the symbols
they are written in, and what every other name in the formula code the "Will it fit?" page quotes
means (``fit_formula.py`` uses them; ``scripts/fit_table.py`` writes the page's legend from them)."""

ROW, LSE, SLOT = 4, 4, 12  # fp32 1/rms per token; fp32 log-sum-exp per head and token; a routed token's index, weight
SCALE = 512  # a saved float32 scale (--float8): 4 bytes, rounded up to one 512-byte block of the caching allocator
INDICES = 24  # a serving forward's int64 positions, pool rows and gather index, per new token (LEGEND says each)

SYMBOLS = {
    "L": "layers", "h": "hidden size", "a": "attention heads (per rank)", "k": "KV heads (per rank)",
    "d": "head size", "q": "a × d", "g": "k × d", "f": "MLP hidden size (per rank)", "V": "vocabulary (per rank)",
    "E": "experts", "K": "experts per token", "s": "tokens per sequence (a rank's under --cp: --seq / --cp)", "T": "tokens per micro-batch (a rank's)",
    "P": "parameters (per rank)", "Pt": "trainable parameters", "Pb": "parameters of one block",
    "Pr": "parameters outside the blocks", "Pm": "matmul weights of the blocks", "n": "trainable tensors",
    "R": "LoRA rank", "dp": "data-parallel ranks a parameter is sharded over (--dp; under HSDP, --dp / --replicate; under --cp, --dp x --cp)", "w": "bytes of a weight and its gradient",
    "m": "bytes of an optimizer moment", "c": "bytes of a matmul operand", "r": "bytes of the residual stream",
    "N": "requests", "C": "tokens per request", "B": "tokens per KV block", "e": "bytes of a cached K or V element",
    "p": "prefill tokens at once", "Pq": "quantized matmul weights of one block (all but a router's)",
    "nq": "quantized matrices of one block", "so": "their outputs, added up", "si": "their inputs, added up",
    "b": "sequences in the batch (decode)",
    "D": "tokens the KV cache holds per sequence (decode: --kv-len)", "j": "new tokens per sequence (decode)", "t": "tensor-parallel ranks (--tp)", "pp": "pipeline stages (--pp): L is then the first stage's ⌈L / pp⌉ blocks", "u": "tokens per loss chunk (⌈T / 8⌉, --loss chunked or fused-linear)",
    "G": "blocks per checkpointed segment (--checkpoint-every: every-k; every-kth-block checkpoints every G-th block)",
    "wb": "bytes of a frozen weight", "Pc": "bytes of the NF4 codes (⌈n / 2⌉ per linear)",
    "Nb": "NF4 blocks (an 8-bit absmax code per 64 weights)", "Ns": "float32 scales of the absmax codes (one per 256)",
    "Nq": "NF4 linears (a float32 offset each)", "Pk": "trained values with 8-bit moments (tensors of 4,096 or more)",
    "Nk": "blocks of 2,048 of those (a float32 absmax per moment)", "Ps": "trained values with float32 moments",
    "Cw": "values the 8-bit AdamW updates at once (its chunk, or the largest tensor)",
}
#: What every other name in the formula code the "Will it fit?" page quotes means (``scripts/fit_table.py``
#: writes the page's legend from SYMBOLS, the inputs' help and this, and fails on a name none of them holds).
LEGEND = {
    "S": "the symbols of this configuration (symbols()): S.h is h, with its value",
    "x": "the calculator's inputs (Inputs): x.seq is --seq",
    "Expr": "a formula: its text in symbols, the same text filled in, and its value (fit_expr.py)",
    "Inputs": "the inputs, one field per flag of Lab 13's fit.py and Lab 14's serve_memory.py (fit_inputs.py)",
    "ZERO": "the formula 0",
    "ceil_div": "⌈a / b⌉: a share rounded up",
    "larger": "max(a, b): the larger of two moments",
    "ROW": "bytes of an RMSNorm's fp32 1/rms, per token",
    "LSE": "bytes of flash attention's fp32 log-sum-exp, per head and token",
    "SLOT": "bytes a routed token keeps: its expert's index and weight",
    "SCALE": "bytes a saved float32 scale takes: one 512-byte block of the caching allocator",
    "S.f8tp": "--float8 tensorwise under --tp: torchao's float8 TP styles (fit_split.float8_layer)",
    "INDICES": "bytes per new token of a serving forward's int64 positions, pool rows and gather index",
    "MOMENTS": "optimizer moments per parameter, by optimizer kind (Lab 01)",
    "STEP_COUNTER": "bytes of AdamW's fp32 step count, per trainable tensor (Lab 01)",
    "ZERO_SHARDS": "the ZeRO stage from which each category is sharded (Lab 01)",
    "OPTIMIZERS": "each --optimizer choice's kind, as Lab 01 counts its state",
    "KV_DTYPES": "each --kv-dtype: bytes of a cached element, and of its fp32 scale per token and KV head",
    "weights": "the served weights: the blocks' matrices in --weights (Lab 14's quantize.FORMATS), the rest in w",
    "x.weights": "--weights",
    "x.spec": "the model: the preset's dimensions, or the typed ones (a labkit.zoo ModelSpec)",
    "fsdp_mixed": "mixed precision under FSDP2 (ZeRO-2 and 3): bf16 gathers, fp32 reduction, no autocast",
    "sizes": "the counts a formula reads off the model and the step, for one rank",
    "symbols": "each count as a symbol with this configuration's value: the S above",
    "_full": "a moment's categories, 0 where it holds none",
    "total": "the sum of its terms, leaving out those that are 0",
    "LOSS_CHUNKS": "chunks of tokens of --loss chunked and fused-linear (torchtune's default)",
    "FROZEN": "bytes of a frozen weight under --method lora or qlora, by --precision (the base PEFT loads)",
    "NF4_BLOCKS": "NF4's blocks (Lab 15): weights per 8-bit absmax code, absmax codes per float32 scale, weights read back at once",
    "OPT8": "the 8-bit AdamW (Lab 15): values per absmax, the smallest tensor in 8 bits, values updated at once, "
            "bytes of its working copies",
    "lora": "Lab 15's lora.py: the projections an adapter can target (ALL), their shapes and adapter sizes",
    "lora_step": "a LoRA or QLoRA training step (--method lora|qlora, --task train): the base frozen",
    "lora_activations": "what a LoRA step's forward keeps (fit_lora.py, below)",
    "frozen_state": "the frozen base and QLoRA's quantization constants (fit_lora.py, below)",
    "adam8bit_state": "the 8-bit AdamW's state (fit_lora.py, below)",
    "fine_tune_state": "the model state with the 8-bit AdamW's blocks and a LoRA's frozen base (fit_lora.py, below)",
    "fine_tune_symbols": "Lab 15's symbols: wb, Pc, Nb, Ns, Nq, Pk, Nk, Ps, Cw (fit_lora.py)",
    "adam8bit_chunk": "the 8-bit AdamW's chunk at the optimizer step: its float32 working copies (fit_lora.py, below)",
    "fit_compiled": "--compile's formulas: what a compiled block saves, and its backward's peak (fit_compiled.py, below)",
    "fit_split": "the moments a split model adds: --tp's whole embedding gradient, --pp's first stage (fit_split.py)",
    "fit_kth": "--checkpointing every-kth-block: what its plain and checkpointed blocks keep, the last block recomputed "
               "(fit_kth.py)",
    "own": "an RMSNorm's own tensors per token (fp32 input, 1/rms, the normalised stream); on T / t tokens under --sp",
}
