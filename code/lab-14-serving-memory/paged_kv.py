"""Lab 14 - a paged KV cache: one preallocated pool per layer, cut into blocks, read through block tables.

A decoder keeps the keys and values of every token it has seen, per layer and KV head, so that each
new token attends to them without recomputing them. A serving engine does not know how long a
request will run, so where it puts those keys and values decides how much memory it wastes. The
paged cache (Kwon et al., SOSP 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention") treats the pool as fixed-size blocks, like pages of virtual memory:

* a **block allocator** hands out block numbers from a free list, and takes them back when the
  last sequence holding them lets go (reference counts);
* each sequence has a **block table**: its logical block i lives in physical block ``table[i]``,
  so a sequence grows one block at a time, anywhere in the pool, and wastes at most the unused
  slots of its last block;
* sequences with a **common prefix** hold the same physical blocks (the count goes up, nothing is
  copied); one that appends to a shared, partly filled block first copies it (**copy-on-write**);
* attention **reads K and V through the table**: a gather, in plain PyTorch here, where vLLM's
  kernel reads the blocks in place. The gathered keys and values are the contiguous ones, value for
  value, so the attention is the same (``tests/test_lab14.py`` asserts it, exactly, in fp32).

:class:`KVStore` holds the pools (shared by the two baselines in ``kv_baselines.py``, which differ
only in how they map a sequence's positions to slots), :class:`BlockAllocator` and
:class:`PagedKVCache` are the technique, :func:`attend` is the one attention every cache uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: How each --kv-dtype is stored: the element type, the largest magnitude a scaled value may take (None:
#: stored as is), and what one float32 scale covers. ``tensor``: all of one layer's keys (and one for its
#: values), vLLM's default for fp8; ``head``: one layer's KV head, vLLM's other fp8 scheme (both set once,
#: from the first keys and values written, as vLLM's ``calculate_kv_scales`` does, or from a checkpoint);
#: ``token``: each token's KV head, stored beside it in the pool (this lab's first choice, kept to compare).
KV_DTYPES = {"fp32": (torch.float32, None, None), "bf16": (torch.bfloat16, None, None),
             "fp8": (torch.float8_e4m3fn, 448.0, "tensor"), "fp8-per-head": (torch.float8_e4m3fn, 448.0, "head"),
             "fp8-per-token": (torch.float8_e4m3fn, 448.0, "token"), "int8": (torch.int8, 127.0, "token")}
SCALE_DTYPE = torch.float32
FP8_SCALES = ("https://docs.vllm.ai/en/v0.25.0/features/quantization/quantized_kvcache/ (per-tensor, one scale "
              "per Q, K and V; per-attention-head); scales set once from the first batch: vllm/attention/layer.py "
              "calc_kv_scales (https://github.com/vllm-project/vllm/pull/22758)")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str, latent: bool = False) -> int:
    """Bytes one token's keys and values take in the pool: a key and a value per layer and KV head,
    ``head_dim`` elements each, plus a float32 scale per head when the scales are per token. ``latent``:
    one vector per layer instead (multi-head latent attention caches its compressed KV, not K and V)."""
    element, qmax, per = KV_DTYPES[kv_dtype]
    per_head = head_dim * element.itemsize + (SCALE_DTYPE.itemsize if per == "token" else 0)
    return (1 if latent else 2) * layers * kv_heads * per_head


def fixed_scale_bytes(layers: int, kv_heads: int, kv_dtype: str, latent: bool = False) -> int:
    """Bytes of the scales that do not grow with the tokens: per tensor or per head, for K and for V."""
    per = KV_DTYPES[kv_dtype][2]
    count = {"tensor": 1, "head": kv_heads}.get(per, 0)
    return (1 if latent else 2) * layers * count * SCALE_DTYPE.itemsize


# --8<-- [start:store]
class KVStore:
    """The preallocated pools: per layer, a key pool and a value pool of ``slots`` rows, each row one
    token's (kv_heads, head_dim) in the cache's dtype. Allocated once; a cache only decides which
    rows a sequence owns. A quantized pool keeps its scales beside it: per row, or per layer (and head)."""

    def __init__(self, *, layers: int, slots: int, kv_heads: int, head_dim: int, kv_dtype: str = "fp32",
                 device: str | torch.device = "cpu", allocate: bool = True, latent: bool = False) -> None:
        self.slots, self.kv_dtype = slots, kv_dtype
        element, self.qmax, self.per = KV_DTYPES[kv_dtype]
        self.rounds = not element.is_floating_point  # int8 rounds to whole steps; fp8's cast rounds itself
        self.bytes_per_token = kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype, latent)
        self.fixed_bytes = fixed_scale_bytes(layers, kv_heads, kv_dtype, latent)
        self.allocate = allocate  # False: bookkeeping only (no tensors; a cache's slot counts still hold)

        def pool(dtype, *shape):
            return [torch.zeros(*shape, dtype=dtype, device=device) for _ in range(layers)]
        self.keys = self.values = self.key_scales = self.value_scales = None
        self.calibrated = [set() for _ in range(layers)]  # which of K and V have their per-layer scale set
        if allocate:
            self.keys, self.values = pool(element, slots, kv_heads, head_dim), pool(element, slots, kv_heads, head_dim)
            scale_shape = {"token": (slots, kv_heads, 1), "head": (kv_heads, 1), "tensor": (1, 1)}.get(self.per)
            if scale_shape:  # (1)!
                self.key_scales, self.value_scales = pool(SCALE_DTYPE, *scale_shape), pool(SCALE_DTYPE, *scale_shape)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' keys and values, (n, kv_heads, head_dim) each, in rows ``slots`` (n,)."""
        for name, pool, scales, x in (("k", self.keys, self.key_scales, k), ("v", self.values, self.value_scales, v)):
            if self.qmax is None:
                pool[layer][slots] = x.to(pool[layer].dtype)
                continue
            if self.per == "token":  # each row's own scale: its largest element meets the format's largest
                scales[layer][slots] = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / self.qmax
                scale = scales[layer][slots]
            else:  # (2)!
                if name not in self.calibrated[layer]:  # once: from the first keys (values) this layer sees
                    dims = (0, 2) if self.per == "head" else (0, 1, 2)
                    scales[layer][:] = x.abs().amax(dim=dims).float().clamp_min(1e-12).reshape(-1, 1) / self.qmax
                    self.calibrated[layer].add(name)
                scale = scales[layer]
            q = (x.float() / scale).clamp(-self.qmax, self.qmax)  # beyond the calibrated range: saturate
            pool[layer][slots] = (q.round() if self.rounds else q).to(pool[layer].dtype)

    def read(self, layer: int, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows ``index`` (any shape), as ``dtype``: (*index.shape, kv_heads, head_dim)."""
        k, v = self.keys[layer][index].to(dtype), self.values[layer][index].to(dtype)  # (3)!
        if self.qmax is not None:
            ks, vs = ((s[layer][index] if self.per == "token" else s[layer]).to(dtype)
                      for s in (self.key_scales, self.value_scales))
            k, v = k * ks, v * vs
        return k, v
# --8<-- [end:store]

    def copy_rows(self, src: range, dst: range) -> None:
        """Copy the rows of range ``src`` to range ``dst`` in every layer (copy-on-write, a region moved)."""
        rows = [self.keys, self.values] + ([self.key_scales, self.value_scales] if self.per == "token" else [])
        for pool in (t for pools in rows for t in pools or []):
            pool[dst.start:dst.stop] = pool[src.start:src.stop]

    def tensors(self) -> list[torch.Tensor]:
        """Every pool tensor (none for a bookkeeping-only store)."""
        return [t for pools in (self.keys, self.values, self.key_scales, self.value_scales) for t in pools or []]

    @property
    def nbytes(self) -> int:
        """Bytes of the pools: ``slots`` x bytes per token, and the per-layer scales (allocated or not)."""
        return self.slots * self.bytes_per_token + self.fixed_bytes


# --8<-- [start:allocator]
class NoFreeBlock(Exception):
    """The pool has no free block left."""


class BlockAllocator:
    """Block numbers of one pool: a free list and a reference count per block."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self.refs = [0] * num_blocks

    def allocate(self) -> int:
        if not self.free:
            raise NoFreeBlock
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1  # one more holder; nothing is copied

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)  # the last holder let go: the block is free again
# --8<-- [end:allocator]


@dataclass
class Prefix:
    """Full blocks of a common prompt prefix that later requests reuse, and how many live sequences use them."""

    blocks: list[int]
    users: int = 1


# --8<-- [start:paged]
class PagedKVCache:
    """Sequences hold blocks of ``block_size`` slots from a shared pool, listed in their block tables."""

    name = "paged"

    def __init__(self, store: KVStore, block_size: int, share_prefixes: bool = True) -> None:
        self.store, self.block_size, self.share_prefixes = store, block_size, share_prefixes
        self.num_blocks = store.slots // block_size
        self.allocator = BlockAllocator(self.num_blocks)
        self.tables: dict[int, list[int]] = {}  # sequence -> physical block of each logical block
        self.lengths: dict[int, int] = {}  # sequence -> tokens it holds
        self.prefixes: dict[object, Prefix] = {}  # prefix id -> its shared full blocks
        self.prefix_of: dict[int, object] = {}
        self.fill = [0] * self.num_blocks  # slots of each block that hold a token
        self.stored = 0  # their sum: slots holding a token, a shared block once
        self.copied = 0  # slots copied by copy-on-write

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def admit(self, seq: int, tokens: int, prefix: tuple[object, int] | None = None) -> int | None:
        """Blocks for a new sequence of ``tokens`` tokens; those of a known ``(prefix id, prefix length)``
        are shared. Returns how many tokens are already in the cache (the shared ones), or None (no room)."""
        shared = self.prefixes.get(prefix[0]) if prefix and self.share_prefixes else None
        reused = shared.blocks if shared else []
        if self.blocks_for(tokens) - len(reused) > len(self.allocator.free):
            return None
        for block in reused:
            self.allocator.share(block)  # (1)!
        if shared:
            shared.users += 1
            self.prefix_of[seq] = prefix[0]
        fresh = [self.allocator.allocate() for _ in range(self.blocks_for(tokens) - len(reused))]
        self.tables[seq], self.lengths[seq] = reused + fresh, tokens
        self._written(seq, len(reused) * self.block_size, tokens)
        return len(reused) * self.block_size

    def publish_prefix(self, seq: int, prefix: tuple[object, int]) -> None:
        """After its prefill, offer the full blocks of ``seq``'s prefix to later requests with the same prefix."""
        pid, length = prefix
        if not self.share_prefixes or pid in self.prefixes or length < self.block_size:
            return
        blocks = self.tables[seq][: length // self.block_size]
        for block in blocks:
            self.allocator.share(block)  # the prefix table holds them while some sequence uses them
        self.prefixes[pid], self.prefix_of[seq] = Prefix(blocks), pid

    def grow(self, seq: int, n: int = 1) -> bool:
        """Room for ``n`` more tokens of ``seq``: a new block when the last one is full, a private copy
        when the last one is shared (copy-on-write). False, changing nothing, when the pool is full."""
        table, length = self.tables[seq], self.lengths[seq]
        cow = length % self.block_size != 0 and self.allocator.refs[table[-1]] > 1
        if self.blocks_for(length + n) - len(table) + cow > len(self.allocator.free):
            return False
        if cow:  # (2)!
            copy = self.allocator.allocate()
            self.store.copy_rows(self._block_rows(table[-1]), self._block_rows(copy))
            self.fill[copy] = self.fill[table[-1]]
            self.copied += self.block_size
            self.stored += self.fill[copy]
            self._release(table[-1])
            table[-1] = copy
        table += [self.allocator.allocate() for _ in range(self.blocks_for(length + n) - len(table))]
        self.lengths[seq] = length + n
        self._written(seq, length, length + n)
        return True

    def fork(self, parent: int, child: int) -> None:
        """``child`` starts as a copy of ``parent`` that shares every block (parallel sampling, beam search)."""
        for block in self.tables[parent]:
            self.allocator.share(block)
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]

    def free(self, seq: int) -> None:
        for block in self.tables.pop(seq):
            self._release(block)
        del self.lengths[seq]
        pid = self.prefix_of.pop(seq, None)
        if pid is not None and pid in self.prefixes:
            entry = self.prefixes[pid]
            entry.users -= 1
            if entry.users == 0:  # no live sequence uses the prefix: its blocks go back
                for block in self.prefixes.pop(pid).blocks:
                    self._release(block)

    def slots(self, seq: int, start: int, end: int) -> list[int]:
        """Pool rows of positions start..end-1 of ``seq``: block ``table[p // B]``, offset ``p % B``."""
        table, size = self.tables[seq], self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]  # (3)!
# --8<-- [end:paged]

    def _block_rows(self, block: int) -> range:
        return range(block * self.block_size, (block + 1) * self.block_size)

    def _written(self, seq: int, start: int, end: int) -> None:
        """Positions start..end-1 of ``seq`` now hold tokens: count the slots they fill."""
        table = self.tables[seq]
        for i in range(start // self.block_size, self.blocks_for(end)):
            filled = min(self.block_size, end - i * self.block_size)
            if filled > self.fill[table[i]]:
                self.stored += filled - self.fill[table[i]]
                self.fill[table[i]] = filled

    def _release(self, block: int) -> None:
        self.allocator.release(block)
        if self.allocator.refs[block] == 0:
            self.stored -= self.fill[block]
            self.fill[block] = 0

    # ------------------------------------------------------------------ what the cache holds
    def held_slots(self) -> int:
        """Slots taken from the pool: every block in use, shared blocks once."""
        return (self.num_blocks - len(self.allocator.free)) * self.block_size

    def stored_slots(self) -> int:
        """Slots holding a token's K and V: each sequence's own tokens, a shared block counted once."""
        return self.stored

    def waste(self) -> tuple[int, int]:
        """(internal, reservation) waste in slots: the unused tail slots of blocks in use, and nothing reserved ahead."""
        return self.held_slots() - self.stored_slots(), 0

    def unusable_free_slots(self) -> int:
        return 0  # every free block serves any sequence: no external fragmentation

    def table_entries(self) -> int:
        return sum(len(t) for t in self.tables.values()) + sum(len(p.blocks) for p in self.prefixes.values())

    def fits_alone(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.num_blocks


# --8<-- [start:attend]
def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Attention of new tokens to the keys and values a cache read for them.

    ``q``: (B, T, heads, head_dim), T new tokens of each of B sequences; ``keys``, ``values``:
    (B, L, kv_heads, head_dim), the cache rows read for each sequence (padded to the longest);
    ``valid``: (B, T, L), True where query t may see key l (causal, and not padding); None for one
    whole prompt (T == L), plain causal attention, which needs no mask.
    Returns (B, T, heads * head_dim). Grouped-query attention when kv_heads < heads.
    """
    y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=None if valid is None else valid[:, None], is_causal=valid is None,
                                       enable_gqa=q.size(2) != keys.size(2))
    return y.transpose(1, 2).flatten(2)


def batch_index(cache, seqs: list[int], new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where to read each sequence's keys and values, and what each of its ``new`` newest tokens may see.

    Returns ``index`` (B, L): the pool rows of each sequence's positions 0..length-1 (a paged cache's
    come from its block table), padded with row 0 to the longest; and ``valid`` (B, new, L): True where
    a query may see a key (causal, and not padding), or None when one sequence's whole prompt is new
    (plain causal attention). The same for every layer: computed once a step.
    """
    lengths = [cache.lengths[s] for s in seqs]
    longest = max(lengths)
    index = torch.tensor([cache.slots(s, 0, n) + [0] * (longest - n) for s, n in zip(seqs, lengths)])
    if len(seqs) == 1 and new == longest:
        return index, None
    query_pos = torch.tensor(lengths)[:, None] - new + torch.arange(new)  # (B, new)
    valid = torch.arange(longest)[None, None, :] <= query_pos[:, :, None]
    return index, valid
# --8<-- [end:attend]
