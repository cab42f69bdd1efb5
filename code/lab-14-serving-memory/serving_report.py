"""Lab 14 - what a serving run recorded, step by step, and the tables and report made from it.

Per engine step each cache says how many pool slots hold a token's keys and values (``stored``), how
many it has taken from the pool (``held``), and why the difference is not stored: **internal** waste
(the unused tail slots of a paged cache's blocks), **reservation** waste (a static cache's slots
reserved ahead and not yet written), and **fragmentation** (free slots no request can use: the free
rows outside a growing cache's largest hole, the tail of a static pool too short for one more
region). Bytes are slots times the store's bytes per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import quantize
import serving_budget
import serving_speed
import torch

from labkit import labs, provenance
from labkit.table import Table, format_bytes


@dataclass
class StepRecord:
    step: int
    running: int
    waiting: int
    logical: int  # tokens the running sequences attend to (a shared prefix once per sequence)
    stored: int  # slots holding a token's keys and values (a shared block once)
    held: int  # slots the cache has taken from the pool
    internal: int  # unused slots in the paged cache's blocks in use
    reservation: int  # slots a static cache reserved and has not written
    fragmentation: int  # free slots no request can use
    new_tokens: int  # tokens generated in this step (decode and first tokens of prefills)
    prefilled: int  # tokens run through a prefill (prompts; after a preemption, prompt and output again)
    preempted: int
    table_entries: int  # block-table entries (paged), regions (static, growing)
    copied: int  # slots copied so far (growing: regions moved; paged: copy-on-write)


class Served:
    """One cache's run over a trace: a record per step, the tokens of each request, the rejected ones."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.name, self.pool_slots = cache.name, cache.store.slots
        self.bytes_per_token = cache.store.bytes_per_token
        self.records: list[StepRecord] = []
        self.outputs: dict[int, list[int]] = {}
        self.rejected: dict[int, str] = {}
        self.admissions = 0

    def next_seq(self) -> int:
        self.admissions += 1
        return self.admissions

    def record(self, step: int, running: list, waiting, new: int, preempted: int, prefilled: int) -> None:
        c = self.cache
        internal, reservation = c.waste()
        self.records.append(StepRecord(step, len(running), len(waiting), sum(c.lengths.values()), c.stored_slots(),
                                       c.held_slots(), internal, reservation, c.unusable_free_slots(), new, prefilled,
                                       preempted, c.table_entries(), c.copied))

    # ------------------------------------------------------------------ over the run
    def _mean(self, values) -> float:
        values = list(values)
        return sum(values) / len(values) if values else 0.0

    @property
    def preemptions(self) -> int:
        return sum(r.preempted for r in self.records)

    def metrics(self) -> dict:
        """The run in numbers: fractions of the pool (mean over steps) and of what the cache held."""
        held = sum(r.held for r in self.records)
        return {
            "utilization": self._mean(r.stored / self.pool_slots for r in self.records),
            "waste_fraction": sum(r.held - r.stored for r in self.records) / held if held else 0.0,
            "fragmentation": self._mean(r.fragmentation / self.pool_slots for r in self.records),
            "shared_fraction": 1 - sum(r.stored for r in self.records) / max(sum(r.logical for r in self.records), 1),
            "max_concurrent": max((r.running for r in self.records), default=0),
            "tokens_per_step": self._mean(r.new_tokens for r in self.records),
            "preemptions": self.preemptions, "rejected": len(self.rejected), "steps": len(self.records),
            "prefilled_tokens": sum(r.prefilled for r in self.records),
            "copied_bytes": (self.records[-1].copied if self.records else 0) * self.bytes_per_token,
            "peak_held_bytes": max((r.held for r in self.records), default=0) * self.bytes_per_token,
            "peak_stored_bytes": max((r.stored for r in self.records), default=0) * self.bytes_per_token,
            "mean_table_entries": self._mean(r.table_entries for r in self.records)}


@dataclass
class Result:
    config: object
    spec: object
    device: torch.device
    budget: object  # serving_budget.Budget
    requests: list
    pool_tokens: int
    served: dict[str, Served]
    ledgers: dict
    wall_time_s: float

    @property
    def pool_bytes(self) -> int:
        return self.pool_tokens * next(iter(self.served.values())).bytes_per_token

    def identical_tokens(self) -> bool | None:
        """Did every cache generate the same tokens for every request all of them served? (None: no model ran.)"""
        if self.config.real_size or len(self.served) < 2:
            return None
        runs = [s.outputs for s in self.served.values()]
        common = set.intersection(*(set(o) for o in runs))
        return all(run[i] == runs[0][i] for run in runs for i in common)

    def summary(self) -> dict:
        b = self.budget
        return {"lab": labs.slug(__file__), "device": str(self.device), "model": self.spec.name, "fake": self.config.real_size,
                "budget_model": b.model, "kv_bytes_per_token": b.kv_bytes_per_token, "weights_bytes": b.weights_bytes,
                "prefill_peak_bytes": b.prefill_peak_bytes, "kv_pool_bytes": b.kv_pool_bytes,
                "max_tokens_in_flight": b.max_tokens_in_flight, "budget": b.summary(),
                "requests": len(self.requests), "pool_tokens": self.pool_tokens, "pool_bytes": self.pool_bytes,
                "caches": {k: s.metrics() | {"rejected_reasons": s.rejected,
                                             "kv_cache_ledger_bytes": self.ledgers[k].peak()["kv_cache"]}
                           for k, s in self.served.items()},
                "identical_tokens": self.identical_tokens(),
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


def caches_table(result: Result) -> Table:
    """The caches side by side on one trace and one pool."""
    rows = [[name, m["utilization"], m["waste_fraction"], m["fragmentation"], m["max_concurrent"], m["tokens_per_step"],
             m["preemptions"], m["rejected"], m["peak_held_bytes"]]
            for name, m in ((n, s.metrics()) for n, s in result.served.items())]
    return Table(["cache", ("KV utilisation", "pct:1"), ("waste of held", "pct:1"), ("fragmentation", "pct:1"),
                  ("max concurrent", "int"), ("tokens / step", "float:2"), ("preemptions", "int"), ("rejected", "int"),
                  ("peak held", "bytes")], rows)


def decode_bounds(b) -> tuple[float, float]:
    """Tokens per second the budget's GPU can decode at most (derived, ``serving_speed.bound``): one sequence
    of the profiled context, and as many as the pool holds at once, in aggregate. A step reads the weights
    (a mixture of experts: at least its routed experts; a draft's too) and every sequence's cache."""
    one = serving_speed.bound(b.gpu, b.read_bytes, b.kv_bytes_per_token, b.seq_len)
    full = serving_speed.bound(b.gpu, b.read_bytes, b.kv_bytes_per_token, b.seq_len, max(b.sequences(b.seq_len), 1))
    return one, full


def budget_table(b) -> Table:
    """The serving budget of one GPU, each line labelled by where its number comes from."""
    graphs = (f"CUDA graphs: {b.cuda_graphs}, the first of {b.largest_graph} tokens" if b.cuda_graphs
              else "CUDA graphs: none (--enforce-eager)")
    rows = [
        [f"{b.gpu} x {b.utilization:g} (--gpu-memory-utilization)", b.usable_bytes, "Lab 13's driver total x flag",
         serving_budget.FIT_GPUS.GPUS[b.gpu].total_source],
        [f"weights, {b.weights}, 1/{b.tp} of {b.model}", b.weights_bytes,
         *(("traced", "on fake tensors, at the published size") if b.weights == "bf16"
           else ("counted per matrix", quantize.SOURCES[b.weights]))]]
    if b.draft:
        rows.append([f"draft model {b.draft}, {b.weights}", b.draft_weights_bytes, "traced" if b.weights == "bf16"
                     else "counted per matrix", "speculative decoding: the draft stays resident"])
    rows += [
        [f"prefill peak, {b.seq_len:,} tokens" + (f" in chunks of {b.chunk:,}" if b.chunk else ""),
         b.prefill_peak_bytes, "traced", "this lab's serving forward on fake tensors"],
        ["non-torch growth (cuBLAS workspaces)", b.non_torch_bytes,
         *(("cited", serving_budget.NON_TORCH_SOURCE) if b.non_torch_bytes == serving_budget.NON_TORCH_BYTES
           else ("--non-torch-gib", "your flag"))],
        [graphs, b.cuda_graph_bytes, "traced + vLLM's 1 MiB a graph" if b.cuda_graphs else "",
         serving_budget.GRAPH_SOURCE if b.cuda_graphs else ""],
        ["KV pool", b.kv_pool_bytes, "derived", "the first row less the rows between"],
        [f"KV per token ({b.kv_layout}, {b.kv_dtype}" + (f", + {b.draft}'s" if b.draft else "") + ")",
         b.kv_bytes_per_token, "from the config", ""],
        ["outside the budget: CUDA context, NCCL", b.outside_bytes, "not subtracted", serving_budget.CONTEXT_HOW]]
    return Table(["", ("bytes", "bytes"), "how", "source"], rows)


def budget_line(b) -> str:
    """The budget in one sentence: the line a run ends with."""
    one, full = decode_bounds(b)
    return (f"{b.model} on one {b.gpu}{f' of TP {b.tp}' if b.tp > 1 else ''}, traced: "
            f"{b.max_tokens_in_flight:,} tokens in flight, {b.sequences(b.seq_len):,} requests of "
            f"{b.seq_len:,} tokens at once; decode at most {one:,.0f} tokens/s for one, {full:,.0f} for all "
            "(bandwidth / bytes read per step)")


def report(result: Result) -> None:
    b, c = result.budget, result.config
    mode = ("bookkeeping only (real size: no tensors, no tokens)" if c.real_size
            else f"{result.spec.name} on {result.device}")
    where = f" per GPU of TP {c.tp}" if c.real_size and c.tp > 1 else ""
    print(f"Lab 14: {len(result.requests)} requests, a KV pool of {result.pool_tokens:,} tokens "
          f"({format_bytes(result.pool_bytes)}{where}), {mode}")
    print(caches_table(result).text())
    for name, s in result.served.items():
        for rid, why in list(s.rejected.items())[:3]:
            print(f"  {name}: request {rid} rejected: {why}")
    if result.identical_tokens() is not None:
        print(f"identical greedy tokens from every cache: {'yes' if result.identical_tokens() else 'NO'}")
    stands_in = (f" (the toy {result.spec.name} served above; --budget-model sizes another)"
                 if b.model != result.spec.name else "")
    print(f"\nServing budget of {b.model}{stands_in} on one {b.gpu} (TP {b.tp}), weights and prefill peak traced "
          "at real size on fake tensors (nothing allocated):")
    print(budget_table(b).text())
    print(budget_line(b))


def records_table(served: Served) -> Table:
    """Every step of one run, in bytes."""
    bpt = served.bytes_per_token
    return Table([("step", "int"), ("running", "int"), ("waiting", "int"), ("stored", "bytes"), ("held", "bytes"),
                  ("internal waste", "bytes"), ("reservation waste", "bytes"), ("fragmentation", "bytes")],
                 [[r.step, r.running, r.waiting, r.stored * bpt, r.held * bpt, r.internal * bpt, r.reservation * bpt,
                   r.fragmentation * bpt] for r in served.records])


def records_dict(served: Served) -> list[dict]:
    return [asdict(r) for r in served.records]
