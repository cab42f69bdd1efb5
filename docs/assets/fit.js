/* InfraLab · "Will it fit?" — the formulas of code/lab-01-memory-accounting/fit_formula.py, in the browser.

   One source of truth: the Python. This file is a line-for-line port of fit_expr.py, fit_inputs.py's
   rules, fit_formula.py and scripts/fit_table.py's verdict and ladder; every constant, bound, preset, GPU
   and lever comes from results/fit/calculator.json, which scripts/fit_table.py writes from the Python.
   tests/test_browser.py sets 600 configurations of results/fit/table.json and holds every category
   within 0.1 % of Python (the formulas here use BigInt: they are exact). Plain JavaScript, no library. */
(function () {
  "use strict";

  // ---------------------------------------------------------------------------- Expr (fit_expr.py)
  const fmt = (v) => String(v).replace(/\B(?=(\d{3})+(?!\d))/g, ",");  // Python's f"{v:,}"

  // Texts are built only where they are shown: the levers are tried for their bytes alone.
  let TEXT = true;

  class Expr {
    constructor(text, filled, value, sum) {
      this.text = text; this.filled = filled; this.value = value; this.sum = !!sum;
    }
    add(o) {
      o = lift(o);
      if (!TEXT) return new Expr("", "", this.value + o.value, true);
      return new Expr(`${this.text} + ${o.text}`, `${this.filled} + ${o.filled}`, this.value + o.value, true);
    }
    sub(o) {
      o = lift(o);
      if (!TEXT) return new Expr("", "", this.value - o.value, true);
      return new Expr(`${this.text} − ${par(o, "text")}`, `${this.filled} − ${par(o, "filled")}`, this.value - o.value, true);
    }
    mul(o) {
      o = lift(o);
      if (!TEXT) return new Expr("", "", this.value * o.value, false);
      return new Expr(`${par(this, "text")} × ${par(o, "text")}`, `${par(this, "filled")} × ${par(o, "filled")}`,
        this.value * o.value, false);
    }
  }
  const par = (e, which) => (e.sum ? `(${e[which]})` : e[which]);
  const lift = (x) => (x instanceof Expr ? x : sym(String(x), x));
  const sym = (name, value) => (TEXT ? new Expr(name, fmt(value), BigInt(value), false) : new Expr("", "", BigInt(value), false));
  const cdiv = (a, b) => (a + b - 1n) / b;
  const ceilDiv = (a, b) => {
    a = lift(a); b = lift(b);
    return new Expr(TEXT ? `⌈${a.text} / ${b.text}⌉` : "", TEXT ? `⌈${a.filled} / ${b.filled}⌉` : "", cdiv(a.value, b.value), false);
  };
  const larger = (a, b) => {
    a = lift(a); b = lift(b);
    return new Expr(TEXT ? `max(${a.text}, ${b.text})` : "", TEXT ? `max(${a.filled}, ${b.filled})` : "",
      a.value > b.value ? a.value : b.value, false);
  };
  const ZERO = new Expr("0", "0", 0n, false);
  /** Python: fit_expr.total: the sum of the terms that are not ZERO. */
  const total = (...terms) => terms.filter((t) => t !== ZERO).reduce((a, t) => (a === null ? t : a.add(t)), null) || ZERO;
  const n = (x) => lift(x);  // a literal

  // ---------------------------------------------------------------------------- the model (labkit.zoo's closed forms)
  let D = null;  // calculator.json

  function llamaParams(s) {
    const w = BigInt(s.width), hd = BigInt(s.head_dim), a = BigInt(s.heads), kv = BigInt(s.kv_heads);
    const attention = w * a * hd + 2n * w * kv * hd + a * hd * w;
    let mlp = 3n * w * BigInt(s.ffn);
    if (s.experts) mlp = BigInt(s.experts) * mlp + w * BigInt(s.experts);
    const perBlock = attention + mlp + 2n * w;
    return BigInt(s.vocab) * w * (s.tied ? 1n : 2n) + BigInt(s.layers) * perBlock + w;
  }
  function gptParams(s) {  // TinyGPT's closed form, the head tied to the embedding
    const w = BigInt(s.width), v = BigInt(s.vocab);
    const perBlock = 4n * w + w * 3n * w + 3n * w + w * w + w + w * 4n * w + 4n * w + 4n * w * w + w;
    return v * w + BigInt(s.context) * w + BigInt(s.layers) * perBlock + 2n * w;
  }
  const paramCount = (s) => (s.family === "gpt" ? gptParams(s) : llamaParams(s));

  function rankSpec(s, tp) {
    if (tp === 1) return s;
    return Object.assign({}, s, { heads: s.heads / tp, kv_heads: Math.max(1, Math.floor(s.kv_heads / tp)),
      ffn: s.ffn / tp, vocab: Math.ceil(s.vocab / tp) });
  }

  // ---------------------------------------------------------------------------- the inputs (fit_inputs.py)
  const field = (name) => D.inputs.find((f) => f.name === name);
  const DIMS = ["layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "experts", "top_k", "tied"];

  function presetDims(name) {
    const p = D.presets[name];
    const out = {};
    for (const k of DIMS) out[k] = p[k];
    return out;
  }
  function dims(x) {
    const base = x.model === "custom" ? {} : presetDims(x.model);
    const d = Object.assign({ experts: 0, top_k: 0, tied: false, head_dim: 0 }, base);
    for (const k of DIMS) if (x[k] !== null && x[k] !== undefined) d[k] = x[k];
    d.kv_heads = d.kv_heads || d.heads;
    return d;
  }
  function spec(x) {
    const d = dims(x);
    let family = x.model === "custom" ? "llama" : D.presets[x.model].family;
    family = d.experts ? "mixtral" : (family === "hf" || family === "mixtral" ? "llama" : family);
    return { family, layers: d.layers, width: d.hidden, heads: d.heads, kv_heads: d.kv_heads, ffn: d.ffn,
      vocab: d.vocab, tied: !!d.tied, experts: d.experts, top_k: d.top_k,
      head_dim: d.head_dim || d.hidden / d.heads, context: x.model === "custom" ? 0 : D.presets[x.model].context };
  }

  /** Text of one field (from the address or a control) as its type: [value, error]. */
  function parseField(f, text) {
    if (text === null || text === undefined || text === "") {
      return f.optional ? [null, null] : [f.default, null];
    }
    text = String(text).trim();
    if (f.type === "choice") {
      const hit = f.choices.find((c) => String(c) === text);
      return hit === undefined ? [null, `${f.flag} must be one of ${f.choices.join(", ")}, got ${text}`] : [hit, null];
    }
    if (f.type === "bool") {
      if (["true", "1", "on", "yes"].includes(text)) return [true, null];
      if (["false", "0", "off", "no"].includes(text)) return [false, null];
      return [null, `${f.flag} is a switch (true or false), got ${text}`];
    }
    if (f.type === "str") return [text, null];
    if (f.type === "list") {  // --lora-targets q,v: names from f.choices, each once
      const items = text.split(",").map((t) => t.trim()).filter((t) => t);
      if (!items.length) return [null, `${f.flag} needs at least one value`];
      const unknown = items.filter((t) => !f.choices.includes(t));
      if (unknown.length || new Set(items).size < items.length) {
        return [null, `${f.flag} ${items.join(",")}: each at most once, from ${f.choices.join(",")}` +
          (unknown.length ? ` (unknown: ${unknown.join(",")})` : "")];
      }
      return [items, null];
    }
    const num = Number(text);
    if (text === "" || !Number.isFinite(num)) return [null, `${f.flag} must be a number, got ${text}`];
    if (f.type === "int" && !/^-?\d+$/.test(text)) return [null, `${f.flag} must be a whole number, got ${text}`];
    if (f.type === "int" && !Number.isSafeInteger(num)) return [null, `${f.flag} ${text} is too large`];
    const range = () => (f.max === undefined ? `${f.min} or more` : f.min === undefined ? `${f.max} or less` : `in [${f.min}, ${f.max}]`);
    if (f.min !== undefined && num < f.min) return [null, `${f.flag} must be ${range()}, got ${text}`];
    if (f.max !== undefined && num > f.max) return [null, `${f.flag} must be ${range()}, got ${text}`];
    if (f.above !== undefined && num <= f.above) return [null, `${f.flag} must be above ${f.above}, got ${text}`];
    if (f.below !== undefined && num >= f.below) return [null, `${f.flag} must be below ${f.below}, got ${text}`];
    return [num, null];
  }

  /** Inputs.__post_init__'s rules: {field name: message}, empty when the inputs are valid. */
  function check(x) {
    const err = {};
    const say = (name, text) => { if (!err[name]) err[name] = text; };
    if (x.model !== "custom" && !D.presets[x.model]) say("model", `--model must be custom or a zoo preset, got ${x.model}`);
    if (x.model === "custom") {
      for (const k of ["layers", "hidden", "heads", "ffn", "vocab"]) {
        if (x[k] === null) say(k, `--model custom needs ${field(k).flag}`);
      }
    }
    if (Object.keys(err).length) return err;
    const d = dims(x);
    if (d.experts && !(d.top_k >= 1 && d.top_k <= d.experts)) say("top_k", `--top-k ${d.top_k} must be 1 to --experts ${d.experts}`);
    if (!d.experts && d.top_k) say("top_k", `--top-k ${d.top_k} routes to experts: give --experts too`);
    if (!x.head_dim && d.hidden % d.heads) say("heads", `--heads ${d.heads} does not divide --hidden ${d.hidden} (or give --head-dim)`);
    if (d.heads % d.kv_heads) say("kv_heads", `--kv-heads ${d.kv_heads} does not divide --heads ${d.heads}`);
    const t = x.tp, kv = d.kv_heads;
    if (d.heads % t || d.ffn % t || (t <= kv ? kv % t : t % kv)) {
      say("tp", `--tp ${t} does not split ${d.heads} heads, ${kv} KV heads and an MLP of ${d.ffn} evenly`);
    }
    if (Object.keys(err).length) return err;
    const s = spec(x);
    if (s.family === "gpt" && (d.ffn !== 4 * d.hidden || d.kv_heads !== d.heads)) {
      say("ffn", `--model ${x.model}: a GPT block has ffn = 4 * width and one KV head per head`);
    }
    if (s.family === "gpt" && x.weights !== "bf16" && x.task === "serve") {
      say("weights", `--weights ${x.weights}: the formula counts a Llama block's matrices; ${x.model} is a GPT`);
    }
    if (x.offload_activations && (s.family === "gpt" || d.experts || d.layers < 2)) {
      say("offload_activations", "--offload-activations: the formula counts what a dense Llama block of two or more saves last (no GPT preset or --experts: Lab 13 traces Mixtral's)");
    }
    if (x.cp > 1 && (x.task !== "train" || s.family === "gpt")) {
      say("cp", `--cp ${x.cp}: the formula rings a Llama's or Mixtral's attention in training (Lab 13): --task train, no GPT preset`);
    }
    if (units(x) && (s.family === "gpt" || d.tied || x.tp > 1)) {
      say("fsdp_units", `--fsdp-units ${x.fsdp_units}: the formula counts an untied embedding and head, unsplit (no GPT preset, --tied or --tp: Lab 13 traces --tp)`);
    }
    if (x.checkpointing === "every-kth-block" && (s.family === "gpt" || d.experts || x.offload !== "none" || x.offload_activations
        || x.optimizer_in_backward || units(x))) {
      say("checkpointing", "--checkpointing every-kth-block: the formula counts a dense Llama's blocks with every gradient on the device (no GPT preset, --experts, --offload, --offload-activations, --optimizer-in-backward or --fsdp-units blocks-embed-head)");
    }
    if (s.family === "gpt" && x.checkpointing === "save-alternate-matmuls") {
      say("checkpointing", "--checkpointing save-alternate-matmuls counts a Llama block's matmuls: no GPT preset");
    }
    const compiled = compileRule(x, s, d);
    if (compiled) say("compile", compiled);
    const head = d.head_dim || Math.floor(d.hidden / d.heads);
    if (x.float8 !== "none" && x.task === "train" && (s.family !== "llama" || d.experts
        || [d.hidden, d.ffn, d.heads * head, d.kv_heads * head].some((v) => v % 16))) {
      say("float8", `--float8 ${x.float8} converts a dense Llama's block linears, each dimension a multiple of 16 (torchao's rule): no --experts or GPT preset`);
    }
    if (s.family === "gpt" && t > 1) say("tp", `--tp ${t}: the GPT preset's closed form is for one rank; give a custom model to split`);
    const [segName, segText] = segments(x, d.layers) || [];
    if (segName) say(segName, segText);
    if (x.task === "train") {
      const [name, text] = sharding(x) || fineTuning(x, s) || [];
      if (name) say(name, text);
      else if (x.method !== "full" && d.experts) {
        say("method", `--method ${x.method} on a mixture of experts: the formulas count dense blocks (Lab 13 traces it: fit.py --model mixtral-8x7b --method ...)`);
      }
      if (t > 1 && kv % t) say("tp", `--tp ${t} does not split ${kv} KV heads: training splits whole KV heads (Lab 13)`);
      const [pname, ptext] = pipelineRule(x, s.family, d.layers) || [];
      if (pname) say(pname, ptext);
    }
    if (x.task !== "train" && x.pp > 1) say("pp", `--pp ${x.pp} is traced for training (Lab 13): --task ${x.task} has no pipeline here`);
    if (x.task === "decode") {
      if (s.family === "gpt" || x.precision === "mixed" || x.dp > 1 || t > 1 || x.zero_stage || x.offload !== "none") {
        say("task", "--task decode traces a Llama or Mixtral on one GPU with its weights on it, in their own dtype: --precision bf16 or fp32, no --dp, --tp, --zero-stage or --offload");
      } else if (x.new_tokens > (x.kv_len || x.seq)) {
        say("new_tokens", `--new-tokens ${x.new_tokens} is more than the cache holds, --kv-len ${x.kv_len || x.seq}`);
      }
    }
    return err;
  }

  /** TrainingRun.check_checkpointing: [the field, the message] of the first rule broken, or null. */
  function segments(x, layers) {
    const k = x.checkpoint_every, every = x.checkpointing === "every-k" || x.checkpointing === "every-kth-block";
    if (every && (k === null || k === undefined)) return ["checkpoint_every", `--checkpointing ${x.checkpointing} needs --checkpoint-every K: ` + (x.checkpointing === "every-k" ? "the blocks per segment" : "every K-th block checkpointed")];
    if (!every && k !== null && k !== undefined) return ["checkpoint_every", `--checkpoint-every ${k} sizes the segments of --checkpointing every-k (or picks every-kth-block's blocks); --checkpointing is ${x.checkpointing}`];
    if (k !== null && k !== undefined && k > layers) return ["checkpoint_every", `--checkpoint-every ${k} is more than the model's ${layers} blocks`];
    return null;
  }

  /** Python: fit_compiled.check (Lab 13's fit_compile.check_compile, then what the formula does not count): the
      message of the first rule broken, or null. */
  function compileRule(x, s, d) {
    if (!x.compile) return null;
    const lab13 = [[x.task !== "train", `--task ${x.task} has no backward to partition: --task train`],
      [s.family !== "llama" || d.experts, `${x.model} is not a dense zoo Llama (a MoE's routing depends on the tokens' values, which a compiled graph of fake tensors lacks)`],
      [x.checkpointing === "every-k", "every-k's segments span blocks, and each block is compiled alone: --checkpointing none, full, every-kth-block or an op-level policy"],
      [x.tp > 1, "DTensor's split blocks are not traced compiled (on torch 2.13 the real step fails in backward): --tp 1"],
      [x.method === "qlora", "Lab 15's NF4 linears read their weights back under a ledger mark that Dynamo cannot trace: --method lora, or QLoRA eager"]];
    const ours = [[x.cp > 1, "--cp's ring attention is not traced compiled (Lab 13)"],
      [x.pp > 1 || x.checkpointing === "every-kth-block" || x.method !== "full", "a pipeline stage, every-kth-block and LoRA's adapters in a compiled block have no formula here (Lab 13 traces them)"],
      [x.optimizer_in_backward || x.offload_activations, "--optimizer-in-backward and --offload-activations are not traced compiled (Lab 13)"],
      [x.float8 !== "none", "--float8's casts in a compiled block have no formula here (Lab 13 traces them)"],
      [x.offload === "params" && (x.loss !== "full" || x.checkpointing !== "none"), "--offload params beside a checkpointed block or a chunked loss: a compiled block's backward then holds the peak, with the offloaded shards, and has no formula here (Lab 13 traces it)"]];
    const first = lab13.find((r) => r[0]);
    if (first) return `--compile: ${first[1]}`;
    const mine = ours.find((r) => r[0]);
    return mine ? `--compile: ${mine[1]}: leave one out` : null;
  }

  /** FineTuning.check_fine_tuning: [the field, the message] of the first rule broken, or null. */
  function fineTuning(x, s) {
    if (x.method === "full") return null;
    const split = [["--tp", x.tp > 1], ["--pp", x.pp > 1], ["--float8", x.float8 !== "none"]].filter((f) => f[1]).map((f) => f[0]);
    if (split.length) {
      return ["method", `${split.join(" and ")} with --method ${x.method} is not traced together (Lab 15 traces adapters on one GPU, without float8): train every weight, or leave them out`];
    }
    if (!["llama", "mixtral", "hf"].includes(s.family)) {
      return ["method", `--method ${x.method} puts adapters on Llama's q, k, v, o, gate, up and down projections: ${x.model} is a ${s.family} model, which has none`];
    }
    if (x.method === "qlora" && x.precision === "fp32") {
      return ["method", "--method qlora reads its NF4 weights back in bf16 for every matmul: use --precision bf16 or mixed, not fp32"];
    }
    const smallest = loraShapes(s, x.lora_targets).reduce((a, t) => (a === null || Math.min(t[1], t[2]) < Math.min(a[1], a[2]) ? t : a), null);
    const low = Math.min(smallest[1], smallest[2]);
    if (x.lora_rank > low) {
      return ["lora_rank", `--lora-rank ${x.lora_rank} is larger than min(in, out) = ${low} of the ${smallest[0]} projection (${smallest[1]} -> ${smallest[2]}): a rank-r product cannot have r above either side`];
    }
    return null;
  }

  /** Inputs.check_pipeline: [the field, the message], or null. */
  function pipelineRule(x, family, layers) {
    if (x.pp === 1) return null;
    if (x.pp > layers) return ["pp", `--pp ${x.pp} is more pipeline stages than ${layers} layers`];
    if (family === "gpt") return ["pp", `--pp ${x.pp}: the formula cuts a Llama or Mixtral into stages`];
    for (const [name, flag, bad] of [["accumulation", "--accumulation equal to --pp", x.accumulation === x.pp],
      ["checkpointing", `--checkpointing ${x.checkpointing}`, x.checkpointing !== "none" && x.checkpointing !== "full"], ["zero_stage", "--zero-stage 2 or 3", x.zero_stage >= 2]]) {
      if (bad) return [name, `${flag} with --pp: the first stage's peak has no formula here yet (Lab 13 traces it)`];
    }
    return null;
  }

  /** Lab 15's lora.shapes: [name, in, out] of each targeted projection of one block (per expert in an MLP). */
  function loraShapes(s, targets) {
    const h = s.width, q = s.heads * s.head_dim, g = s.kv_heads * s.head_dim, f = s.ffn;
    const dims = { q: [h, q], k: [h, g], v: [h, g], o: [q, h], gate: [h, f], up: [h, f], down: [f, h] };
    const out = [];
    for (const t of targets) {
      const times = ["gate", "up", "down"].includes(t) ? Math.max(s.experts, 1) : 1;
      for (let i = 0; i < times; i++) out.push([t, ...dims[t]]);
    }
    return out;
  }

  /** fit_rules.check_context (--cp): [the field, the message] of the first rule broken, or null. */
  function context(x) {
    const c = x.cp || 1;  // (a calculator.json from before --cp has no such field)
    if (c === 1) return null;
    if (x.seq % (2 * c)) return ["cp", `--cp ${c} cuts each sequence into ${2 * c} chunks (torchtitan's head-tail split, two per rank): --seq ${x.seq} is not a multiple of ${2 * c}`];
    if (x.zero_stage < 2) return ["cp", `--cp ${c} shards the model with FSDP over --dp x --cp ranks, as torchtitan does: give --zero-stage 2 or 3`];
    if (x.sp && (x.seq / c) % x.tp) return ["cp", `--sp splits each rank's --seq / --cp = ${x.seq / c} tokens over --tp ${x.tp}: give a --seq that --cp x --tp = ${c * x.tp} divides`];
    const split = [["--pp", x.pp > 1], ["--float8", x.float8 !== "none"],
      ["--offload", x.offload !== "none"], ["--offload-activations", x.offload_activations],
      ["--optimizer-in-backward", x.optimizer_in_backward], [`--method ${x.method}`, x.method !== "full"],
      [`--checkpointing ${x.checkpointing}`, x.checkpointing !== "none" && x.checkpointing !== "full"],
      [`--task ${x.task}`, x.task !== "train"]].filter((f) => f[1]).map((f) => f[0]);
    if (split.length) return ["cp", `--cp ${c} with ${split.join(" and ")} is not traced together (Lab 13): leave one out`];
    return null;
  }

  /** TrainingRun.check_sharding: [the field, the message] of the first rule broken, or null. */
  function sharding(x) {
    if (x.zero_stage && x.dp * (x.cp || 1) === 1) return ["zero_stage", `--zero-stage ${x.zero_stage} shards over data-parallel ranks: give --dp N (N > 1)`];
    if (x.offload === "params" && x.zero_stage !== 3) return ["offload", "--offload params keeps FSDP2's parameter shards on the host: it needs --zero-stage 3"];
    if (x.offload === "optimizer" && (x.optimizer === "sgd" || x.optimizer === "adamw8bit")) {
      return ["offload", "--offload optimizer runs PyTorch's AdamW on the host: choose adamw, adamw-foreach or adamw-fused"];
    }
    if (x.optimizer === "adamw8bit" && x.zero_stage) return ["optimizer", "--optimizer adamw8bit is traced on whole tensors: leave --zero-stage at 0"];
    if (x.method !== "full" && (x.dp > 1 || x.offload !== "none")) {
      return ["method", `--method ${x.method} is traced on one GPU (Lab 15): leave --dp at 1 and --offload at none`];
    }
    if (x.sp && x.tp === 1) return ["sp", "--sp splits the sequence over the tensor-parallel ranks: give --tp N (N > 1)"];
    if (x.sp && x.seq % x.tp) return ["sp", `--sp splits --seq ${x.seq} over --tp ${x.tp} ranks: give a multiple of ${x.tp}`];
    if (x.tp * x.pp * x.dp > D.constants.max_ranks) {
      return ["tp", `--tp ${x.tp} x --pp ${x.pp} x --dp ${x.dp} is ${(x.tp * x.pp * x.dp).toLocaleString("en-US")} GPUs: more than ${D.constants.max_ranks.toLocaleString("en-US")}`];
    }
    if (x.replicate > 1 && (x.zero_stage < 2 || x.dp % x.replicate || x.dp === x.replicate)) {
      return ["replicate", `--replicate ${x.replicate} is HSDP: it needs --zero-stage 2 or 3 and a --dp it divides into groups of two or more, got --dp ${x.dp}`];
    }
    const ring = context(x);
    if (ring) return ring;
    if (x.pp > x.accumulation) return ["pp", `--pp ${x.pp} needs --accumulation ${x.pp} or more: 1F1B keeps a micro-batch in flight per stage (PyTorch's Schedule1F1B refuses fewer)`];
    for (const [name, flag, bad] of [["loss", "--loss chunked or fused-linear", x.loss !== "full"], ["offload", "--offload", x.offload !== "none"]]) {
      if (bad && x.pp > 1) return [name, `${flag} with --pp is not traced: the trace is the first stage's (no loss; its own optimizer on the device)`];
    }
    for (const [name, flag, bad] of [["zero_stage", "--zero-stage 1", x.zero_stage === 1], ["offload", "--offload", x.offload !== "none"],
      ["loss", "--loss chunked or fused-linear", x.loss !== "full"]]) {
      if (bad && x.tp > 1) return [name, `${flag} with --tp is not traced (Lab 13): the optimizer or the loss would bypass the split weights`];
    }
    if (units(x) && (x.zero_stage < 2 || x.offload === "params" || x.pp > 1)) {
      return ["fsdp_units", `--fsdp-units ${x.fsdp_units} makes FSDP2 units: it needs --zero-stage 2 or 3, and is not traced with --offload params or --pp`];
    }
    if (x.offload_activations && x.zero_stage >= 2) {
      return ["offload_activations", `--offload-activations with --zero-stage ${x.zero_stage}: FSDP2's gathered weights would be offloaded with the activations; traced with --zero-stage 0 or 1`];
    }
    if (x.optimizer_in_backward && (x.accumulation > 1 || x.zero_stage || x.offload !== "none")) {
      return ["optimizer_in_backward", "--optimizer-in-backward steps and frees each gradient as backward makes it: no --accumulation (nothing left to add the next micro-batch to), --zero-stage (its step waits for every gradient's reduce-scatter) or --offload"];
    }
    if (["every-k", "every-kth-block", "save-alternate-matmuls"].includes(x.checkpointing) && (x.tp > 1 || x.pp > 1)) {
      return ["checkpointing", `--checkpointing ${x.checkpointing} with --tp or --pp is not traced together (Lab 13)`];
    }
    for (const [name, lever, on] of [["optimizer_in_backward", "--optimizer-in-backward", x.optimizer_in_backward],
      ["offload_activations", "--offload-activations", x.offload_activations]]) {
      if (on && (x.tp > 1 || x.pp > 1 || x.float8 !== "none")) return [name, `${lever} with --tp, --pp or --float8 is not traced together (Lab 13): leave one out`];
    }
    for (const [lever, on] of [["--optimizer-in-backward", x.optimizer_in_backward], ["--offload-activations", x.offload_activations],
      [`--checkpointing ${x.checkpointing}`, ["every-k", "every-kth-block", "save-alternate-matmuls"].includes(x.checkpointing)]]) {
      if (on && x.method !== "full") return ["method", `${lever} with --method ${x.method} is not traced together (Lab 13 traces it with every weight trained): leave one out`];
    }
    if (x.float8 !== "none" && x.precision === "fp32") return ["float8", `--float8 ${x.float8} casts bf16 activations, as torchao trains: --precision mixed or bf16`];
    if (x.float8 === "tensorwise-all-gather" && (x.zero_stage < 2 || x.offload === "params" || x.replicate > 1)) {
      return ["float8", "--float8 tensorwise-all-gather casts FSDP2's shards to float8 before their all-gather: it needs --zero-stage 2 or 3, and is not traced with --offload params or --replicate"];
    }
    if (x.float8 === "tensorwise-all-gather" && x.tp > 1) return ["float8", "--float8 tensorwise-all-gather with --tp is not traced (Lab 13): FSDP2's float8 gather of split weights is not built; --float8 tensorwise traces torchao's float8 TP styles"];
    if (x.float8 !== "none" && x.checkpointing !== "none" && x.checkpointing !== "full") {
      return ["float8", `--float8 ${x.float8} with --checkpointing ${x.checkpointing}: ` + (!x.checkpointing.startsWith("every")
        ? "save-matmuls and save-alternate-matmuls save aten.mm outputs, not float8's _scaled_mm" : "not traced together") + ": none or full"];
    }
    return null;
  }

  /** Python: fit_table.command. [the command that traces x on the GPU, null], or [null, why no lab's
      command can] (an input that CLI has no flag for); the flags are the labs' own (calculator.json). */
  function command(x, gpu) {
    const custom = x.model === "custom" || DIMS.some((k) => x[k] !== null && x[k] !== undefined);
    const c = D.clis[x.task === "serve" ? "serve" : "fit"], script = c.script.split("/").pop();
    if (custom) {
      return [null, `${script} takes a zoo model or a config.json's path (--model PATH), not dimensions: save them as a config.json to trace them`];
    }
    let values;
    if (x.task === "serve") {
      const p = D.presets[x.model];
      if (p.family === "gpt") return [null, `${script} serves the Llama-family models, not ${x.model}`];
      if (x.precision === "fp32") return [null, `${script} serves bf16 weights: it has no --precision fp32`];
      if (!c.gpus.includes(gpu)) return [null, `${script} sizes a budget for ${c.gpus.join(", ")}: not ${gpu}`];
      if (x.context > p.context) return [null, `${script} serves at most ${x.model}'s context of ${p.context} tokens`];
      values = { model: x.model, gpu, tp: x.tp, gpu_memory_utilization: x.gpu_memory_utilization, weights: x.weights,
        kv_dtype: x.kv_dtype,
        block_size: x.block_size, prefill_chunk: x.prefill_chunk, seq_len: x.context === p.context ? null : x.context };
    } else {
      if (x.tp > 1 && x.task !== "train") return [null, `${script} traces tensor parallelism for training: --task ${x.task} splits over GPUs in Lab 14`];
      if (x.tp > 1 && D.presets[x.model].family !== "llama") return [null, `${script} splits a zoo Llama's modules under --tp, not ${x.model}'s`];
      let y = x.task === "decode" ? x : Object.assign({}, x, { kv_len: null, new_tokens: 1 });
      if (x.task === "infer" || x.task === "decode") {  // what a prefill or decode does not use: left out (fit.py refuses it)
        y = Object.assign({}, y, { accumulation: 1, optimizer: "adamw", checkpointing: "none", checkpoint_every: null, optimizer_in_backward: false, offload_activations: false, loss: "full", method: "full", float8: "none",
          zero_stage: x.zero_stage === 1 || x.zero_stage === 2 ? 0 : x.zero_stage,
          offload: x.offload === "optimizer" ? "none" : x.offload });
        const broken = sharding(y);
        if (broken) return [null, `${script}: ${broken[1]}`];
      }
      values = Object.assign({}, y, { gpu });
    }
    const args = [D.python, c.script];
    for (const [name, flag, byDefault] of c.flags) {
      const v = values[name];
      if (v !== null && v !== undefined && String(v) !== String(byDefault)) args.push(...(v === true ? [flag] : [flag, String(v)]));
      if (name === "model") args.push(...c.fixed);
    }
    return [args.join(" "), null];
  }

  // ---------------------------------------------------------------------------- the formulas (fit_formula.py)
  function sizes(x) {
    let s = rankSpec(spec(x), x.tp);
    if (x.pp > 1) s = Object.assign({}, s, { layers: Math.ceil(s.layers / x.pp) });  // 1F1B's first stage
    let P = paramCount(s);
    const block = paramCount(Object.assign({}, s, { layers: 2 })) - paramCount(Object.assign({}, s, { layers: 1 }));
    const gpt = s.family === "gpt";
    const L = BigInt(s.layers), E = BigInt(s.experts);
    let nt = gpt ? 12n * L + 4n : L * (9n + (s.experts ? 3n * E - 2n : 0n)) + 2n + (s.tied ? 0n : 1n);
    if (x.pp > 1) {  // no final norm, no head
      P -= BigInt(s.width) + (s.tied ? 0n : BigInt(s.vocab) * BigInt(s.width));
      nt -= 1n + (s.tied ? 0n : 1n);
    }
    let Pt = P, trained = tensors(s);
    const R = BigInt(x.lora_rank);
    if (loraStep(x)) {  // adapters A (R x in) and B (out x R) on each targeted projection of every block
      const shapes = loraShapes(s, x.lora_targets);
      Pt = L * shapes.reduce((a, t) => a + R * BigInt(t[1] + t[2]), 0n);
      nt = L * 2n * BigInt(shapes.length);
      trained = shapes.map((t) => [R * BigInt(t[1]), L]).concat(shapes.map((t) => [R * BigInt(t[2]), L]));
    }
    const cd = (a, b) => (a + b - 1n) / b;
    let nf4 = [0n, 0n, 0n, 0n], opt8 = [0n, 0n, 0n, 0n];
    if (loraStep(x) && x.method === "qlora") {  // every linear of the blocks in NF4
      const [b1, b2] = K().nf4_blocks.map(BigInt);
      const weights = blockLinears(s).map(([i, o]) => [BigInt(i) * BigInt(o), L]);
      const blocks = weights.map(([v, k]) => [cd(v, b1), k]);
      nf4 = [weights.reduce((a, [v, k]) => a + cd(v, 2n) * k, 0n), blocks.reduce((a, [v, k]) => a + v * k, 0n),
        blocks.reduce((a, [v, k]) => a + cd(v, b2) * k, 0n), weights.reduce((a, [, k]) => a + k, 0n)];
    }
    if (x.optimizer === "adamw8bit" && x.task === "train") {  // Lab 15's state_bytes, tensor by tensor
      const o8 = K().opt8, min = BigInt(o8.min_8bit), blk = BigInt(o8.block);
      const big = trained.filter(([v]) => v >= min);
      const most = trained.reduce((a, [v]) => (v > a ? v : a), 0n), chunk = BigInt(o8.chunk);
      opt8 = [big.reduce((a, [v, k]) => a + v * k, 0n), big.reduce((a, [v, k]) => a + cd(v, blk) * k, 0n),
        trained.filter(([v]) => v < min).reduce((a, [v, k]) => a + v * k, 0n), most < chunk ? most : chunk];
    }
    return { spec: s, P, Pt, n: nt, block, root: P - L * block, matmuls: L * (block - (gpt ? 13n : 2n) * BigInt(s.width)), nf4, opt8 };
  }

  const loraStep = (x) => x.method !== "full" && x.task === "train";

  /** fit_formula.block_linears: [in, out] of every linear of one block. */
  function blockLinears(s) {
    const h = s.width, q = s.heads * s.head_dim, g = s.kv_heads * s.head_dim, e = Math.max(s.experts, 1);
    const out = [[h, q], [h, g], [h, g], [q, h]];
    for (let i = 0; i < e; i++) out.push([h, s.ffn], [h, s.ffn], [s.ffn, h]);
    if (s.experts) out.push([h, s.experts]);
    return out;
  }

  /** fit_formula.tensors: every parameter tensor as [values, how many] (BigInt). */
  function tensors(s) {
    const h = BigInt(s.width), V = BigInt(s.vocab), L = BigInt(s.layers);
    if (s.family === "gpt") {
      const per = [h, h, 3n * h * h, 3n * h, h * h, h, h, h, 4n * h * h, 4n * h, 4n * h * h, h];
      return [[V * h, 1n], [BigInt(s.context) * h, 1n], [h, 2n]].concat(per.map((v) => [v, L]));
    }
    const per = [h, h].concat(blockLinears(s).map(([i, o]) => BigInt(i) * BigInt(o)));
    return [[V * h, s.tied ? 1n : 2n], [h, 1n]].concat(per.map((v) => [v, L]));
  }

  // Mixed under FSDP2 (ZeRO-2/3), as Lab 13 traces it: MixedPrecisionPolicy (bf16 gathers, fp32 reduction), no autocast.
  const units = (x) => x.fsdp_units === "blocks-embed-head";  // Python: x.fsdp_units != "blocks"
  const fsdpMixed = (x) => x.precision === "mixed" && x.zero_stage >= 2 && x.task !== "serve";

  function symbols(x, z) {
    const s = z.spec, [recipe, c0, r0] = D.constants.precisions[x.precision];
    const r = fsdpMixed(x) || loraStep(x) ? c0 : r0;  // bf16 weights (FSDP2's gathers, a LoRA's base): a bf16 stream
    const w = x.task !== "serve" ? D.constants.recipes[recipe].param : (x.precision === "fp32" ? 4 : 2);
    const p = Math.min(x.prefill_chunk || x.context, x.context);
    const q = s.heads * s.head_dim, g = s.kv_heads * s.head_dim, E = Math.max(s.experts, 1);  // the matrices --weights stores
    const v = { L: s.layers, h: s.width, a: s.heads, k: s.kv_heads, d: s.head_dim, q: s.heads * s.head_dim,
      g: s.kv_heads * s.head_dim, f: s.ffn, V: s.vocab, E: s.experts, K: s.top_k, s: x.seq / (x.cp || 1), T: x.batch * x.seq / (x.cp || 1),
      P: z.P, Pt: z.Pt, Pb: z.block, Pr: z.root, Pm: z.matmuls, n: z.n, R: x.lora_rank, dp: x.dp / x.replicate * (x.cp || 1), w,
      m: D.constants.recipes[recipe].moment, c: x.task !== "serve" ? c0 : w, r, N: x.requests, C: x.context,
      B: x.block_size, e: D.constants.kv_dtypes[x.kv_dtype][0], p,
      Pq: 2 * s.width * (q + g) + 3 * s.width * s.ffn * E, nq: 4 + 3 * E,
      so: q + 2 * g + s.width + (2 * s.ffn + s.width) * E, si: 3 * s.width + q + (2 * s.width + s.ffn) * E,
      u: Math.ceil((x.batch * x.seq / (x.cp || 1)) / D.constants.loss_chunks), b: x.batch, D: x.kv_len || x.seq, j: x.new_tokens,
      G: x.checkpoint_every || 1, t: x.tp, pp: x.pp,
      wb: D.constants.frozen[x.precision], Pc: z.nf4[0], Nb: z.nf4[1], Ns: z.nf4[2], Nq: z.nf4[3], Pk: z.opt8[0],
      Nk: z.opt8[1], Ps: z.opt8[2], Cw: z.opt8[3] };
    const S = {};
    for (const k of Object.keys(v)) S[k] = sym(k, v[k]);
    if (x.method === "full") S.Pt = S.P;  // every weight is trained: the formulas say P
    S.f8tp = x.float8 === "tensorwise" && x.tp > 1;  // torchao's float8 TP styles (float8Layer)
    return S;
  }

  const K = () => D.constants;

  function norm(S, readers, sp) {
    const kept = S.c.value === S.r.value ? S.c.mul(S.h) : n(readers).mul(S.c).mul(S.h);
    return sp ? kept : own(S).add(kept);
  }

  const own = (S) => n(4).mul(S.h).add(K().row).add(S.r.mul(S.h));  // an RMSNorm's own tensors per token

  /** Python: fit_moments.experts: per token, what a MoE block's MLP keeps past its norm. */
  function experts(S) {
    const rows = S.r.mul(S.h).add(S.c.value === S.r.value ? S.c.mul(S.h) : n(2).mul(S.c).mul(S.h))
      .add(S.c.mul(S.h)).add(K().slot);
    return S.c.add(4).mul(S.E).add(S.K.mul(n(4).mul(S.c).mul(S.f).add(rows)));
  }

  function layer(S, checkpointing, sp) {
    const moe = S.E.value > 0n;
    if (checkpointing === "none" && S.f8tp) return float8Layer(S, sp);  // float8 copies of the linears' inputs
    const stream = (sp ? ceilDiv(S.T, S.t) : S.T).mul(S.r).mul(S.h);  // the block's input (every-k: a segment's)
    if (checkpointing === "full" || checkpointing === "every-k") return stream;
    let kept;
    if (checkpointing === "save-matmuls") {
      const mlp = moe ? S.K.mul(S.c).mul(n(2).mul(S.f).add(S.h)).add(S.c.mul(S.E)) : S.c.mul(n(2).mul(S.f).add(S.h));
      kept = S.c.mul(n(2).mul(S.q).add(n(2).mul(S.g)).add(S.h)).add(n(K().lse).mul(S.a)).add(mlp);
    } else if (checkpointing === "save-alternate-matmuls") {
      const mlp = moe ? S.c.mul(S.E).add(S.K.mul(S.c).mul(S.f)).add(ceilDiv(S.K.mul(S.c).mul(S.h), n(2)))
        : S.c.mul(S.f.add(S.h));
      kept = S.c.mul(n(2).mul(S.q).add(S.g)).add(n(K().lse).mul(S.a)).add(mlp);
    } else {
      const attention = norm(S, 3, sp).add(S.c.mul(n(2).mul(S.q).add(n(2).mul(S.g)))).add(n(K().lse).mul(S.a));
      let mlp;
      if (moe) {
        mlp = norm(S, 1).add(experts(S));
      } else {
        mlp = norm(S, 2, sp).add(n(4).mul(S.c).mul(S.f));
      }
      kept = attention.add(mlp);
    }
    if (checkpointing.startsWith("save")) return S.T.mul(kept).add(stream);  // the input: --sp, T / t tokens
    kept = S.T.mul(kept).add(n(2).mul(S.s).mul(S.d).mul(S.r));
    return sp ? kept.add(ceilDiv(S.T, S.t).mul(n(2)).mul(own(S))) : kept;
  }

  /** Python: fit_compiled.layer (--compile): what the partitioner saves of a block, nothing checkpointed. */
  function compiledLayer(S) {
    const tokens = S.r.mul(S.h).add(2 * K().row).add(n(3).mul(S.c).mul(S.h)).add(S.c.mul(n(2).mul(S.q).add(n(2).mul(S.g))))
      .add(n(K().lse).mul(S.a)).add(n(3).mul(S.c).mul(S.f));
    return S.T.mul(tokens).add(n(4).mul(S.s).mul(S.d));
  }

  /** Python: fit_compiled.saved: a compiled block's, from eager's under the same checkpointing. */
  function compiledSaved(x, S, eager) {
    if (x.checkpointing === "none") return compiledLayer(S);
    return x.checkpointing.startsWith("save") ? eager.sub(S.T.mul(S.c).mul(S.h)) : eager;
  }

  /** Python: fit_compiled.block_backward (--compile, ZeRO-3): a block's backward, at its attention norm's. */
  function compiledBlockBackward(x, S, held, act) {
    if (x.zero_stage < 2 || x.offload !== "none" || S.L.value < 3n) return {};
    const per = compiledSaved(x, S, layer(S, x.checkpointing));
    const shard = S.w.mul(ceilDiv(S.Pb, S.dp));
    const u = units(x), fused = x.loss === "fused-linear";
    const head = u ? ZERO : S.c.mul(S.V).mul(S.h);  // the head's gradient (fused-linear: made in forward; its own unit: reduced)
    const own = u ? S.w.mul(ceilDiv(S.Pr.sub(S.V.mul(S.h)), S.dp)) : ZERO;  // the head unit's shard
    let work = total(S.c.mul(S.Pb), S.T.mul(n(16).mul(S.h).add(n(2).mul(S.c).mul(S.h))));
    if (x.checkpointing === "full") work = larger(work, compiledRecomputedMlp(S));  // or the recomputed MLP's backward
    const out = {};
    const end = x.zero_stage === 3 ? "block_backward" : "recomputed_backward";  // (ZeRO-2: every block not done gathered)
    const ends = u ? [[end, S.L, 0], ["recomputed_front", 1, S.L.sub(1)]] : [[end, S.L.sub(1), 1], ["recomputed_front", n(2), S.L.sub(2)]];
    if (u && x.zero_stage === 3) ends.push(["second_block_backward", S.L.sub(1), 1]);  // its own unit's shard and the last's out
    for (const [moment, blocks, done] of ends) {
      const shards = done === 0 ? ZERO : done === 1 ? shard : done.mul(shard);
      const grads = x.accumulation > 1 ? held.gradients : total(own, shards);
      const kept = blocks === 1 ? per : blocks.mul(per);
      out[moment] = Object.assign({}, held, { gradients: grads, activations: fused ? total(kept, head) : kept,
        temporaries: fused ? work : total(head, work) });
    }
    if (u && x.zero_stage === 3) {  // before the blocks: the head unit's reduce-scatter, as eager's (blockBackward)
      out.head_reduced = Object.assign({}, held, { gradients: x.accumulation > 1 ? held.gradients : own,
        activations: act.kept.sub(act.loss).sub(S.T.mul(norm(S, 1))), temporaries: S.c.mul(S.V).mul(S.h).add(S.T.mul(S.c).mul(S.h)) });
    }
    return out;
  }

  /** Python: fit_compiled.recomputed_mlp: a compiled block checkpointed whole, at its recomputed MLP's backward
      (the larger of two points). */
  function compiledRecomputedMlp(S) {
    const wide = S.c.value < 4n ? n(8).mul(S.h).add(n(5).mul(S.c).mul(S.h)) : n(6).mul(S.c).mul(S.h);
    const stream = wide.add(n(2).mul(S.c).mul(S.q)).add(n(2).mul(S.c).mul(S.g)).add(n(K().lse).mul(S.a)).add(2 * K().row);
    const first = total(n(5).mul(S.T).mul(S.c).mul(S.f), S.T.mul(stream), n(2).mul(S.s).mul(S.d).mul(S.c), S.c.mul(S.f).mul(S.h));
    const second = total(n(3).mul(S.T).mul(S.c).mul(S.f), S.T.mul(stream.add(S.c.mul(S.h))), n(2).mul(S.s).mul(S.d).mul(S.c),
      n(2).mul(S.c).mul(S.f).mul(S.h));
    return larger(first, second);
  }

  /** Python: fit_compiled.moments: a compiled block's backward; on one GPU, the embedding's. */
  function compiledMoments(x, S, held, state, act) {
    const out = compiledBlockBackward(x, S, held, act);
    if (x.dp === 1 && x.accumulation === 1 && x.offload === "none") {
      out.embedding_backward = Object.assign({}, state, { temporaries: S.T.mul(S.r).mul(S.h) });
    }
    return out;
  }

  /** Python: fit_split.float8_layer (--float8 tensorwise --tp): a block under torchao's float8 TP styles. */
  function float8Layer(S, sp) {
    const norms = (sp ? ceilDiv(S.T, S.t) : S.T).mul(n(2)).mul(own(S));
    const attention = S.h.add(S.c.mul(n(2).mul(S.q).add(n(2).mul(S.g)))).add(n(K().lse).mul(S.a)).add(S.q);
    const mlp = S.h.add(n(3).mul(S.c).mul(S.f)).add(S.f);
    return S.T.mul(attention.add(mlp)).add(n(2).mul(S.s).mul(S.d).mul(S.c)).add(n(4 * K().scale)).add(norms);
  }

  /** Python: fit_split.float8_mlp: what a block's MLP and its norm keep under the float8 TP styles. */
  function float8Mlp(S, sp) {
    return S.T.mul(S.h.add(n(3).mul(S.c).mul(S.f)).add(S.f)).add((sp ? ceilDiv(S.T, S.t) : S.T).mul(own(S)));
  }

  /** fit_lora.lora_layer: one block under LoRA (PEFT's order of operations). */
  function loraLayer(S, x, checkpointing = x.checkpointing) {
    const targets = new Set(x.lora_targets), mixed = x.precision === "mixed";
    const outputs = n(targets.size).mul(S.c).mul(S.R);
    if (checkpointing === "full") return layer(S, "full");
    if (checkpointing === "save-matmuls") {
      const out = { q: S.q, k: S.g, v: S.g, o: S.h, gate: S.f, up: S.f, down: S.h };
      return layer(S, "save-matmuls").add(S.T.mul(outputs.add(S.c.mul(total(...D.lora_targets.filter((t) => targets.has(t)).map((t) => out[t]))))));
    }
    const reads = [["q", "k", "v"], ["gate", "up"]].map((ts) => ts.filter((t) => targets.has(t)).length);
    let inputs = reads.filter((k) => k).map((k) => n(mixed ? k : Math.min(k, 1)).mul(S.c).mul(S.h));
    if (mixed && targets.has("o")) inputs.push(S.c.mul(S.q));
    if (targets.has("down")) inputs.push(S.c.mul(S.f));
    const kept = n(2).mul(n(4).mul(S.h).add(K().row)).add(S.c.mul(n(2).mul(S.q).add(n(2).mul(S.g)))).add(n(K().lse).mul(S.a))
      .add(n(3).mul(S.c).mul(S.f)).add(outputs);
    return S.T.mul(inputs.length ? kept.add(total(...inputs)) : kept).add(n(2).mul(S.s).mul(S.d).mul(S.r));
  }

  function loraActivations(x, S) {
    const casts = x.precision === "mixed" ? S.c.mul(S.Pt) : ZERO;
    const loss = x.loss === "full" ? n(4).mul(S.T).mul(S.V) : ZERO;  // chunked, fused-linear: the head's input kept
    let kept = S.L.mul(loraLayer(S, x)).add(S.T.mul(n(4).mul(S.h).add(K().row))).add(x.loss === "full" ? loss : S.T.mul(S.c).mul(S.h));
    if (x.checkpointing === "none") kept = kept.sub(S.T.mul(n(4).mul(S.h).add(K().row)));
    if (casts !== ZERO && x.checkpointing === "none") {
      const first = ["q", "k", "v"].filter((t) => x.lora_targets.includes(t)).length;
      kept = kept.add(first ? casts.sub(n(first).mul(S.c).mul(S.R).mul(S.h)) : casts);
    }
    return { kept, cache: x.checkpointing !== "none" ? casts : ZERO, loss };
  }

  /** fit_lora.lora_recomputed: full checkpointing under LoRA, the last block's recomputed MLP's backward. */
  function loraRecomputedMlp(x, S, held) {
    if (!loraStep(x) || !["none", "full"].includes(x.checkpointing) || S.E.value) return {};
    const down = x.lora_targets.includes("down"), none = loraLayer(S, x, "none");
    const fh = S.f.mul(S.h), chunk = K().nf4_blocks[2];  // QLoRA: a linear's NF4 weight read back
    const work = fh.value < BigInt(chunk) ? n(12).mul(fh) : n(12 * chunk);
    const read = total(S.c.mul(fh), n(4).mul(ceilDiv(fh, n(K().nf4_blocks[0]))), work);
    if (x.checkpointing === "none") {  // QLoRA in bf16: the last block's down projection read back in forward
      if (x.method !== "qlora" || x.precision !== "bf16") return {};
      let kept = S.L.mul(none).sub(S.T.mul(n(4).mul(S.h).add(K().row)));
      if (down) kept = kept.sub(S.T.mul(S.c).mul(S.R));
      return { lora_dequantized: Object.assign({}, held, { activations: kept, temporaries: n(3).mul(S.T).mul(S.c).mul(S.h),
        dequantized: read }) };
    }
    const block = none.sub(S.T.mul(S.c).mul(S.f)).sub(down ? S.T.mul(S.c).mul(S.R) : ZERO);
    const grads = held.gradients !== ZERO ? held.gradients : down ? S.w.mul(S.R).mul(S.f.add(S.h)) : ZERO;
    const out = { lora_recomputed: Object.assign({}, held, { gradients: grads, activations: S.L.mul(S.T).mul(S.r).mul(S.h),
      temporaries: block.add(S.T.mul(S.c).mul(S.h)).add(n(down ? 3 : 1).mul(S.T).mul(S.c).mul(S.f)) }) };
    if (x.precision === "mixed" && down) {  // the recompute's down adapter: its fp32 and bf16 casts of the product
      out.lora_recompute_down = Object.assign({}, held, { activations: S.L.mul(S.T).mul(S.r).mul(S.h), temporaries: total(
        none, ceilDiv(S.c.mul(S.Pt), S.L), n(5).mul(S.T).mul(S.c).mul(S.h), S.T.mul(S.c).mul(S.f), n(4).mul(S.T).mul(S.f)) });
    }
    if (x.method === "qlora" && (x.precision === "bf16" || down)) {  // the recompute's down projection read back
      let alive = none.add(n(3).mul(S.T).mul(S.c).mul(S.h));
      if (down) alive = alive.sub(S.T.mul(S.c).mul(S.R));
      if (x.precision === "mixed") {  // the product for its bf16 cast, not down's weights cast; the others', the MLP norm's output
        alive = total(alive, ceilDiv(S.c.mul(S.Pt), S.L), S.T.mul(S.c).mul(S.h)).sub(S.c.mul(S.R).mul(S.f.add(S.h)));
      }
      out.lora_dequantized = Object.assign({}, held, { activations: S.L.mul(S.T).mul(S.r).mul(S.h), temporaries: alive,
        dequantized: read });
    }
    return out;
  }

  function gptLayer(S, checkpointing) {
    if (checkpointing === "full" || checkpointing === "every-k") return S.c.mul(S.T).mul(S.h);
    const kept = n(16).mul(S.c).mul(S.T).mul(S.h);
    return checkpointing === "save-matmuls" ? kept : kept.add(S.c.mul(S.a).mul(S.s).mul(S.T));
  }

  function activations(x, S, family) {
    if (loraStep(x)) return loraActivations(x, S);
    const mixed = x.precision === "mixed" && !fsdpMixed(x);  // autocast's casts; FSDP2 gathers bf16 weights instead
    let per = family === "gpt" ? gptLayer(S, x.checkpointing) : layer(S, x.checkpointing, x.sp);
    if (x.compile) per = compiledSaved(x, S, per);  // the partitioner's saved set
    const head = mixed ? S.c.mul(S.V).mul(S.h) : ZERO;
    const casts = mixed && x.float8 === "none" ? S.c.mul(S.Pm) : ZERO;  // a float8 linear saves its weight, not a cast
    let blocks = x.checkpointing === "every-k" ? ceilDiv(S.L, S.G).mul(per) : S.L.mul(per);
    if (x.checkpointing === "every-kth-block") blocks = kthKept(S, layer(S, "none", false), layer(S, "full", false), mixed);
    if (x.offload_activations) blocks = offloaded(x, S, per, mixed);
    let kept = blocks.add(S.T.mul(norm(S, 1, x.sp).add(n(4).mul(S.V))));
    if (x.sp) kept = kept.add(ceilDiv(S.T, S.t).mul(own(S)));
    if (x.loss !== "full") kept = blocks.add(S.T.mul(n(4).mul(S.h).add(K().row).add(n(2).mul(S.r).mul(S.h))));
    if (mixed && x.loss === "full") kept = kept.add(head);
    if (mixed && x.checkpointing === "none" && !x.offload_activations) kept = kept.add(casts);
    const loss = n(4).mul(S.T).mul(S.V);
    let cache = mixed && x.checkpointing !== "none" && !x.compile ? casts : ZERO;  // a compiled block frees its own
    if (mixed && x.checkpointing === "every-kth-block" && !x.compile) cache = checkpointed(S).mul(ceilDiv(S.c.mul(S.Pm), S.L));
    if (mixed && x.checkpointing === "none" && x.offload_activations) cache = casts.sub(S.c.mul(S.f).mul(S.h));
    return { kept, cache,
      loss: x.loss !== "full" ? ZERO : (mixed ? loss.add(head) : loss), autocast: mixed };
  }

  /** Python: fit_formula.offloaded (--offload-activations): what the blocks keep on the device. */
  function offloaded(x, S, per, mixed) {
    if (x.checkpointing === "none") {
      return mixed ? S.T.mul(S.c).mul(S.f).add(S.c.mul(S.f).mul(S.h)) : n(2).mul(S.T).mul(S.c).mul(S.f);
    }
    const inputs = x.checkpointing === "every-k" ? ceilDiv(S.L, S.G) : S.L;
    if (x.checkpointing === "full" || x.checkpointing === "every-k") {
      return inputs.value >= 2n ? n(2).mul(S.T).mul(S.r).mul(S.h) : S.T.mul(S.r).mul(S.h);
    }
    return S.L.mul(per).sub(S.L.sub(n(2)).mul(S.T).mul(S.r).mul(S.h));
  }

  /** Python: fit_formula.chunked_loss (--loss chunked and fused-linear, Lab 13's fit_loss.py). */
  function chunkedLoss(x, S, held, act) {
    const cast = act.autocast ? S.c.mul(S.V).mul(S.h) : ZERO;
    const wide = act.autocast ? S.c.mul(S.u).mul(S.h) : ZERO;
    const pending = S.T.sub(S.u).mul(S.r).mul(S.h);
    const frame = S.r.value < 4n ? S.T.mul(S.r).mul(S.h) : ZERO;
    if (x.loss === "fused-linear") {
      const logits = S.c.value < 4n ? n(4).mul(S.u).mul(S.V).add(S.c.mul(S.u).mul(S.V)) : n(4).mul(S.u).mul(S.V);
      const step = total(act.cache, cast, S.T.mul(S.r).mul(S.h), logits, loraStep(x) ? ZERO : S.c.mul(S.V).mul(S.h), wide, frame);
      const head = loraStep(x) ? ZERO : (fsdpMixed(x) ? S.c : S.w).mul(S.V).mul(S.h);  // none: LoRA's frozen head
      return { forward_end: Object.assign({}, held, { gradients: total(held.gradients, head), activations: act.kept,
        temporaries: step }) };
    }
    const logits = S.c.value < 4n ? S.c.add(8).mul(S.u).mul(S.V) : n(8).mul(S.u).mul(S.V);
    const several = S.T.value > S.u.value && !loraStep(x);  // LoRA's frozen head: no weight gradient to sum
    const buffer = several ? S.c.mul(S.V).mul(S.h) : ZERO;
    let headGradient;
    if (act.autocast) headGradient = total(pending, S.c.mul(S.u).mul(S.V), cast, buffer, n(2).mul(wide), S.c.mul(S.V).mul(S.h));
    else if (several) headGradient = total(pending, n(3).mul(S.c).mul(S.V).mul(S.h));
    else headGradient = S.c.mul(S.u).mul(S.V).add(S.c.mul(S.u).mul(S.h)).add(S.c.mul(S.V).mul(S.h));
    const out = {
      forward_end: Object.assign({}, held, { activations: act.kept, temporaries: total(act.cache, cast, logits, frame) }),
      backward_start: Object.assign({}, held, { activations: act.kept,
        temporaries: total(pending, n(12).mul(S.u).mul(S.V), cast, buffer, wide) }),
    };
    if (!loraStep(x)) out.head_gradient = Object.assign({}, held, { activations: act.kept, temporaries: headGradient });
    return out;
  }

  function modelState(x, S) {
    const shards = K().zero_shards;
    const share = (what, count, stage) => ((stage === undefined ? x.zero_stage : stage) >= shards[what] ? ceilDiv(count, S.dp) : count);
    const kind = K().optimizers[x.optimizer];
    const fsdp = x.zero_stage === 2 ? 3 : x.zero_stage;
    let state = n(K().moments[kind]).mul(S.m).mul(share("optimizer_state", S.Pt));
    if (kind === "adamw") state = state.add(n(K().step_counter).mul(S.n));
    if (x.optimizer === "adamw8bit") state = n(2).mul(S.Pk).add(n(8).mul(S.Nk)).add(n(8).mul(S.Ps));
    const out = { parameters: S.w.mul(share("parameters", S.Pt, fsdp)), gradients: S.w.mul(share("gradients", S.Pt)),
      optimizer_state: state };
    if (loraStep(x)) {  // the frozen base beside the adapters (QLoRA: the blocks' linears in NF4)
      out.frozen_weights = x.method === "lora" ? S.wb.mul(S.P) : S.wb.mul(S.P.sub(S.Pm)).add(S.Pc);
      if (x.method === "qlora") out.quant_constants = S.Nb.add(n(4).mul(S.Ns)).add(n(4).mul(S.Nq));
    }
    if (x.offload === "params") return { parameters: ZERO, gradients: ZERO, optimizer_state: ZERO };  // (no LoRA here)
    if (x.offload === "optimizer") {
      out.optimizer_state = ZERO;
      out.gradients = x.zero_stage ? out.gradients : ZERO;
    }
    return out;
  }

  function communication(x, S) {
    let fwd = ZERO, bwd = ZERO, gather = ZERO, opt = ZERO;
    const weights = S.P;
    const gathered = fsdpMixed(x) ? S.c : S.w;  // MixedPrecisionPolicy gathers bf16 weights
    if (x.dp > 1 && x.zero_stage <= 1) {
      fwd = bwd = gather = opt = S.w.mul(S.Pt);
    } else if (x.zero_stage === 2) {
      fwd = gathered.mul(weights.add(S.Pb)); bwd = gathered.mul(weights);
    } else if (x.zero_stage === 3) {
      fwd = bwd = gathered.mul(S.Pr.add(S.Pb));
      gather = n(2).mul(gathered).mul(S.Pr);
    }
    let end = fsdpMixed(x) ? S.w.mul(S.Pr) : ZERO;  // the root's fp32 reduce-scatter input; its bf16 weights resharded
    if (x.offload === "params") {
      const sh = n(2).mul(S.w).mul(ceilDiv(ceilDiv(S.P, S.L), S.dp));
      [fwd, bwd, gather, opt, end] = [fwd, bwd, gather, opt, end].map((e) => (e === ZERO ? sh : e.add(sh)));
    }
    const out = { forward_end: fwd, backward_start: bwd, head_gradient: bwd, root_gathered: gather, optimizer: opt,
      backward_end: end, embedding_gradient: opt, pipeline_backward: bwd, pipeline_product: bwd, pipeline_norm: bwd,
      embedding_backward: bwd, pipeline_forward: fwd, pipeline_cache: fwd, pipeline_recomputed: bwd,
      pipeline_recomputed_product: bwd, pipeline_recompute: bwd, head_step: bwd, segment_backward: bwd,
      recomputed_last: bwd, embedding_rows: gathered.mul(S.Pr).add(S.w.mul(S.Pb)),
      embedding_end: gathered.mul(S.Pr).add(S.w.mul(S.Pb)) };  // --tp, FSDP2: the root gathered, the first block's reduce
    // the root, this block, the next one's gather (ZeRO-2: every block not yet done), the last block's fp32 reduce-scatter
    if (x.zero_stage >= 2) {  // input (kept until the next): a block's backward (blockBackward; recomputedBlock)
      out.recomputed_backward = gathered.mul(S.Pr.add(recomputedBlocks(x, S, "end").mul(S.Pb))).add(S.w.mul(S.Pb));
      out.recomputed_front = gathered.mul(S.Pr.add(recomputedBlocks(x, S, "front").mul(S.Pb))).add(S.w.mul(S.Pb));
      out.recomputed_last = gathered.mul(S.Pr.add(recomputedBlocks(x, S, "last").mul(S.Pb)));  // no reduce-scatter yet
      // ZeRO-2 (float8): the second block's backward, every block gathered but the last
      if (x.zero_stage === 3 || (!units(x) && x.float8 !== "none")) out.block_backward = out.recomputed_backward;
    }
    return float8Gather(x, S, gathered, units(x) ? fsdpUnits(x, S, gathered, out) : out);
  }

  /** Python: fit_moments.float8_gather (--float8 tensorwise-all-gather): each gathered block's linears in 1 byte. */
  function float8Gather(x, S, gathered, comm) {
    if (x.float8 !== "tensorwise-all-gather") return comm;
    const less = gathered.sub(n(1)).mul(ceilDiv(S.Pm, S.L));
    const counts = x.zero_stage === 2
      ? { forward_end: units(x) ? S.L : S.L.add(n(1)), backward_start: S.L, head_gradient: S.L, block_backward: S.L.sub(n(1)) }
      : Object.assign({ backward_start: n(1), head_gradient: n(1), block_backward: n(2), head_reduced: n(1),
        second_block_backward: n(2) }, units(x) ? {} : { forward_end: n(1) });
    for (const at of ["end", "front", "last", "second"]) {
      counts[at === "end" ? "recomputed_backward" : `recomputed_${at}`] = recomputedBlocks(x, S, at);
    }
    if (units(x) && !segmented(x, S)) counts.recomputed_front = n(1);  // the first block's: it and the embedding
    const out = Object.assign({}, comm);
    for (const [k, c] of Object.entries(counts)) if (comm[k]) out[k] = comm[k].sub(c.mul(less));
    return out;
  }

  /** Python: fit_moments.fsdp_units (--fsdp-units blocks-embed-head): the head unit gathered (and, at the end of
   * forward, the buffer it was gathered into); no root gathered again; the embedding's fp32 reduce-scatter input. */
  function fsdpUnits(x, S, gathered, comm) {
    const head = S.Pr.sub(S.V.mul(S.h));
    const [fwd, bwd] = x.zero_stage === 2 ? [gathered.mul(S.P.add(head)), gathered.mul(S.P)]
      : [n(2).mul(gathered).mul(head), gathered.mul(head)];
    // ZeRO-3 with a chunked or fused-linear loss: the head unit's pre-backward, hooked on the loss, prefetches the last block
    const back = x.zero_stage === 3 && x.loss !== "full" ? gathered.mul(head.add(S.Pb)) : bwd;
    const out = Object.assign({}, comm, { forward_end: fwd, backward_start: back, head_gradient: back, root_gathered: ZERO,
      backward_end: comm.backward_end === ZERO ? ZERO : S.w.mul(S.V).mul(S.h) });
    if (comm.recomputed_backward) {
      const embed = x.zero_stage === 2 ? S.V.mul(S.h) : ZERO;  // ZeRO-2: every block and the embedding gathered
      out.recomputed_backward = gathered.mul(total(recomputedBlocks(x, S, "end").mul(S.Pb), embed)).add(S.w.mul(head));
      out.recomputed_front = segmented(x, S)  // the first segment's; the first block's: the embedding's gather
        ? gathered.mul(total(recomputedBlocks(x, S, "front").mul(S.Pb), embed)).add(S.w.mul(S.Pb))
        : gathered.mul(S.Pb.add(S.V.mul(S.h))).add(S.w.mul(S.Pb));
      out.recomputed_second = gathered.mul(total(recomputedBlocks(x, S, "second").mul(S.Pb), embed)).add(S.w.mul(S.Pb));
    }
    if (comm.block_backward) {  // and the second block's: it and the next gathered, the last block's reduce-scatter
      out.block_backward = out.recomputed_backward;
      out.second_block_backward = n(2).mul(gathered).mul(S.Pb).add(S.w.mul(S.Pb));
      out.head_reduced = gathered.mul(S.Pb).add(S.w.mul(head));
    }
    return out;
  }

  // --checkpointing every-k on one rank: the last segment's backward, recomputed whole (fit_formula.segment_backward).
  function segmentBackward(x, S, held, carried, spec) {
    const segments = ceilDiv(S.L, S.G), mixed = x.precision === "mixed";
    const blocks = carried !== ZERO ? S.L.sub(S.G.mul(segments.sub(n(1)))) : S.G;
    const others = spec.tied ? S.Pt.sub(S.G.mul(S.Pb)) : S.Pt.sub(S.V.mul(S.h)).sub(S.G.mul(S.Pb));  // not the embedding's
    const grads = carried !== ZERO ? carried : x.optimizer_in_backward ? ZERO : S.w.mul(others.add(S.f.mul(S.h)));
    const kept = carried !== ZERO ? segments.mul(S.T).mul(S.r).mul(S.h) : x.offload_activations ? ZERO : S.T.mul(S.r).mul(S.h);
    const recomputed = blocks.mul(mixed ? layer(S, "none", false).add(ceilDiv(S.c.mul(S.Pm), S.L)) : layer(S, "none", false));
    return Object.assign({}, held, { gradients: grads, activations: kept, temporaries: recomputed.add(recomputeTail(x, S)) });
  }

  // Python: fit_moments.recompute_last: full checkpointing under autocast without FSDP2, the last block's backward at
  // the end of its recompute: every checkpointed input, the head's and final norm's gradients, the block and its casts,
  // the stream's gradient and a bf16 T x h copy.
  function recomputeLast(x, S, held, carried, spec) {
    if (x.offload_activations || x.optimizer_in_backward || x.precision !== "mixed") return {};
    const head = spec.tied ? S.Pr : S.Pr.sub(S.V.mul(S.h)), stream = S.T.mul(S.r).mul(S.h);
    const work = layer(S, "none", false).add(ceilDiv(S.c.mul(S.Pm), S.L)).add(stream).add(S.T.mul(S.c).mul(S.h));
    return { recomputed_last: Object.assign({}, held, { gradients: carried !== ZERO ? carried : S.w.mul(head),
      activations: S.L.mul(stream), temporaries: work }) };
  }

  // Python: fit_moments.recompute_tail: beside a block recomputed on one rank, at its gate x up product's backward.
  function recomputeTail(x, S) {
    const tail = n(2).mul(S.T).mul(S.c).mul(S.f);
    if (x.precision === "mixed") return tail.add(n(2).mul(S.T).mul(S.c).mul(S.h)).sub(n(4).mul(S.T).mul(S.h)).sub(S.c.mul(S.f).mul(S.h));
    return x.precision === "bf16" ? tail.add(S.T.mul(S.c).mul(S.h)) : tail;
  }

  // Python: fit_kth (--checkpointing every-kth-block): every G-th block keeps its input, the others everything (and,
  // under autocast, their weights' casts); where G divides L, the last block's backward, recomputed beside all they keep.
  const floorDiv = (a, b) => {
    a = lift(a); b = lift(b);
    return new Expr(TEXT ? `⌊${a.text} / ${b.text}⌋` : "", TEXT ? `⌊${a.filled} / ${b.filled}⌋` : "", a.value / b.value, false);
  };
  const checkpointed = (S) => floorDiv(S.L, S.G);
  function kthKept(S, none, fullBlock, mixed) {
    const k = checkpointed(S), plain = mixed ? none.add(ceilDiv(S.c.mul(S.Pm), S.L)) : none;
    return k.mul(fullBlock).add(S.L.sub(k).mul(plain));
  }
  function kthLast(x, S, held, spec) {
    if (S.L.value % S.G.value) return {};
    const none = layer(S, "none", false), fullBlock = layer(S, "full", false);
    if (x.zero_stage < 2) {  // fit_kth.one_rank: the head's, the final norm's and the down projection's gradients alive
      const mixed = x.precision === "mixed", head = spec.tied ? S.Pr : S.Pr.sub(S.V.mul(S.h));
      const grads = x.accumulation > 1 ? held.gradients : S.w.mul(head.add(S.f.mul(S.h)));
      const recomputed = mixed ? none.add(ceilDiv(S.c.mul(S.Pm), S.L)) : none;
      return { recomputed_last: Object.assign({}, held, { gradients: grads, activations: kthKept(S, none, fullBlock, mixed),
        temporaries: recomputed.add(recomputeTail(x, S)) }) };
    }
    const blocks = kthKept(S, none, fullBlock, false), head = S.c.mul(S.V).mul(S.h);
    const fused = x.loss === "fused-linear", work = recomputedMlp(x, S, 1);
    return { recomputed_last: Object.assign({}, held, { gradients: x.accumulation > 1 ? held.gradients : ZERO,
      activations: fused ? blocks.add(head) : blocks, temporaries: fused ? work : work.add(head) }) };
  }

  /** Python: fit_formula.pipeline (--pp, Lab 13's fit_pipeline.py): 1F1B's first stage. */
  function pipeline(x, S, state) {
    const tokens = x.sp ? ceilDiv(S.T, S.t) : S.T;
    const mixed = x.precision === "mixed" && !fsdpMixed(x);
    let micro = S.L.mul(layer(S, x.checkpointing, x.sp)).add(tokens.mul(S.r).mul(S.h));
    if (mixed && x.checkpointing === "none" && x.float8 === "none") micro = micro.add(S.c.mul(S.Pm));
    const temporaries = total(mixed ? S.c.mul(tokens).mul(S.h) : ZERO, S.c.mul(S.T).mul(S.f), S.c.mul(S.f).mul(S.h));
    const grads = x.tp > 1 ? state.gradients.add(S.w.mul(S.t.sub(1)).mul(S.V).mul(S.h)) : state.gradients;
    const held = Object.assign({}, state, { gradients: grads, communication: tokens.mul(S.r).mul(S.h) });
    const plain = x.float8 === "none";  // (float8's backward points are float8Backward's)
    const recomputed = plain && x.checkpointing === "full" && !x.sp;  // the last block recomputed in a steady backward
    const block = recomputed ? lastBlockRecomputed(S, mixed) : ZERO;  // alive at its down projection's backward too
    const backward = x.float8 !== "none" ? float8Backward(x, S, S.pp.mul(micro)) : [S.pp.mul(micro), temporaries.add(block)];
    const out = {
      pipeline_backward: Object.assign({}, held, { activations: backward[0], temporaries: backward[1] }),
      embedding_backward: Object.assign({}, held, { activations: S.pp.sub(1).mul(micro).add(tokens.mul(S.r).mul(S.h)),
        temporaries: S.w.mul(S.t).mul(S.V).mul(S.h).add(S.T.mul(S.r).mul(S.h)) }),
      optimizer: Object.assign({}, state),
    };
    if (plain && x.checkpointing === "none" && !mixed) {  // or later, at the gate x up product's backward (fit_split.pipeline)
      out.pipeline_product = Object.assign({}, held, { activations: S.pp.mul(micro).sub(S.c.mul(S.T).mul(S.f)),
        temporaries: n(3).mul(S.c).mul(S.T).mul(S.f) });
    }
    if (plain && x.checkpointing === "none" && x.precision === "bf16" && !x.sp) {  // or at its MLP norm's backward
      out.pipeline_norm = Object.assign({}, held, { activations: S.pp.mul(micro)
        .sub(S.T.mul(n(4).mul(S.c).mul(S.f).add(n(4).mul(S.h)).add(K().row))), temporaries: n(20).mul(S.T).mul(S.h) });
    }
    if (plain && x.checkpointing === "none" && S.r.value === 4n && !x.sp) {  // there with an fp32 stream (fit_split.pipeline)
      const freed = S.T.mul(norm(S, 2, false).sub(n(4).mul(S.h)).add(n(4).mul(S.c).mul(S.f)))
        .add(mixed ? n(3).mul(S.c).mul(S.f).mul(S.h) : ZERO);
      out.pipeline_norm = Object.assign({}, held, { activations: S.pp.mul(micro).sub(freed), temporaries: n(20).mul(S.T).mul(S.h) });
    }
    if (plain && mixed && x.checkpointing === "full" && !x.sp) {  // a steady forward's last block: autocast's cache
      out.pipeline_cache = Object.assign({}, state, { gradients: grads, activations: S.pp.mul(micro).sub(tokens.mul(S.r).mul(S.h)),
        temporaries: total(S.c.mul(S.Pm).sub(S.c.mul(S.f).mul(S.h)), n(3).mul(S.c).mul(S.T).mul(S.f), S.T.mul(S.r).mul(S.h),
          n(4).mul(S.T).mul(S.h)) });
    }
    const stage = S.pp.mul(micro);  // the recomputed last block (fit_split.pipeline): its MLP norm's backward; its gate x up
    if (recomputed) out.pipeline_recomputed = Object.assign({}, held, { activations: stage, temporaries: recomputedNorm(S, mixed) });
    if (recomputed && !mixed) {  // product's backward; under autocast, as it is recomputed, at down's weight cast
      out.pipeline_recomputed_product = Object.assign({}, held, { activations: stage,
        temporaries: block.add(n(2).mul(S.c).mul(S.T).mul(S.f)) });
    }
    if (recomputed && mixed) {
      out.pipeline_recompute = Object.assign({}, held, { activations: stage,
        temporaries: total(block, S.T.mul(S.r).mul(S.h), S.c.mul(S.T).mul(S.h)) });
    }
    const gathered = S.c.value !== S.r.value ? S.T.mul(S.r).mul(S.h) : ZERO;
    if (x.sp) {  // a steady forward's last reduce-scatter (float8 TP styles: or down's weight cast to e4m3 before it)
      const frames = gathered === ZERO ? n(3).mul(tokens).mul(S.r).mul(S.h) : ZERO;  // held by Python frames (fit_split)
      let forward = total(gathered, tokens.mul(S.r).mul(S.h), frames, n(2).mul(S.T).add(tokens).mul(S.c).mul(S.h));
      if (S.f8tp) {  // the product not saved (down saves its float8 copy); or down's weight cast to e4m3 before
        forward = total(tokens.mul(S.r).mul(S.h), frames, S.c.mul(S.T).mul(S.f),
          larger(n(2).mul(S.T).add(tokens).mul(S.c).mul(S.h), n(5).mul(S.f).mul(S.h)));
      }
      out.pipeline_forward = Object.assign({}, state, { gradients: grads, activations: S.pp.mul(micro).sub(tokens.mul(S.r).mul(S.h)),
        temporaries: forward });
    }
    if (x.optimizer === "adamw" || x.optimizer === "adamw-foreach") {
      out.optimizer.temporaries = S.m.mul(x.zero_stage ? ceilDiv(S.Pt, S.dp) : S.Pt);
    }
    return out;
  }

  /** Python: fit_split.last_block_recomputed: a block recomputed whole in backward (an fp32 stream: no copy of its input). */
  function lastBlockRecomputed(S, mixed) {
    const block = S.r.value === 4n ? layer(S, "none", false).sub(n(4).mul(S.T).mul(S.h)) : layer(S, "none", false);
    return mixed ? block.add(S.c.mul(ceilDiv(S.Pm, S.L))) : block;
  }

  /** Python: fit_split.recomputed_norm: the recomputed last block at its MLP norm's backward. */
  function recomputedNorm(S, mixed) {
    let kept = S.T.mul(norm(S, 3, false).add(S.c.mul(n(2).mul(S.q).add(n(2).mul(S.g)))).add(n(K().lse).mul(S.a)))
      .add(n(2).mul(S.s).mul(S.d).mul(S.r)).add(n(24).mul(S.T).mul(S.h));
    if (S.r.value === 4n) kept = kept.sub(n(4).mul(S.T).mul(S.h));
    return mixed ? kept.add(S.c.mul(S.h).mul(n(2).mul(S.q).add(n(2).mul(S.g)))) : kept;
  }

  /** Python: fit_split.float8_backward (--float8 tensorwise --pp): a steady backward's [activations, temporaries]. */
  function float8Backward(x, S, kept) {
    const pick = (a, b) => (b[0].value + b[1].value > a[0].value + a[1].value ? b : a);  // Python's max: the first on a tie
    const cast = S.w.value !== S.c.value ? S.w.mul(S.f).mul(S.h) : ZERO;
    const down = [kept, total(S.c.mul(S.T).mul(S.f), S.c.mul(S.f).mul(S.h), cast)];
    if (!S.f8tp) {
      const mixed = x.precision === "mixed" ? S.c.mul(S.T).mul(S.h) : ZERO;
      return pick(down, [kept, total(mixed, S.c.mul(S.T).mul(S.f), S.T.mul(S.h), n(5).mul(S.T).mul(S.f))]);
    }
    const tokens = x.sp ? ceilDiv(S.T, S.t) : S.T;
    const gate = [kept.sub(S.T.mul(n(3).mul(S.c).mul(S.f).add(S.f))), total(n(2).mul(S.c).mul(S.T).mul(S.h), S.c.mul(S.f).mul(S.h), cast)];
    const norm = [kept.sub(S.T.mul(S.h.add(n(3).mul(S.c).mul(S.f)).add(S.f))).sub(tokens.mul(S.r).mul(S.h)), n(20).mul(tokens).mul(S.h)];
    return pick(down, pick(gate, norm));
  }

  // FSDP2's mixed at ZeRO-3: the second block's backward, at its MLP norm's backward (fit_moments.block_backward);
  // with --fsdp-units blocks-embed-head the last block's, and the head's reduce-scatter before it (head_reduced).
  function blockBackward(x, S, held, act) {
    const u = units(x);
    const [mlp, weightGrads] = S.E.value ? [experts(S), S.E.mul(n(3).mul(S.c).mul(S.h).mul(S.f).add(S.c.mul(S.h)))]
      : [n(4).mul(S.c).mul(S.f), n(3).mul(S.c).mul(S.h).mul(S.f)];
    const last = u ? ZERO : layer(S, "none");  // the last block's activations, gone
    const mlpDone = S.f8tp ? float8Mlp(S, x.sp).sub(n(4).mul(x.sp ? ceilDiv(S.T, S.t) : S.T).mul(S.h))  // float8 TP styles
      : S.T.mul(mlp.add(n(4).mul(S.h)).add(K().row));
    const done = total(S.T.mul(norm(S, 1)), last, mlpDone);
    const grads = x.accumulation > 1 ? held.gradients : S.w.mul(ceilDiv(u ? S.Pr.sub(S.V.mul(S.h)) : S.Pb, S.dp));
    const normBackward = S.T.mul(n(20).mul(S.h).add(S.c.mul(S.h)).add(2 * K().row));
    const out = { block_backward: Object.assign({}, held, { gradients: grads, activations: act.kept.sub(act.loss).sub(done),
      temporaries: total(u ? ZERO : S.c.mul(S.V).mul(S.h), weightGrads, normBackward) }) };
    if (x.float8 === "tensorwise" && !u && !S.f8tp) {  // or earlier (float8): the gate weight cast to e4m3, the MLP norm's not yet freed
      const cast = Object.assign({}, held, { gradients: grads, activations: act.kept.sub(act.loss)
        .sub(total(S.T.mul(norm(S, 1)), last, S.T.mul(mlp))), temporaries: total(S.c.mul(S.V).mul(S.h),
        n(2).mul(S.c).mul(S.f).mul(S.h), n(5).mul(S.f).mul(S.h), S.c.mul(S.T).mul(S.f), S.T.mul(S.f), n(2).mul(S.T).mul(S.c).mul(S.h)) });
      const sum = (m) => Object.values(m).reduce((a, e) => a + e.value, 0n);
      if (sum(cast) > sum(out.block_backward)) out.block_backward = cast;
    }
    if (u) {  // the second block's, as without its own units but for the head's gradient (reduced) and its shard
      out.second_block_backward = Object.assign({}, held, { gradients: x.accumulation > 1 ? held.gradients
        : grads.add(S.w.mul(ceilDiv(S.Pb, S.dp))), activations: act.kept.sub(act.loss).sub(done).sub(layer(S, "none")),
      temporaries: total(weightGrads, normBackward) });
      out.head_reduced = Object.assign({}, held, { gradients: grads, activations: act.kept.sub(act.loss).sub(S.T.mul(norm(S, 1))),
        temporaries: S.c.mul(S.V).mul(S.h).add(S.T.mul(S.c).mul(S.h)) });
    }
    return out;
  }

  // Python: fit_moments.recomputed_blocks: the blocks gathered in a recomputed block's backward (every-k: its segment;
  // ZeRO-2 at the end: every block not yet done).
  // at: front, end, second or last (fit_moments.recomputed_block's moments)
  function recomputedBlocks(x, S, at) {
    const u = units(x), every = segmented(x, S);
    if (x.zero_stage === 2 && at && at !== "front") {
      const done = at === "second" || (at === "end" && !u);
      return done ? S.L.sub(every ? lastSegment(S) : n(1)) : S.L;
    }
    if (!every) {  // the moment's block: at the first, no next one is gathered
      const index = at === "end" ? S.L.value - (u ? 1n : 2n) : at === "last" ? S.L.value - 1n : 1n;
      return n(index === 0n ? 1 : 2);
    }
    const blocks = at === "last" || (at === "end" && u) ? lastSegment(S) : S.G;
    return blocks.value > 1n ? blocks : n(2);
  }
  // Python: fit_moments.segmented (every-k of more than one block a segment), last_segment (its blocks left over)
  const segmented = (x, S) => x.checkpointing === "every-k" && S.G.value > 1n;
  const lastSegment = (S) => S.L.sub(S.G.mul(ceilDiv(S.L, S.G).sub(n(1))));

  // Python: fit_moments.recomputed_mlp: a recomputed block's backward at the largest of four points of its MLP's
  // backward: (1) the gate x up product's; (2) --sp: before it, the block output's gathered gradient; (3) the MLP's
  // input gradients from up and gate; (4) the MLP norm's fp32 backward. Beside: the stream's gradient.
  function recomputedMlp(x, S, count) {
    const tokens = x.sp ? ceilDiv(S.T, S.t) : S.T, fp32 = S.r.value === 4n;
    const k = count === undefined ? (x.checkpointing === "every-k" ? S.G : 1) : count;  // the blocks recomputed together
    let blocks = k === 1 ? layer(S, "none", x.sp) : k.mul(layer(S, "none", x.sp));
    if (fp32) blocks = blocks.sub(n(4).mul(tokens).mul(S.h));  // the first norm reads its checkpointed input itself
    const mlpNorm = S.f8tp ? S.T.mul(S.h).add(tokens.mul(own(S)))  // float8 TP styles: its own tensors, its float8 output
      : x.sp ? S.T.mul(norm(S, 2, true)).add(tokens.mul(own(S))) : S.T.mul(norm(S, 2));
    const before = S.f8tp ? blocks.sub(float8Mlp(S, x.sp))  // its float8 copies (float8 TP styles)
      : blocks.sub(n(4).mul(S.T).mul(S.c).mul(S.f)).sub(mlpNorm);
    const weight = S.c.mul(S.f).mul(S.h);
    let product = mlpNorm.add(total(n(6).mul(S.T).mul(S.c).mul(S.f), weight));
    if (x.sp) {
      product = larger(product, mlpNorm.add(total(n(5).mul(S.T).mul(S.c).mul(S.f), S.T.mul(S.c).mul(S.h), weight)));
    }
    const inputs = mlpNorm.add(total(S.T.mul(S.c).mul(S.f), n(2).mul(S.T).mul(S.c).mul(S.h), n(3).mul(weight)));
    let normBackward = tokens.mul(n(fp32 ? 20 : 24).mul(S.h).add(K().row)).add(n(3).mul(weight));
    const attention = normBackward.add(S.c.mul(n(2).mul(S.q).add(n(2).mul(S.g))).mul(S.h));  // (6): seven gradients
    if (x.float8 === "tensorwise" && !S.f8tp) {  // (5): the gate weight cast to e4m3 for its input's gradient (fp32 copy, bits)
      const cast = mlpNorm.add(total(S.c.mul(S.T).mul(S.f), S.T.mul(S.f), S.T.mul(S.c).mul(S.h), n(2).mul(weight), n(5).mul(S.f).mul(S.h)));
      normBackward = larger(normBackward, cast);
    }
    let peak = total(before, larger(larger(product, inputs), normBackward));
    if (k === 1 || k.value === 1n) peak = larger(peak, attention);  // (6): one block, its other tensors freed
    return total(peak, tokens.mul(S.c).mul(S.h));
  }

  // --checkpointing full or every-k under FSDP2 (ZeRO-2 or 3): a block's (segment's) backward, recomputed, at its MLP's
  // backward's peak (recomputedMlp): the second block from the end (own units: the last, and the second segment), the
  // second from the front (own units: the first; every-k: the first segment), the last (fit_moments.recomputed_block).
  function recomputedBlock(x, S, held) {
    const u = units(x), fused = x.loss === "fused-linear";
    const head = u ? ZERO : S.c.mul(S.V).mul(S.h);
    const stream = layer(S, x.checkpointing, x.sp), shard = ceilDiv(S.Pb, S.dp);  // (--sp: on T / t tokens)
    const ends = {};
    let last;  // per moment: the inputs alive, the blocks done (their shards out), the blocks recomputed
    if (segmented(x, S)) {  // a segment recomputed, at its last block's backward
      const segments = ceilDiv(S.L, S.G), left = lastSegment(S);
      if (u) {
        ends.recomputed_backward = [segments.mul(stream), ZERO, left];
        if (segments.value >= 3n) ends.recomputed_second = [segments.sub(n(1)).mul(stream), left.mul(shard), S.G];
      } else if (segments.value >= 3n) ends.recomputed_backward = [segments.sub(n(1)).mul(stream), left.mul(shard), S.G];
      if (segments.value >= 2n) ends.recomputed_front = [stream, S.L.sub(S.G).mul(shard), S.G];
      last = [segments.mul(stream), ZERO, left];
    } else {
      if (S.L.value >= (u ? 1n : 2n)) ends.recomputed_backward = u ? [S.L.mul(stream), ZERO, 1] : [S.L.sub(n(1)).mul(stream), shard, 1];
      if (S.L.value >= (u ? 2n : 4n)) {
        ends.recomputed_front = u ? [stream, S.L.sub(n(1)).mul(shard), 1] : [n(2).mul(stream), S.L.sub(n(2)).mul(shard), 1];
      }
      last = [S.L.mul(stream), ZERO, 1];
    }
    if (!u) ends.recomputed_last = last;  // the last block's (segment's): nothing reduced yet
    const own = u ? ceilDiv(S.Pr.sub(S.V.mul(S.h)), S.dp) : ZERO;  // the head unit's shard
    const out = {};
    for (const [moment, [inputs, done, blocks]] of Object.entries(ends)) {
      let work = recomputedMlp(x, S, blocks);
      if (x.float8 !== "none") {  // or at the down projection's weight gradient: its input cast again (an fp32 copy)
        const recomputed = blocks === 1 ? layer(S, "none", false) : blocks.mul(layer(S, "none", false));
        const cast = S.c.mul(S.T).mul(S.f).add(S.T.mul(S.h)).add(n(5).mul(S.T).mul(S.f));
        work = larger(work, total(recomputed, cast, S.T.mul(S.c).mul(S.h)));
      }
      out[moment] = Object.assign({}, held, { gradients: x.accumulation > 1 ? held.gradients : S.w.mul(total(own, done)),
        activations: fused ? total(inputs, head) : inputs, temporaries: fused ? work : total(work, head) });
    }
    return out;
  }

  function full(m) {
    const out = {};
    for (const k of D.categories) out[k] = m[k] || ZERO;
    return out;
  }

  function moments(x) {
    const z = sizes(x), S = symbols(x, z);
    if (x.task !== "train") return { [x.task]: full(inference(x, S)) };
    const state = modelState(x, S), comm = communication(x, S), act = activations(x, S, z.spec.family);
    if (x.pp > 1) {
      const res = {}, all = pipeline(x, S, state);
      for (const k of Object.keys(all)) res[k] = full(Object.assign(all[k], { communication: total(comm[k], all[k].communication || ZERO) }));
      return res;
    }
    let carried = x.accumulation > 1 ? state.gradients : ZERO;
    if (x.tp > 1 && x.zero_stage === 0 && x.accumulation > 1) carried = carried.add(S.w.mul(S.t.sub(1)).mul(S.V).mul(S.h));
    const held = Object.assign({}, state, { gradients: carried });
    let logits = S.c.value < 4n ? n(4).add(S.c).mul(S.T).mul(S.V) : n(4).mul(S.T).mul(S.V);
    if (x.tp > 1) logits = logits.add(n(4).mul(S.T).mul(S.V));  // --tp: loss_parallel's fp32 shifted logits (x - max)
    const out = {
      forward_end: Object.assign({}, held, { activations: act.kept,  // + the blocks' output, held by forward (a bf16 stream)
        temporaries: total(act.cache, logits, S.r.value < 4n ? (x.sp ? ceilDiv(S.T, S.t) : S.T).mul(S.r).mul(S.h) : ZERO) }),
      backward_start: Object.assign({}, held, { activations: act.kept, temporaries: n(x.tp > 1 ? 12 : 8).mul(S.T).mul(S.V) }),
      optimizer: Object.assign({}, state),
    };
    if (x.optimizer_in_backward) {  // each parameter stepped in backward, its gradient freed
      delete out.optimizer.gradients;
    } else if ((x.optimizer === "adamw" || x.optimizer === "adamw-foreach") && x.offload === "none") {
      out.optimizer.temporaries = S.m.mul(x.zero_stage ? ceilDiv(S.Pt, S.dp) : S.Pt);
    }
    if (x.optimizer === "adamw8bit") {  // Lab 15's chunk: its float32 working copies
      out.optimizer.temporaries = n(K().opt8.working[S.w.value]).mul(S.Cw).add(n(4).mul(ceilDiv(S.Cw, K().opt8.block)));
    }
    Object.assign(out, loraRecomputedMlp(x, S, held));  // LoRA, full checkpointing: the last block's recomputed MLP
    if (x.tp > 1 && x.zero_stage >= 2 && x.offload === "none") {  // under FSDP2, its rows copied out (fit_split.embedding)
      out.embedding_rows = Object.assign({}, held, { gradients: x.accumulation > 1 ? held.gradients
        : S.w.mul(S.L).mul(ceilDiv(S.Pb, S.dp)), temporaries: S.c.mul(S.t).mul(S.V).mul(S.h).add(n(2).mul(S.c).mul(S.V).mul(S.h)) });
    }
    if (x.tp === 1 && x.zero_stage >= 2 && x.offload === "none" && !fsdpMixed(x) && !units(x) && x.method === "full"
        && !z.spec.tied && z.spec.family !== "gpt" && !S.E.value) {  // the embedding's backward (fit_split.embedding_end)
      out.embedding_end = Object.assign({}, held, { gradients: x.accumulation > 1 ? held.gradients
        : S.w.mul(S.L).mul(ceilDiv(S.Pb, S.dp)), temporaries: n(2).mul(S.c).mul(S.V).mul(S.h).add(S.T.mul(S.c).mul(S.h)) });
    }
    if (x.tp > 1 && x.zero_stage === 0) {  // DTensor's whole embedding gradient, then this rank's rows (fit_formula.py)
      const whole = S.w.mul(S.t).mul(S.V).mul(S.h);
      out.embedding_gradient = Object.assign({}, state, { gradients: state.gradients.add(whole) });
      if (x.accumulation > 1) out.embedding_backward = Object.assign({}, held, { temporaries: whole.add(S.T.mul(S.r).mul(S.h)) });
    }
    if (x.loss !== "full") {
      delete out.backward_start;
      Object.assign(out, chunkedLoss(x, S, held, act));
    } else if (x.zero_stage <= 1 && !loraStep(x)) {
      const head = S.w.mul(S.V).mul(S.h);
      out.head_gradient = Object.assign({}, held, { gradients: carried === ZERO ? head : carried,
        activations: act.kept.sub(act.loss), temporaries: act.autocast ? n(8).mul(S.T).mul(S.V).add(n(4).mul(S.T).mul(S.h))
          : S.c.mul(S.T).mul(S.V).add(S.T.mul(S.r).mul(S.h)) });
    }
    if (x.optimizer_in_backward && x.loss === "full" && (x.optimizer === "adamw" || x.optimizer === "adamw-foreach")) {
      out.head_step = Object.assign({}, held, { gradients: S.w.mul(S.V).mul(S.h),
        activations: act.kept.sub(act.loss).sub(S.T.mul(S.c).mul(S.h)), temporaries: S.m.mul(S.V).mul(S.h).add(S.T.mul(S.r).mul(S.h)) });
    }
    if (x.zero_stage === 3 && x.offload !== "params" && !units(x)) out.root_gathered = Object.assign({}, held, { activations: act.kept });
    if (comm[{ none: "block_backward", full: "recomputed_backward", "every-k": "recomputed_backward" }[x.checkpointing]] && !loraStep(x)
        && (!S.E.value || x.checkpointing === "none")
        && z.spec.family !== "gpt" && x.offload === "none" && !x.compile) {
      Object.assign(out, x.checkpointing === "none" ? blockBackward(x, S, held, act) : recomputedBlock(x, S, held));
    }
    if (x.checkpointing === "every-kth-block") Object.assign(out, kthLast(x, S, held, z.spec));
    if (x.compile) Object.assign(out, compiledMoments(x, S, held, state, act));  // a compiled block's backward; the embedding's
    const recomputesFull = x.checkpointing === "full" && !x.sp && (x.cp || 1) === 1 && x.float8 === "none" && !x.compile;
    if ((recomputesFull || (x.checkpointing === "every-k" && x.dp === 1)) && x.zero_stage <= 1 && x.offload === "none" && !loraStep(x)
        && !S.E.value && z.spec.family !== "gpt") {  // one rank's recomputes (fit_moments.segment_backward)
      out.segment_backward = segmentBackward(x, S, held, carried, z.spec);
      if (recomputesFull) Object.assign(out, recomputeLast(x, S, held, carried, z.spec));
    }
    if (fsdpMixed(x) && !loraStep(x)) {  // the root's (or the embedding's) backward done: its bf16 gradients, about to be reduced
      const blocks = units(x) ? state.gradients : x.offload === "params" ? ZERO : S.w.mul(S.L).mul(ceilDiv(S.Pb, S.dp));
      out.backward_end = Object.assign({}, held, { gradients: carried === ZERO ? blocks : carried,
        temporaries: units(x) ? S.c.mul(S.V).mul(S.h) : S.c.mul(S.Pr) });
    }
    const res = {};
    for (const k of Object.keys(out)) res[k] = full(Object.assign(out[k], { communication: comm[k] || ZERO }));
    return res;
  }

  const totalOf = (cats) => Object.values(cats).reduce((a, e) => a + e.value, 0n);

  const peak = (x) => peakOf(moments(x));

  function peakOf(all) {
    let best = null;
    for (const [name, cats] of Object.entries(all)) {
      if (best === null || totalOf(cats) > best[2]) best = [name, cats, totalOf(cats)];
    }
    return best;
  }

  function kvPerToken(S, scale) {
    const two = n(2).mul(S.L).mul(S.k);
    return scale ? two.mul(S.d.mul(S.e).add(scale)) : two.mul(S.d).mul(S.e);
  }

  function prefill(S) {
    const alive = S.p.mul(S.c.mul(n(2).mul(S.h).add(S.q).add(n(2).mul(S.g))).add(n(2).mul(S.d).mul(S.c)).add(K().indices));
    let mlp;
    if (S.E.value) {
      mlp = S.p.mul(n(2).mul(S.c).mul(S.h).add(n(4).mul(S.E)).add(n(K().slot).mul(S.K)))
        .add(ceilDiv(S.p.mul(S.K), S.E).mul(n(2).mul(S.c).mul(S.h).add(n(3).mul(S.c).mul(S.f)).add(n(4).mul(S.h))));
    } else {
      mlp = S.p.mul(S.c.mul(S.h).add(n(3).mul(S.c).mul(S.f)));
    }
    let read = n(2).mul(S.c).mul(S.g).mul(S.C);
    if (S.p.value < S.C.value) read = read.add(S.p.mul(S.C));
    return alive.add(larger(n(8).mul(S.p).mul(S.h), mlp)).add(read);
  }

  // Python: fit_serve.weights. The blocks' matrices as --weights stores them, the rest in w bytes.
  function weights(x, S) {
    if (x.weights === "bf16") return S.w.mul(S.P);
    const Q = S.L.mul(S.Pq), rest = S.w.mul(S.P.sub(Q));
    if (x.weights === "fp8") return rest.add(Q).add(n(4).mul(S.L).mul(S.nq));
    if (x.weights === "int8") return rest.add(Q).add(n(4).mul(S.L).mul(S.so));
    if (x.weights === "nvfp4") return rest.add(ceilDiv(Q, n(2))).add(ceilDiv(Q, n(16))).add(n(8).mul(S.L).mul(S.nq));
    const groups = ceilDiv(Q, n(128));
    const int4 = rest.add(ceilDiv(Q, n(2))).add(n(2).mul(groups)).add(ceilDiv(groups, n(2)));
    return x.weights === "int4-gptq" ? int4.add(n(4).mul(S.L).mul(S.si)) : int4;
  }

  function inference(x, S) {
    if (x.task === "serve") {
      const kv = S.N.mul(ceilDiv(S.C, S.B)).mul(S.B).mul(kvPerToken(S, K().kv_dtypes[x.kv_dtype][1]));
      return { parameters: weights(x, S), activations: prefill(S), kv_cache: kv };
    }
    if (x.task === "decode") {  // Lab 13's decode step: the preallocated cache, and a prefill's work over b × j tokens
      const step = larger(S.c.mul(S.V).add(n(4).mul(S.h)).mul(S.b).mul(S.j),
        S.b.mul(S.j).mul(n(3).mul(S.c).mul(S.f).add(n(3).mul(S.c).mul(S.h))));
      return { parameters: S.w.mul(S.P), kv_cache: n(2).mul(S.L).mul(S.b).mul(S.D).mul(S.g).mul(S.c), temporaries: step };
    }
    let work = larger(S.c.mul(S.V).add(n(4).mul(S.h)).mul(S.T), S.T.mul(n(3).mul(S.c).mul(S.f).add(n(3).mul(S.c).mul(S.h))));
    if (x.precision === "mixed" && !fsdpMixed(x)) work = S.c.mul(S.Pm.add(S.V.mul(S.h))).add(work);
    const out = { parameters: S.w.mul(S.P), kv_cache: n(2).mul(S.L).mul(S.T).mul(S.g).mul(S.c), temporaries: work };
    if (x.zero_stage === 3) {
      out.parameters = S.w.mul(ceilDiv(S.P, S.dp));
      out.communication = S.w.mul(S.Pr.add(S.Pb));
    }
    if (x.offload === "params") out.parameters = ZERO;
    return out;
  }

  // ---------------------------------------------------------------------------- verdict and levers (scripts/fit_table.py)
  function verdict(x, gpu) {
    const g = D.gpus[gpu], all = moments(x), [moment, cats, total] = peakOf(all);
    const out = { moment, cats, total, all };
    if (x.task !== "serve") return Object.assign(out, { capacity: BigInt(g.capacity_bytes), fits: total <= BigInt(g.capacity_bytes) });
    const usable = BigInt(Math.trunc(x.gpu_memory_utilization * g.total_bytes)) - BigInt(D.serve_non_torch_bytes);
    const pool = usable - cats.parameters.value - cats.activations.value;
    const S = symbols(x, sizes(x));
    const perBlock = BigInt(x.block_size) * kvPerToken(S, K().kv_dtypes[x.kv_dtype][1]).value;
    const tokens = (pool > 0n ? pool : 0n) / perBlock * BigInt(x.block_size);
    const perRequest = cdiv(BigInt(x.context), BigInt(x.block_size)) * BigInt(x.block_size);
    return Object.assign(out, { capacity: usable, fits: total <= usable, pool, pool_tokens: tokens, pool_requests: tokens / perRequest });
  }

  // Lab 13's fit_levers.LEVERS and fit_table.SERVING_LEVERS: what each lever changes, where it applies.
  const ADAM = (c) => c.optimizer === "adamw" || c.optimizer === "adamw-foreach";
  const FREE = (c) => !c.optimizer_in_backward;
  const PULLS = {
    "fused AdamW": (c) => (ADAM(c) && c.offload === "none" ? { optimizer: "adamw-fused" } : null),
    "mixed precision": (c) => (c.precision === "fp32" ? { precision: "mixed" } : null),
    "embedding and head as FSDP units": (c) => (c.zero_stage >= 2 && !units(c) && c.offload !== "params" && c.pp === 1
      ? { fsdp_units: "blocks-embed-head" } : null),
    "optimizer step in backward": (c) => (FREE(c) && c.accumulation === 1 && !c.zero_stage && c.offload === "none"
      && c.method === "full" ? { optimizer_in_backward: true } : null),
    "save-matmuls checkpointing": (c) => (c.checkpointing === "none" ? { checkpointing: "save-matmuls" } : null),
    "chunked loss": (c) => (c.loss === "full" ? { loss: "chunked" } : null),
    "ZeRO-1": (c) => (c.dp > 1 && c.zero_stage < 1 && c.offload === "none" && FREE(c) ? { zero_stage: 1 } : null),
    "ZeRO-2": (c) => (c.dp > 1 && c.zero_stage < 2 && c.offload === "none" && FREE(c) ? { zero_stage: 2 } : null),
    "half the micro-batch": (c) => (c.batch > 1 && (FREE(c) || c.task !== "train") ? { batch: Math.floor(c.batch / 2), accumulation: c.task === "train" ? c.accumulation * 2 : 1 } : null),
    "ZeRO-3": (c) => (c.dp > 1 && c.zero_stage < 3 && c.offload === "none" && FREE(c) ? { zero_stage: 3 } : null),
    "full checkpointing": (c) => (c.checkpointing !== "full" ? { checkpointing: "full" } : null),
    "bf16 weights and state": (c) => (c.precision !== "bf16" ? { precision: "bf16" } : null),
    "activation offload": (c) => {
      if (c.offload_activations || c.zero_stage >= 2) return null;
      const s = spec(c);
      return s.family !== "gpt" && !s.experts && c.method === "full" && s.layers >= 2 ? { offload_activations: true } : null;
    },
    "optimizer offload": (c) => (c.offload === "none" && FREE(c) && c.method === "full"
      ? { offload: "optimizer", optimizer: c.optimizer === "sgd" || c.optimizer === "adamw8bit" ? "adamw" : c.optimizer } : null),
    "parameter offload": (c) => (c.offload !== "params" && c.dp > 1 && FREE(c) ? { offload: "params", zero_stage: 3 } : null),
    "fp8 KV cache": (c) => (c.kv_dtype === "bf16" || c.kv_dtype === "fp32" ? { kv_dtype: "fp8" } : null),
    "int4 weights": (c) => (["bf16", "fp8", "int8"].includes(c.weights) ? { weights: "int4-awq" } : null),
    "chunked prefill": (c) => (c.context > 2048 && !c.prefill_chunk ? { prefill_chunk: 2048 } : null),
    "tensor parallelism x2": (c) => (c.tp < 64 ? { tp: c.tp * 2 } : null),
  };

  function ladder(x, gpu, base) {
    if (base.fits) return [];
    const text = TEXT;
    TEXT = false;
    try {
      return climb(x, gpu, base);
    } finally {
      TEXT = text;
    }
  }

  /** Python: fit_table.ladder (Lab 13's fit_levers.climb): one row per lever, a halving pulled again
      while it applies and saves. ``changes`` (its link): a kept lever's, with those kept before it. */
  function climb(x, gpu, base) {
    const kind = {};
    for (const lv of D.levers) kind[lv.name] = lv.kind;
    const out = new Map();
    let kept = {}, current = x, now = base;
    for (const lv of D.levers) {
      const pull = PULLS[lv.name];
      if (!pull || !lv.tasks.includes(x.task)) continue;
      let changes;
      while (!now.fits && (changes = pull(current))) {
        const trial = {};
        for (const [name, ch] of Object.entries(kept)) if (kind[name] !== lv.kind) Object.assign(trial, ch);
        Object.assign(trial, changes);
        const after = Object.assign({}, x, trial);
        if (Object.keys(check(after)).length) break;
        const afterV = verdict(after, gpu);
        const saved = now.total - afterV.total;
        const prev = out.get(lv.name);
        if (saved > 0n) {
          const next = {};
          for (const [name, ch] of Object.entries(kept)) if (kind[name] !== lv.kind) next[name] = ch;
          next[lv.name] = changes;
          kept = next; current = after; now = afterV;
        }
        if (!prev || saved > 0n) {  // a pull again that saves nothing leaves the lever as it was
          out.set(lv.name, { lever: lv, kept: saved > 0n || !!prev, saves: (prev ? prev.saves : 0n) + saved,
            pulls: prev ? prev.pulls + 1 : 1, total: now.total, fits: now.fits, changes: saved > 0n ? trial : changes });
        }
        if (!(lv.repeats && saved > 0n)) break;
      }
      if (now.fits) break;
    }
    return [...out.values()];
  }

  // ---------------------------------------------------------------------------- the page
  window.InfraLabFit = { load, moments, peak, verdict, check, ladder, parseQuery: (q) => readQuery(q) };
  const root = document.getElementById("fit");
  if (root) start(root);

  async function start(el) {
    try {
      const res = await fetch(el.dataset.src);
      D = await res.json();
    } catch (e) {
      el.querySelector(".il-fit__loading").textContent = `The calculator's data did not load (${e.message}).`;
      return;
    }
    build(el);
    load(window.location.search);
    drawAllTraced(document.getElementById("fit-all-traced"));
  }

  /** Every traced configuration beside the formula (the page's "How close" table). */
  function drawAllTraced(el) {
    if (!el) return;
    const body = h("tbody");
    for (const t of D.traced) {
      const q = "?" + new URLSearchParams(Object.entries(t.inputs).map(([k, v]) => [keyOf(field(k)), String(v)])).toString();
      const label = Object.entries(t.inputs).filter(([k]) => k !== "model").map(([k, v]) => `${keyOf(field(k))}=${v}`).join(" ") || "defaults";
      body.append(h("tr", {}, h("td", {}, h("a", { href: q, text: t.inputs.model || "llama-3-8b" })), h("td", { text: label }),
        h("td", { class: "il-fit__num", text: bytes(t.bytes) }), h("td", { class: "il-fit__num", text: bytes(t.formula) }),
        h("td", { class: "il-fit__num", text: percent(t.gap) }),
        h("td", { class: "il-fit__num", text: t.reserved ? bytes(t.reserved) : "-" })));
    }
    el.textContent = "";
    el.append(h("table", { class: "il-fit__table" },
      h("thead", {}, h("tr", {}, h("th", { text: "model" }), h("th", { text: "configuration" }),
        h("th", {}, "traced ", h("span", { class: "il-tag il-tag--traced", text: "traced" })),
        h("th", {}, "formula ", h("span", { class: "il-tag il-tag--derived", text: "derived" })), h("th", { text: "gap" }),
        h("th", {}, "reserved ", h("span", { class: "il-tag il-tag--simulated", text: "simulated" })))),
      body));
  }

  const UI = {};  // the controls and the output elements, by name
  const TASK_OF = {};  // the tasks that use a field, where not every task does
  let state = null;  // the last valid inputs
  let gpu = "h100-80gb";

  /** An input's key in the address: its flag's spelling (`zero-stage`, as `fit.py --zero-stage`). */
  const keyOf = (f) => f.flag.slice(2);

  /** An address's query as text per input. The flag's spelling wins; the field's name
      (`zero_stage`, what links shared before) is read as an alias. Keys of no input are listed. */
  function readQuery(search) {
    const q = new URLSearchParams(search);
    const raw = {}, known = new Set(["gpu"]);
    for (const f of D.inputs) {
      known.add(keyOf(f)).add(f.name);
      raw[f.name] = q.has(keyOf(f)) ? q.get(keyOf(f)) : q.has(f.name) ? q.get(f.name) : "";
    }
    raw.gpu = q.get("gpu") || "";
    raw.ignored = [...new Set([...q.keys()].filter((k) => !known.has(k)))];
    return raw;
  }

  // A choice the address gave that no control offers: {name: text}, shown beside the control until
  // that control is changed; the result uses the control's default meanwhile, and says so.
  let offChoice = {};

  /** Set every control from an address's query (`?model=llama-3-8b&seq=4096`) and compute. */
  function load(search) {
    const raw = readQuery(search);
    offChoice = {};
    for (const f of D.inputs) {
      setControl(f, raw[f.name]);
      const c = UI[f.name];
      if (c.tagName === "SELECT" && raw[f.name] !== "" && c.value !== raw[f.name]) offChoice[f.name] = raw[f.name];
    }
    UI.gpu.value = D.gpus[raw.gpu] ? raw.gpu : "h100-80gb";
    if (raw.gpu && !D.gpus[raw.gpu]) offChoice.gpu = raw.gpu;
    UI.ignored.textContent = raw.ignored.length ? `Ignored in the address (no such input): ${raw.ignored.join(", ")}` : "";
    UI.ignored.hidden = !raw.ignored.length;
    UI.config.value = "";
    showError("config_json", null);
    state = null;  // a new address: never the result of the previous one
    update(false);
  }

  /** The message beside a select whose address value is not one of its choices. */
  function offChoiceText(name, text) {
    if (name === "gpu") return `--gpu must be one of ${Object.keys(D.gpus).join(", ")}, got ${text}: computed with ${UI.gpu.value}`;
    const f = field(name);
    const choices = name === "model" ? "custom or a zoo preset" : name === "tied" ? "true or false"
      : `one of ${f.choices.join(", ")}`;
    return `${f.flag} must be ${choices}, got ${text}: computed with ${f.default === null ? "the preset's" : f.default}`;
  }

  function setControl(f, text) {
    const c = UI[f.name];
    if (c.type === "checkbox") c.checked = text === "true" || text === "1";
    else if (c.tagName === "SELECT" && f.name === "tied") c.value = text === "" ? "" : String(text);
    else if (c.tagName === "SELECT") c.value = text === "" ? String(f.default) : text;
    else c.value = text === null || text === undefined || text === "" ? (f.default === null ? "" : String(f.default)) : text;
    if (c.tagName === "SELECT" && c.value === "" && f.name !== "tied") c.value = String(f.default);
  }
  function controlText(f) {
    const c = UI[f.name];
    return c.type === "checkbox" ? String(c.checked) : c.value;
  }

  /** Read the controls, check them, compute, draw. ``push``: write the address (a result is a link). */
  function update(push) {
    const x = {}, errors = {};
    for (const f of D.inputs) {
      const [value, error] = parseField(f, controlText(f));
      x[f.name] = value;
      if (error) errors[f.name] = error;
    }
    gpu = UI.gpu.value;
    Object.assign(errors, Object.keys(errors).length ? {} : check(x));
    const marks = {};  // every message beside a control: errors first, then choices the address gave that are none
    for (const [name, text] of Object.entries(offChoice)) marks[name] = offChoiceText(name, text);
    Object.assign(marks, errors);
    for (const name of Object.keys(marks)) {  // a field this task hides is shown while it is marked
      if (TASK_OF[name] && !TASK_OF[name].includes(x.task)) marks[name] += ` (${x.task} does not use it: clear it)`;
    }
    for (const f of D.inputs) showError(f.name, marks[f.name] || null);
    showError("gpu", marks.gpu || null);
    if (x.model === "custom" || DIMS.some((k) => errors[k] || x[k] !== null)) UI.dims.open = true;  // errors in view
    showTask(x.task, marks);
    hintPreset(x);
    const wrong = Object.keys(errors);
    root.classList.toggle("il-fit--stale", wrong.length > 0);
    if (wrong.length) {
      if (state === null || state.task !== x.task) {  // a new address, or another task: its defaults, said
        const y = fallback(x, errors);
        const used = D.inputs.filter((f) => y[f.name] !== x[f.name] && y[f.name] !== null).map((f) => `${f.flag} ${y[f.name]}`);
        state = y;
        draw(y);
        UI.status.textContent = `Fix the marked field: the result uses ${used.length ? used.join(", ") : "the defaults"}.`;
      } else {
        UI.status.textContent = "Fix the marked field: the result is for the last valid inputs.";
      }
      return;
    }
    state = x;
    const off = Object.keys(offChoice);
    UI.status.textContent = off.length ? `${off.map((k) => (k === "gpu" ? "--gpu" : field(k).flag)).join(", ")}: not a choice, the default is used.` : "";
    draw(x);
    if (push) writeAddress(queryOf(x));
  }

  /** The inputs with each wrong field at its default (and again while the rules still refuse them); the
      task's defaults if that is not enough. Never blank, never another task's result. */
  function fallback(x, errors) {
    const y = Object.assign({}, x);
    let wrong = Object.keys(errors);
    for (let i = 0; i < 4 && wrong.length; i++) {
      for (const k of wrong) if (field(k)) y[k] = field(k).default;
      wrong = Object.keys(check(y));
    }
    if (!wrong.length) return y;
    const z = { task: x.task };
    for (const f of D.inputs) if (f.name !== "task") z[f.name] = f.default;
    return z;
  }

  // The address follows the inputs a moment after the last keystroke: history.replaceState costs more
  // than a whole redraw, and a link needs only the final state.
  let pending = null;
  function writeAddress(query) {
    clearTimeout(pending);
    pending = setTimeout(() => history.replaceState(null, "", query + window.location.hash), 120);
  }

  function queryOf(x) {
    const q = new URLSearchParams();
    q.set("model", x.model);
    q.set("task", x.task);
    for (const f of D.inputs) {
      if (f.name === "model" || f.name === "task" || x[f.name] === null || String(x[f.name]) === String(f.default)) continue;
      q.set(keyOf(f), String(x[f.name]));
    }
    if (gpu !== "h100-80gb") q.set("gpu", gpu);
    return "?" + q.toString();
  }

  const shown = {};  // what each error slot shows: a redraw writes only what changed

  function showError(name, text) {
    text = text || "";
    if (shown[name] === text) return;
    shown[name] = text;
    const slot = document.getElementById(`fit-err-${name}`), c = name === "config_json" ? UI.config : UI[name];
    slot.textContent = text;
    slot.hidden = !text;
    slot.parentElement.classList.toggle("il-fit__note--error", !!text);  // the message covers the hint
    c.setAttribute("aria-invalid", text ? "true" : "false");
  }

  /** Show the fields of ``task``, and any other field while it is wrong (its message must be seen). */
  function showTask(task, errors) {
    const key = `${task} ${Object.keys(errors).join(" ")}`;
    if (shown.task === key) return;
    shown.task = key;
    for (const [name, tasks] of Object.entries(TASK_OF)) {
      UI[name].closest(".il-fit__field").hidden = !tasks.includes(task) && !errors[name];
    }
    for (const set of root.querySelectorAll("fieldset[data-task]")) {
      set.hidden = [...set.querySelectorAll(".il-fit__field")].every((el) => el.hidden);
    }
  }

  function hintPreset(x) {
    if (shown.preset === x.model) return;
    shown.preset = x.model;
    const preset = x.model !== "custom" && D.presets[x.model];
    for (const k of DIMS) {
      if (k === "tied") continue;
      UI[k].placeholder = preset ? String(preset[k] || (k === "head_dim" ? preset.hidden / preset.heads : 0)) : "";
    }
  }

  // ---------------------------------------------------------------------------- building the form and the output
  const LABELS = {
    model: "Model", layers: "Layers", hidden: "Hidden size", heads: "Heads", kv_heads: "KV heads", head_dim: "Head size",
    ffn: "MLP size", vocab: "Vocabulary", experts: "Experts", top_k: "Experts per token", tied: "Tied head",
    task: "Task", batch: "Batch (per rank)", seq: "Sequence", accumulation: "Accumulation steps", precision: "Precision",
    optimizer: "Optimizer", optimizer_in_backward: "Optimizer step in backward", offload_activations: "Activations on the host", checkpointing: "Checkpointing", checkpoint_every: "Checkpoint every K blocks", loss: "Loss", float8: "float8 matmuls", compile: "torch.compile each block", kv_len: "KV cache length", new_tokens: "New tokens", dp: "Data-parallel ranks", zero_stage: "ZeRO stage", fsdp_units: "FSDP2 units",
    tp: "Tensor-parallel ranks", sp: "Sequence parallelism", pp: "Pipeline stages", replicate: "HSDP replica groups", cp: "Context-parallel ranks", offload: "Offload", method: "Fine-tuning", lora_rank: "LoRA rank",
    lora_targets: "LoRA targets", context: "Tokens per request",
    requests: "Concurrent requests", weights: "Weights", kv_dtype: "KV dtype", block_size: "KV block size",
    gpu_memory_utilization: "GPU memory utilization", prefill_chunk: "Prefill chunk",
  };
  // A choice's words where its value alone misleads: "bf16" here is pure bf16, with no fp32 master copy.
  const CHOICE_LABELS = {
    precision: { fp32: "fp32", bf16: "pure bf16 (no fp32 master)", mixed: "mixed (fp32 weights, bf16 autocast)" },
  };
  const GROUPS = [
    ["The model", null, ["model"]],
    ["The task", null, ["task", "precision"]],
    ["The step", "train infer decode", ["batch", "seq"]],
    ["", "decode", ["kv_len", "new_tokens"]],
    ["", "train", ["accumulation", "checkpointing", "checkpoint_every", "loss", "float8", "compile", "optimizer", "optimizer_in_backward"]],
    ["Fine-tuning (Lab 15)", "train", ["method", "lora_rank", "lora_targets"]],
    ["Parallelism and offload", "train infer", ["dp", "zero_stage", "fsdp_units", "offload", "offload_activations"]],
    ["", null, ["tp"]],
    ["", "train", ["sp", "pp", "replicate", "cp"]],
    ["Serving", "serve", ["context", "requests", "weights", "kv_dtype", "block_size", "gpu_memory_utilization",
      "prefill_chunk"]],
  ];
  const MOMENTS = {
    forward_end: "the end of forward (the loss)", backward_start: "the start of backward", head_gradient:
      "the head's gradient", root_gathered: "backward's gather of the root", optimizer: "the optimizer step",
    embedding_gradient: "the optimizer step's start (DTensor's whole embedding gradient)",
    embedding_rows: "the embedding's backward (DTensor's whole gradient, this rank's rows copied out)",
    embedding_backward: "the embedding's backward (a whole new gradient beside the accumulated one)",
    embedding_end: "the embedding's backward, the last of backward (its gradient beside the head's)",
    pipeline_backward: "a steady backward of the first pipeline stage (--pp micro-batches in flight)",
    pipeline_product: "a steady backward of the first pipeline stage, at the last block's gate x up product",
    pipeline_norm: "a steady backward of the first pipeline stage, at the last block's MLP norm",
    pipeline_forward: "a steady forward's last reduce-scatter on the first pipeline stage",
    pipeline_cache: "a steady forward of the first pipeline stage (autocast's cache of its weight casts)",
    pipeline_recomputed: "a steady backward of the first pipeline stage, the last block recomputed, at its MLP norm",
    pipeline_recomputed_product: "a steady backward of the first pipeline stage, the last block recomputed, at its gate x up product",
    pipeline_recompute: "a steady backward of the first pipeline stage, as the last block is recomputed (down's weight cast)",
    block_backward: "the second block's backward (FSDP2's fp32 reduce-scatter held; with its own head unit, the last block's)",
    head_reduced: "the head unit's reduce-scatter (its bf16 gradient beside the first block's gather)",
    segment_backward: "the first segment's backward (its blocks recomputed)",
    recomputed_backward: "the second block's backward from the end, recomputed (with its own head unit, the last block's)",
    recomputed_front: "the second block's backward, recomputed (with its own embedding unit, the first block's)",
    recomputed_last: "the last block's backward, recomputed (nothing reduced yet; at ZeRO-2 every weight still gathered)",
    recomputed_second: "the second segment's backward from the end, recomputed (its own head unit; a shorter last segment)",
    second_block_backward: "the second block's backward (with its own head unit: the head's gradient reduced)",
    head_step: "the head's optimizer step, in backward",
    lora_recomputed: "the last block's backward, recomputed (its MLP's product's gradient, LoRA's frozen base)",
    lora_recompute_down: "the last block's recompute, at its down adapter (the product cast to fp32 and back)",
    lora_dequantized: "the last block's recompute, its down projection's NF4 weight read back to bf16",
    backward_end: "the end of backward (the root's gradients reduced)", infer: "the prefill", decode: "the decode step", serve: "the serving budget",
  };

  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") el.textContent = v; else el.setAttribute(k, v === true ? "" : v);
    }
    for (const kid of kids) if (kid) el.append(kid);
    return el;
  }

  function control(f) {
    const id = `fit-${f.name}`, described = `fit-hint-${f.name} fit-err-${f.name}`;
    let c;
    if (f.name === "model") {
      c = h("select", { id, name: f.name, "aria-describedby": described });
      for (const p of Object.keys(D.presets)) c.append(h("option", { value: p, text: p }));
      c.append(h("option", { value: "custom", text: "custom (the dimensions below)" }));
    } else if (f.name === "tied") {
      c = h("select", { id, name: f.name, "aria-describedby": described });
      c.append(h("option", { value: "", text: "the preset's" }), h("option", { value: "true", text: "yes" }),
        h("option", { value: "false", text: "no" }));
    } else if (f.type === "bool") {  // a switch: --optimizer-in-backward, --offload-activations
      c = h("select", { id, name: f.name, "aria-describedby": described });
      c.append(h("option", { value: "false", text: "no" }), h("option", { value: "true", text: "yes" }));
    } else if (f.type === "choice") {
      c = h("select", { id, name: f.name, "aria-describedby": described });
      const words = CHOICE_LABELS[f.name] || {};
      for (const v of f.choices) c.append(h("option", { value: String(v), text: words[v] || String(v) }));
    } else {
      c = h("input", { id, name: f.name, type: "text", inputmode: f.type === "float" ? "decimal" : f.type === "list" ? "text" : "numeric",
        autocomplete: "off", spellcheck: "false", "aria-describedby": described });
    }
    UI[f.name] = c;
    const about = note(f.name, `${f.flag}: ${f.help}`);
    return h("div", { class: "il-fit__field", "data-field": f.name },
      h("label", { for: id, text: LABELS[f.name] || f.name }), c, about);
  }

  /** A field's hint, and the slot of its error over it: the slot takes no room of its own, so a message
      coming or going moves nothing (no layout shift while typing). */
  function note(name, hint) {
    return h("div", { class: "il-fit__note" }, h("small", { class: "il-fit__hint", id: `fit-hint-${name}`, text: hint }),
      h("p", { class: "il-fit__error", id: `fit-err-${name}`, hidden: true }));
  }

  function build(el) {
    el.textContent = "";
    const form = h("form", { class: "il-fit__form", novalidate: true, "aria-label": "What to fit" });
    form.append(UI.ignored = h("p", { class: "il-fit__notice", id: "fit-ignored", role: "status", hidden: true }));
    for (const [title, task, names] of GROUPS) {
      const set = h("fieldset", { class: "il-fit__group", "data-task": task },
        title ? h("legend", { text: title }) : null);
      for (const name of names) {
        set.append(control(field(name)));
        if (task) TASK_OF[name] = task.split(" ");
      }
      if (names[0] === "model") {
        const dimsBox = h("details", { class: "il-fit__dims" }, h("summary", { text: "Dimensions: the preset's, or yours" }));
        const grid = h("div", { class: "il-fit__fields" });
        for (const k of DIMS) grid.append(control(field(k)));
        UI.config = h("textarea", { id: "fit-config_json", rows: "3", spellcheck: "false",
          "aria-describedby": "fit-hint-config_json fit-err-config_json", placeholder: '{"num_hidden_layers": 32, ...}' });
        dimsBox.append(grid, h("div", { class: "il-fit__field il-fit__field--wide", "data-field": "config_json" },
          h("label", { for: "fit-config_json", text: "Or paste a Hugging Face config.json" }), UI.config,
          note("config_json", "read as a Llama-shaped decoder: layers, sizes, heads, KV heads, experts, a tied head")));
        set.append(dimsBox);
        UI.dims = dimsBox;
      }
      form.append(set);
    }
    UI.gpu = h("select", { id: "fit-gpu", name: "gpu", "aria-describedby": "fit-hint-gpu fit-err-gpu" });
    for (const [name, g] of Object.entries(D.gpus)) UI.gpu.append(h("option", { value: name, text: `${name} (${g.stated})` }));
    form.append(h("fieldset", { class: "il-fit__group" }, h("legend", { text: "The GPU" }),
      h("div", { class: "il-fit__field", "data-field": "gpu" }, h("label", { for: "fit-gpu", text: "GPU" }), UI.gpu,
        note("gpu", "--gpu: what a process can use is Lab 13's: the driver's total, less a CUDA context and headroom"))));

    UI.verdict = h("p", { class: "il-fit__verdict", id: "fit-verdict" });
    UI.total = h("strong", { id: "fit-total" });
    UI.capacity = h("span", { id: "fit-capacity" });
    UI.moment = h("p", { class: "il-fit__line", id: "fit-moment" });
    UI.bar = h("div", { class: "il-fit__bar", role: "img", id: "fit-bar" });
    UI.capLabel = h("span", { class: "il-fit__cap-label", id: "fit-cap-label", "aria-hidden": "true" });
    UI.status = h("p", { class: "il-fit__status", role: "status" });
    // What stays in view while the inputs change (sticky, small enough to leave a phone's inputs usable):
    // the verdict and the bar, its marker labelled; the totals and the moment follow it, and scroll.
    const summary = h("section", { class: "il-fit__summary", id: "fit-result", "aria-live": "polite", "aria-label": "Result" },
      UI.verdict, UI.bar, h("p", { class: "il-fit__scale" }, UI.capLabel), UI.status);
    const lines = h("div", { class: "il-fit__lines", "aria-live": "polite" },
      h("p", { class: "il-fit__line" }, "Per rank ", UI.total, " · can use ", UI.capacity), UI.moment);
    UI.rows = {};
    const body = h("tbody");
    for (const cat of D.categories) {
      const tr = h("tr", { "data-category": cat },
        h("th", { scope: "row" }, h("span", { class: "il-fit__swatch", style: `--c:${color(cat)}` }), cat.replace("_", " ")),
        h("td", { class: "il-fit__num" }), h("td", { class: "il-fit__num" }), h("td", {}));
      UI.rows[cat] = tr;
      body.append(tr);
    }
    const table = h("table", { class: "il-fit__table", id: "fit-table" },
      h("caption", { text: "Bytes per rank at the peak, by category" }),
      h("thead", {}, h("tr", {}, h("th", { scope: "col", text: "category" }), h("th", { scope: "col", text: "bytes" }),
        h("th", { scope: "col", text: "share" }), h("th", { scope: "col", text: "measured in" }))), body);
    UI.formulas = h("div", { class: "il-fit__formulas", id: "fit-formulas" });
    UI.moments = h("div", { id: "fit-moments" });
    UI.traced = h("div", { id: "fit-traced", class: "il-fit__traced" });
    UI.levers = h("div", { id: "fit-levers" });
    UI.symbols = h("div", { id: "fit-symbols" });
    el.append(summary, lines, h("div", { class: "il-fit__scroll" }, table), form,
      h("section", { class: "il-fit__details", "aria-label": "How it is computed" },
        h("h3", { text: "Traced beside the formula" }), UI.traced,
        h("h3", { text: "Levers, cheapest first" }), UI.levers,
        h("h3", { text: "The formulas, filled in" }), UI.moments, UI.formulas,
        h("details", {}, h("summary", { text: "The symbols and their values" }), UI.symbols)));
    UI.symbols.parentElement.addEventListener("toggle", () => { if (state) drawSymbols(state); });
    const changed = (e) => {
      if (e.target === UI.config) return;
      delete offChoice[e.target.name];  // a choice made: the address's unknown one is gone
      update(true);
    };
    form.addEventListener("input", changed);
    form.addEventListener("change", changed);
    form.addEventListener("submit", (e) => e.preventDefault());
    UI.config.addEventListener("input", readConfig);
  }

  /** A pasted config.json: its dimensions become a custom model (Python: fit_inputs.from_config_json). */
  function readConfig() {
    const text = UI.config.value.trim();
    if (!text) { showError("config_json", null); return; }
    let data;
    try {
      data = JSON.parse(text);
    } catch (e) {
      showError("config_json", `not JSON: ${e.message}`);
      return;
    }
    if (data && typeof data === "object" && !Array.isArray(data) && data.text_config) data = data.text_config;
    if (!data || typeof data !== "object" || Array.isArray(data)) {
      showError("config_json", "a config.json is one JSON object");
      return;
    }
    const raw = { model: "custom" };
    for (const [name, keys] of Object.entries(D.hf_keys)) {
      const key = keys.find((k) => data[k] !== undefined && data[k] !== null);
      if (key !== undefined) raw[name] = String(data[key]);
    }
    const x = {}, errors = {};
    for (const f of D.inputs) {
      const text2 = f.name in raw ? raw[f.name] : (DIMS.includes(f.name) ? "" : controlText(f));
      const [value, error] = parseField(f, text2);
      x[f.name] = value;
      if (error) errors[f.name] = error;
    }
    const problems = Object.assign(errors, Object.keys(errors).length ? {} : check(x));
    const first = Object.values(problems)[0];
    if (first) { showError("config_json", first); return; }
    showError("config_json", null);
    for (const f of D.inputs) if (f.name === "model" || DIMS.includes(f.name)) setControl(f, raw[f.name] === undefined ? "" : raw[f.name]);
    update(true);
  }

  // ---------------------------------------------------------------------------- drawing a result
  /** A category's colour: labkit.plot's, as the site's CSS variable (assets/palette.css), so that it
   *  follows the light or dark palette as the figures do. */
  const color = (cat) => `var(--il-cat-${cat.replace(/_/g, "-")})`;
  const UNITS = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  function bytes(v) {
    const x = Number(v);
    if (x === 0) return "0";
    const [unit, size] = UNITS.find(([, s]) => Math.abs(x) >= s) || ["B", 1];
    return size === 1 ? `${x} B` : `${(x / size).toFixed(2)} ${unit}`;
  }

  /** A relative gap as a signed percentage, with a digit that is not zero (−0.0001 %, not −0.00 %). */
  function percent(gap) {
    const p = 100 * gap, digits = Math.abs(p) >= 0.01 || p === 0 ? 2 : Math.min(8, 1 - Math.floor(Math.log10(Math.abs(p))));
    return `${p >= 0 ? "+" : "−"}${Math.abs(p).toFixed(digits)} %`;
  }

  /** The lab that measures a category for these inputs: a LoRA step's adapters, gradients and state, and
      8-bit AdamW's state, are Lab 15's (to the byte on its toy, traced at real size through Lab 13). */
  const measuredIn = (x, cat) => D.measured_by[loraStep(x) || (x.task === "train" && x.optimizer === "adamw8bit"
    && cat === "optimizer_state") ? "lora" : x.task][cat];

  const labLink = (link) => h("a", { href: `../${link.page}`, text: `Lab ${String(link.lab).padStart(2, "0")}` });

  function draw(x) {
    const v = verdict(x, gpu), g = D.gpus[gpu], total = v.total;
    // Over by the bytes, as Lab 13's report says "short": a ratio rounds 80.30 GB against 80.22 GB to 1.00×.
    UI.verdict.textContent = v.fits ? `✓ Fits on ${gpu}: ${bytes(v.capacity - total)} to spare`
      : `✗ Does not fit on ${gpu}: over by ${bytes(total - v.capacity)}`;
    UI.verdict.className = `il-fit__verdict il-fit__verdict--${v.fits ? "yes" : "no"}`;
    UI.total.textContent = bytes(total);
    UI.total.dataset.bytes = total.toString();
    UI.capacity.textContent = bytes(v.capacity) + (x.task === "serve"
      ? ` (${x.gpu_memory_utilization} × ${bytes(g.total_bytes)} less ${bytes(BigInt(D.serve_non_torch_bytes))} outside PyTorch; Lab 14 adds CUDA graphs)` : "");
    UI.capacity.dataset.bytes = v.capacity.toString();
    if (x.task === "serve") {
      UI.moment.textContent = v.pool > 0n
        ? `KV pool ${bytes(v.pool)}: ${fmt(v.pool_tokens)} tokens, ${fmt(v.pool_requests)} requests of ${fmt(x.context)}`
        : "No KV pool: the weights and the prefill take everything";
      UI.moment.dataset.poolRequests = v.pool_requests.toString();
    } else {
      UI.moment.textContent = `Peak at ${MOMENTS[v.moment]}`;
      delete UI.moment.dataset.poolRequests;
    }
    UI.moment.dataset.moment = v.moment;
    drawBar(v);
    for (const cat of D.categories) {
      const b = v.cats[cat].value, tr = UI.rows[cat];
      tr.dataset.bytes = b.toString();
      tr.children[1].textContent = bytes(b);
      tr.children[2].textContent = total > 0n ? `${(100 * Number(b) / Number(total)).toFixed(1)} %` : "–";
      const link = measuredIn(x, cat), cell = tr.children[3], key = String(link && link.lab);
      if (cell.dataset.lab !== key) {  // the lab that measures it, for this task
        cell.dataset.lab = key;
        cell.textContent = "";
        cell.append(link ? labLink(link) : "–");
      }
    }
    drawFormulas(x, v);
    drawTraced(x);
    drawLevers(x, v);
  }

  function drawBar(v) {
    const scale = Number(v.total > v.capacity ? v.total : v.capacity) || 1;
    UI.bar.textContent = "";
    const parts = [];
    for (const cat of D.categories) {
      const b = Number(v.cats[cat].value);
      if (!b) continue;
      UI.bar.append(h("span", { class: "il-fit__seg", "data-category": cat,
        style: `width:${(100 * b / scale).toFixed(3)}%;--c:${color(cat)}` }));
      parts.push(`${cat.replace("_", " ")} ${bytes(b)}`);
    }
    const at = 100 * Number(v.capacity) / scale;
    UI.bar.append(h("span", { class: "il-fit__cap", style: `left:${at.toFixed(3)}%` }));
    UI.bar.setAttribute("aria-label", `${parts.join(", ")}; the GPU can use ${bytes(v.capacity)}`);
    // The marker's label, under it: from the marker rightwards, or leftwards when it sits past the middle.
    UI.capLabel.textContent = `can use ${bytes(v.capacity)}`;
    UI.capLabel.dataset.side = at > 50 ? "left" : "right";
    UI.capLabel.style.setProperty("--at", `${at.toFixed(3)}%`);
  }

  function drawFormulas(x, v) {
    const all = v.all;
    UI.moments.textContent = "";
    if (Object.keys(all).length > 1) {
      const list = h("ul", { class: "il-fit__moments" });
      for (const [name, cats] of Object.entries(all)) {
        list.append(h("li", { class: name === v.moment ? "il-fit__peak" : null, text: `${MOMENTS[name]}: ${bytes(totalOf(cats))}` }));
      }
      UI.moments.append(h("p", { text: "The step counted at each moment that can hold its peak; the largest is the answer:" }), list);
    }
    UI.formulas.textContent = "";
    const used = new Set();
    for (const cat of D.categories) {
      const e = v.cats[cat];
      if (!e.value) continue;
      for (const m of e.text.matchAll(/\b[A-Za-z]+\b/g)) used.add(m[0]);
      const link = measuredIn(x, cat);
      UI.formulas.append(h("div", { class: "il-fit__formula", "data-formula": cat, id: `fit-formula-${cat}` },
        h("p", {}, h("strong", { text: cat.replace("_", " ") }), " ", h("span", { class: "il-tag il-tag--derived", text: "derived" }),
          link ? h("span", {}, " · measured in ", labLink(link)) : null),
        h("code", { class: "il-fit__text", text: e.text }), h("code", { class: "il-fit__filled", text: `= ${e.filled}` }),
        h("p", { class: "il-fit__value", text: `= ${fmt(e.value)} bytes (${bytes(e.value)})` })));
    }
    UI.used = used;
    drawSymbols(x);
  }

  function drawSymbols(x) {  // inside a closed <details> until asked for
    UI.symbols.textContent = "";
    if (!UI.symbols.parentElement.open) return;
    const S = symbols(x, sizes(x));
    const rows = [...UI.used].filter((k) => D.symbols[k]).map((k) =>
      h("tr", {}, h("th", { scope: "row" }, h("code", { text: k })), h("td", { text: D.symbols[k] }), h("td", { class: "il-fit__num", text: fmt(S[k].value) })));
    UI.symbols.append(h("table", { class: "il-fit__table" }, h("tbody", {}, ...rows)));
  }

  /** The inputs that differ from the defaults, as text (Python: fit_table._fields). */
  function nonDefault(x) {
    const out = {};
    for (const f of D.inputs) if (String(x[f.name]) !== String(f.default)) out[f.name] = String(x[f.name]);
    return out;
  }

  function drawTraced(x) {
    const mine = nonDefault(x);
    const hit = D.traced.find((t) => {  // the same inputs, but those that leave the traced bytes as they are
      const keys = new Set([...Object.keys(t.inputs), ...Object.keys(mine)].filter((k) => !t.free.includes(k)));
      return [...keys].every((k) => (k in t.inputs ? String(t.inputs[k]) : undefined) === mine[k]);
    });
    UI.traced.textContent = "";
    const [cmd, why] = command(x, gpu), serve = x.task === "serve" ? " (the weights and a prefill's peak; the KV pool is what is left)" : "";
    const how = cmd
      ? h("p", { id: "fit-command", "data-command": cmd }, hit ? "The command that traces it again" : "No lab has traced it " +
          "yet; the command that traces it on fake tensors", `${serve}: `, h("code", { class: "il-fit__cmd", text: cmd }))
      : h("p", { id: "fit-command", "data-why": why, text: `${hit ? "" : "No lab has traced it, and no lab's command can: "}${why}.` });
    if (!hit) {
      UI.traced.append(how);
      return;
    }
    UI.traced.dataset.gap = String(hit.gap);
    UI.traced.append(h("p", {}, "Traced on fake tensors ", h("span", { class: "il-tag il-tag--traced", text: "traced" }), ": ",
      h("strong", { text: bytes(hit.bytes) }), ` (peak in ${hit.phase}); the formulas `,
      h("span", { class: "il-tag il-tag--derived", text: "derived" }), `: ${bytes(hit.formula)}; gap ${percent(hit.gap)}.`),
    hit.reserved ? h("p", { id: "fit-reserved" }, "Reserved by the caching allocator for that step ",
      h("span", { class: "il-tag il-tag--simulated", text: "simulated" }), ": ", h("strong", { text: bytes(hit.reserved) }),
      " (Lab 16 replays the trace through its model of the allocator; a GPU runs out at reserved bytes).") : "",
    h("p", { class: "il-fit__source" }, "From ", h("code", { text: hit.source }),
      hit.compared ? ` (compared: ${hit.compared.join(" and ")})` : ". A trace also holds small tensors no formula counts (the batch's token ids)."),
    how);
  }

  function drawLevers(x, v) {
    UI.levers.textContent = "";
    if (v.fits) {
      UI.levers.append(h("p", { text: "It fits: no lever is needed." }));
      return;
    }
    const steps = ladder(x, gpu, v);
    if (!steps.length) {
      UI.levers.append(h("p", { text: "No lever here applies. Fewer tokens per rank, more ranks or a larger GPU remain." }));
      return;
    }
    const list = h("ol", { class: "il-fit__levers" });
    for (const s of steps) {
      const q = new URLSearchParams(queryOf(Object.assign({}, x, s.changes)));
      const times = s.pulls > 1 ? ` (${s.pulls} times)` : "";
      list.append(h("li", { "data-lever": s.lever.name, "data-kept": String(s.kept), "data-total": s.total.toString(),
        "data-pulls": String(s.pulls) },
        h("strong", {}, h("a", { href: "?" + q.toString(), text: s.lever.name + times })),
        s.kept ? ` saves ${bytes(s.saves)}: ${bytes(s.total)}${s.fits ? " — fits" : ""}` : " saves nothing here",
        h("br"), h("small", {}, `${s.lever.numerics}; cost: ${s.lever.cost[x.task]}`,
          s.lever.lab[x.task] ? h("span", {}, " · ", labLink(s.lever.lab[x.task])) : null)));
    }
    UI.levers.append(list);
    if (!steps[steps.length - 1].fits) {
      UI.levers.append(h("p", { text: "No combination of these levers fits: fewer tokens per rank, more ranks or a larger GPU remain." }));
    }
  }
})();
