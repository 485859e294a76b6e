"""Prefix caching on a slot cache (vLLM's automatic prefix caching, block-hashed).

A request's prompt K/V is cut into blocks of ``block_size`` tokens; block i is named
by a hash chained over every token up to its end (vLLM's block hash), so one name
means one whole prefix. When a request leaves the engine, the full blocks of its
prompt whose K/V it computed are copied from its cache slot into this store (least
recently used blocks make room). An arriving request whose prompt starts with stored
blocks gets their K/V copied into its slot and prefills only the rest (at least its
last token is computed: its logits give the first output token).

Lossless: the stored values are the target's own K/V of the same tokens at the same
positions; the rest of the prompt attends to them as it would to freshly computed
ones (one forward over the rest instead of one over all: numerical ties at ~1e-6,
as between one-token and block forwards). Not for proposers that read the target's
hidden states of every prompt token (the DFlash family's ``aux_layers``): the
engine turns it off for them.
"""

from __future__ import annotations

import collections

import torch

from actors.engine.kv_cache import KVCache


class PrefixCache:
    """``num_blocks`` blocks of ``block_size`` positions per layer, next to ``cache``."""

    def __init__(self, cache: KVCache, num_tokens: int, block_size: int = 16):
        self.block_size = block_size
        self.num_blocks = max(1, num_tokens // block_size)
        k0 = cache.k[0]
        shape = (self.num_blocks, block_size, *k0.shape[2:])
        # torch.empty: pages are touched (and counted in RSS) only as blocks are stored
        self.k = [torch.empty(shape, dtype=k0.dtype, device=k0.device) for _ in cache.k]
        self.v = [torch.empty(shape, dtype=k0.dtype, device=k0.device) for _ in cache.v]
        self.cache = cache
        self._blocks: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.hits = 0           # prompt tokens served from the store since start
        self.queries = 0        # prompt tokens looked up

    def reset(self) -> None:
        """Forget every stored block (vLLM's ``reset_prefix_cache``): the next request of
        any prompt prefills it whole. The hit counters keep counting."""
        self._blocks.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def _hashes(self, ids: list[int], n_tokens: int) -> list[int]:
        """Chained hashes of the full blocks within ``ids[:n_tokens]``."""
        out, h, bs = [], 0, self.block_size
        for i in range(n_tokens // bs):
            h = hash((h, tuple(ids[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    def load(self, ids: list[int], slot: int) -> int:
        """Copy the longest stored prefix of ``ids`` (whole blocks, at most
        ``len(ids) - 1`` tokens) into ``slot``; returns its length in tokens (0: none)."""
        self.queries += len(ids)
        found = []
        for h in self._hashes(ids, len(ids) - 1):
            b = self._blocks.get(h)
            if b is None:
                break
            self._blocks.move_to_end(h)
            found.append(b)
        if not found:
            return 0
        n = len(found) * self.block_size
        idx = torch.tensor(found, dtype=torch.long, device=self.k[0].device)
        for dst, src in zip((*self.cache.k, *self.cache.v), (*self.k, *self.v)):
            dst[slot, :n] = src.index_select(0, idx).flatten(0, 1)
        self.hits += n
        return n

    def store(self, ids: list[int], slot: int, n_valid: int) -> None:
        """Keep the full blocks of ``ids[:n_valid]`` (their K/V in ``slot``) not stored yet."""
        bs = self.block_size
        new_b, new_src = [], []
        for i, h in enumerate(self._hashes(ids, n_valid)):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            if not self._free:
                _, old = self._blocks.popitem(last=False)
                self._free.append(old)
            b = self._free.pop()
            self._blocks[h] = b
            new_b.append(b)
            new_src.append(i)
        if not new_b:
            return
        dev = self.k[0].device
        pos = (torch.tensor(new_src, device=dev)[:, None] * bs
               + torch.arange(bs, device=dev)).flatten()
        idx = torch.tensor(new_b, dtype=torch.long, device=dev)
        for src, dst in zip((*self.cache.k, *self.cache.v), (*self.k, *self.v)):
            dst.index_copy_(0, idx, src[slot].index_select(0, pos).view(len(new_b), bs,
                                                                        *src.shape[2:]))

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
