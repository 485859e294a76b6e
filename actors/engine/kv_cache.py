"""The KV cache: preallocated per-slot storage and the one slot pool.

Every cache in a replica hands out slots the same way: the target model's
cache (``ModelRunner``), the draft model's cache (``draft_model`` proposer)
and the DFlash family's drafter context cache (``actors.proposers.dflash``).
``KVSlotPool`` is that one allocator. A request owns one slot from admission
to release; the pool keeps how many positions of the slot hold valid K/V
(its *length*), and ``rollback`` lowers it, which is how rejected draft
tokens leave the cache (speculative sampling, Leviathan et al. 2023, Sec. 2:
only the accepted prefix plus one target token is kept). Rolling back copies
nothing: positions past the length hold stale values that attention masks
out and the next ``append`` overwrites.
"""

from __future__ import annotations

import torch


class KVCacheFullError(RuntimeError):
    """No free slot is left (the running requests already fill ``num_slots``)."""


class KVSlotPool:
    """Slots ``0 .. num_slots-1`` owned by request id, each with a valid length.

    ``max_len`` is the most positions one request may hold (tokens). Lengths
    only move through ``append`` (reserve positions after the valid ones for a
    write) and ``rollback`` (drop positions past a kept prefix).
    """

    def __init__(self, num_slots: int, max_len: int, name: str = "KV cache"):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"{name}: num_slots ({num_slots}) and max_len ({max_len}) must be >= 1")
        self.num_slots = num_slots
        self.max_len = max_len
        self.name = name
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slot: dict[str, int] = {}
        self._length: dict[str, int] = {}
        self._used = 0          # sum of every request's length, tokens
        self.peak_used = 0      # most tokens held at once (since start or ``reset_peak``)

    @property
    def num_free(self) -> int:
        """Slots not owned by any request."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Tokens whose K/V the pool's requests hold now (sum of their lengths)."""
        return self._used

    def reset_peak(self) -> None:
        """Restart ``peak_used`` from the tokens held now."""
        self.peak_used = self._used

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slot

    def allocate(self, request_id: str) -> int:
        """Give ``request_id`` a free slot of length 0 and return the slot index.

        Raises KVCacheFullError when none is free, ValueError when the id
        already owns a slot.
        """
        if request_id in self._slot:
            raise ValueError(f"{self.name}: request {request_id!r} already owns slot "
                             f"{self._slot[request_id]}")
        if not self._free:
            raise KVCacheFullError(f"{self.name} full: all {self.num_slots} slots are in use; "
                                   "max_num_seqs must bound the running requests")
        slot = self._free.pop()
        self._slot[request_id] = slot
        self._length[request_id] = 0
        return slot

    def free(self, request_id: str) -> None:
        """Return the request's slot to the pool; an id without a slot is ignored."""
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._used -= self._length.pop(request_id)
            self._free.append(slot)

    def free_compact(self, request_id: str) -> tuple[str, int, int] | None:
        """``free``, then keep the owned slots a prefix ``0 .. n-1``: when a request
        owns a slot above the freed one, the highest such request moves into it.

        Returns ``(moved request id, from slot, to slot)`` (the caller copies that
        slot's K/V and updates what it keeps of the slot) or None when nothing moved.
        A compact pool lets a batched forward read its rows' K/V as one view of
        the cache instead of a gather per layer (``ModelRunner.run_padded``).
        """
        slot = self._slot.get(request_id)
        self.free(request_id)
        if slot is None:
            return None
        top_id, top = None, slot
        for rid, s in self._slot.items():
            if s > top:
                top_id, top = rid, s
        if top_id is not None:
            self._slot[top_id] = slot
            self._free.remove(slot)
            self._free.append(top)
        self._free.sort(reverse=True)        # pop() hands out the lowest free slot
        return None if top_id is None else (top_id, top, slot)

    def slot(self, request_id: str) -> int:
        """The request's slot index; KeyError when it owns none."""
        try:
            return self._slot[request_id]
        except KeyError:
            raise KeyError(f"{self.name}: request {request_id!r} owns no slot "
                           "(allocate it first)") from None

    def length(self, request_id: str) -> int:
        """Positions of the request's slot that hold valid K/V (tokens)."""
        self.slot(request_id)
        return self._length[request_id]

    def append(self, request_id: str, n: int) -> int:
        """Reserve ``n`` positions after the valid ones; returns the first (the write start).

        Raises ValueError when the request would pass ``max_len``.
        """
        start = self.length(request_id)
        if n < 0 or start + n > self.max_len:
            raise ValueError(f"{self.name}: request {request_id!r} holds {start} positions; "
                             f"{n} more would pass max_len {self.max_len}")
        self._length[request_id] = start + n
        self._used += n
        self.peak_used = max(self.peak_used, self._used)
        return start

    def rollback(self, request_id: str, keep: int) -> int:
        """Keep the first ``keep`` positions, drop the rest; returns how many were dropped.

        Raises ValueError when ``keep`` is negative or more than the length
        (rollback never grows a request).
        """
        have = self.length(request_id)
        if not 0 <= keep <= have:
            raise ValueError(f"{self.name}: cannot roll request {request_id!r} back to {keep} "
                             f"positions; it holds {have}")
        self._length[request_id] = keep
        self._used -= have - keep
        return have - keep


class KVCache:
    """Preallocated K/V storage of one causal LM: ``k[layer]``, ``v[layer]`` are [S, T, KVH, D].

    S = ``num_slots``, T = ``max_len + margin`` positions (the margin takes the
    writes of padded rows past a request's end), KVH / D = the model's KV heads
    and head dim. ``pool`` hands out the slots and keeps each request's length
    (at most ``max_len``); code that indexes the tensors directly (training,
    profiling) may ignore it.
    """

    def __init__(self, cfg, num_slots: int, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, margin: int = 0, name: str = "KV cache"):
        """cfg: a model config with ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``."""
        shape = (num_slots, max_len + margin, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype)
                  for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype)
                  for _ in range(cfg.num_hidden_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self.pool = KVSlotPool(num_slots, max_len, name)

    def release(self, request_id: str) -> tuple[str, int] | None:
        """Free the request's slot, keeping the owned slots compact
        (``KVSlotPool.free_compact``): the K/V of a request moved into the freed
        slot is copied there (its valid positions, every layer). Returns
        ``(moved request id, its new slot)`` or None."""
        moved = self.pool.free_compact(request_id)
        if moved is None:
            return None
        rid, src, dst = moved
        n = self.pool.length(rid)
        if n:
            for t in (*self.k, *self.v):
                t[dst, :n] = t[src, :n]
        return rid, dst
