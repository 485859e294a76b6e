"""Model runner: one model, its preallocated KV cache, slots, padded ragged forwards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.kv_cache import KVCache, KVSlotPool
from actors.engine.model import BatchMeta, CausalLM, ForwardOutput


@dataclass(frozen=True)
class RowInput:
    """One request's slice of a batched forward: ``token_ids`` go to positions
    ``start .. start+len-1`` of cache slot ``slot``."""

    slot: int
    start: int
    token_ids: list[int]


class ModelRunner:
    """Owns a ``CausalLM`` and a ``KVCache`` of ``num_slots`` x ``max_len`` tokens.

    ``run`` pads ragged rows to the longest one and returns logits for every
    real token (or only each row's last, for prefill), so a whole batch of
    requests with different draft lengths is verified in one forward. Slots
    and per-request lengths live in ``self.cache.pool`` (``KVSlotPool``).
    """

    # padded rows write past a request's end; this many extra positions keep
    # those writes in bounds (more than any draft length plus the anchor).
    PAD_MARGIN = 72

    def __init__(self, model: CausalLM, num_slots: int, max_len: int, pad_id: int = 0,
                 name: str = "target KV cache"):
        self.model = model
        self.device = model.device
        dtype = model.lm_head.weight.dtype
        self.cache = KVCache(model.config, num_slots, max_len, self.device, dtype,
                             margin=self.PAD_MARGIN, name=name)
        self.pool: KVSlotPool = self.cache.pool
        self.max_len = max_len
        self.pad_id = pad_id

    @torch.inference_mode()
    def run(self, rows: list[RowInput], last_only: bool = False,
            aux_layers: tuple[int, ...] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Forward ``rows`` in one padded batch.

        Returns (logits, aux): logits[i] is [len_i, V] (or [1, V] with
        ``last_only``); aux[i] is [len_i, A*H] target hidden states of
        ``aux_layers`` or None when no aux layers were asked for.
        """
        logits, aux = self.run_padded(rows, last_only, aux_layers)
        lens = [len(r.token_ids) for r in rows]
        if last_only:
            per_row = [logits[i] for i in range(len(rows))]
        else:
            per_row = [logits[i, :lens[i]] for i in range(len(rows))]
        return per_row, aux

    @torch.inference_mode()
    def run_padded(self, rows: list[RowInput], last_only: bool = False,
                   aux_layers: tuple[int, ...] = ()
                   ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """As ``run`` but logits stay one padded tensor: [B, Q, V] float32 (Q =
        longest row; positions past a row's length are padding), or [B, 1, V]
        with ``last_only``; the batched verifier reads it in one transfer."""
        B = len(rows)
        # Rows whose slots are a permutation of a consecutive range run in slot order,
        # so attention reads the cache as a view (no per-layer gather of every row's
        # context); the outputs are put back in the callers' order.
        order = sorted(range(B), key=lambda i: rows[i].slot)
        lo = rows[order[0]].slot
        consecutive = all(rows[j].slot == lo + n for n, j in enumerate(order))
        if consecutive and order != list(range(B)):
            back = [0] * B
            for n, j in enumerate(order):
                back[j] = n
            logits, aux = self.run_padded([rows[j] for j in order], last_only, aux_layers)
            return logits[back], (None if aux is None else [aux[n] for n in back])
        lens = [len(r.token_ids) for r in rows]
        Q = max(lens)
        # everything the forward needs from the host, built in Python: one tensor
        # per field, no per-row copies, no device syncs inside the model
        ids = torch.tensor([r.token_ids + [self.pad_id] * (Q - n) for r, n in zip(rows, lens)],
                           dtype=torch.long)
        starts = [r.start for r in rows]
        slots = [r.slot for r in rows]
        meta = BatchMeta(slots=torch.tensor(slots, dtype=torch.long, device=self.device),
                         starts=torch.tensor(starts, dtype=torch.long, device=self.device),
                         kv_len=max(starts) + Q,
                         single=(lo, starts[0]) if B == 1 else None,
                         slot_range=(lo, lo + B) if consecutive else None)
        idx = None
        if last_only:
            idx = torch.tensor([[n - 1] for n in lens], dtype=torch.long, device=self.device)
        out: ForwardOutput = self.model(ids.to(self.device), cache=self.cache, meta=meta,
                                        logits_index=idx, aux_layers=aux_layers)
        aux = None
        if out.aux_hidden is not None:
            aux = [out.aux_hidden[i, :lens[i]] for i in range(B)]
        return out.logits.float(), aux
