"""Model runner: one model, its preallocated KV cache, slots, padded ragged forwards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.kv_cache import KVCache, KVSlotPool
from actors.engine.model import BatchMeta, CausalLM, ForwardOutput, PackedGroup


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
    def run(self, rows: list[RowInput], last_only: bool | list[bool] = False,
            aux_layers: tuple[int, ...] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Forward ``rows`` in one padded batch.

        Returns (logits, aux): logits[i] is [len_i, V] (or [1, V] with
        ``last_only``, which may be a list: per row); aux[i] is [len_i, A*H] target hidden states of
        ``aux_layers`` or None when no aux layers were asked for.
        """
        lens = [len(r.token_ids) for r in rows]
        if isinstance(last_only, (list, tuple)):     # per row (a decode + prefill batch)
            if len(set(last_only)) == 1:
                last_only = bool(last_only[0])
            else:
                return self.run_packed(rows, list(last_only), aux_layers)
        if self.pack(lens):
            return self.run_packed(rows, last_only, aux_layers)
        logits, aux = self.run_padded(rows, last_only, aux_layers)
        if last_only:
            per_row = [logits[i] for i in range(len(rows))]
        else:
            per_row = [logits[i, :lens[i]] for i in range(len(rows))]
        return per_row, aux

    # a row attending alone costs about this many K/V positions' reads (the call's overhead)
    ROW_CALL_POSITIONS = 256
    MAX_LONG_ROWS = 8

    def split_long(self, rows: list[RowInput], kv_len: int
                   ) -> tuple[list[tuple[int, int, int]] | None, int | None]:
        """Which rows of a padded batch attend alone: attention reads every row's K/V up
        to the longest context, so one long request makes a batch of short ones read
        (and mask) that many positions each. Picks the j longest rows (j <= 8) that
        minimise B x (the (j+1)-th longest context) + their own contexts + a call's cost
        each; returns ([(row, slot, context)], the others' longest context) or (None,
        None) when no split pays."""
        B = len(rows)
        ctx = sorted(((r.start + len(r.token_ids), i) for i, r in enumerate(rows)), reverse=True)
        best_j, best = 0, B * kv_len
        acc = 0
        for j in range(1, min(self.MAX_LONG_ROWS, B - 1) + 1):
            acc += ctx[j - 1][0] + self.ROW_CALL_POSITIONS
            cost = B * ctx[j][0] + acc
            if cost < best:
                best_j, best = j, cost
        if best_j == 0 or best > 0.8 * B * kv_len:
            return None, None
        return ([(i, rows[i].slot, n) for n, i in ctx[:best_j]], ctx[best_j][0])

    # rows longer than this (prompt chunks) make a batch run packed: padding every row
    # to a prompt's length costs more than the per-row attention calls of a packed one
    PACK_MIN_TOKENS = 16

    # ... and so does a batch whose real tokens fill at most this share of the padded
    # B x Q (verifies of uneven draft lengths: ngram proposes 0..k tokens per row): every
    # GEMM and the LM head run over the real tokens only; its short rows still attend as
    # one padded batch (``packed_group``)
    PACK_FILL = 0.75

    def pack(self, lens: list[int]) -> bool:
        """Whether a batch with these row lengths runs packed (``run_packed``)."""
        if len(lens) < 2:
            return False
        m = max(lens)
        return m >= self.PACK_MIN_TOKENS or (m > 1 and sum(lens) <= self.PACK_FILL * len(lens) * m)

    @torch.inference_mode()
    def run_packed(self, rows: list[RowInput], last_only: bool | list[bool] = False,
                   aux_layers: tuple[int, ...] = ()
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """As ``run``, but the rows' tokens go through the model as one sequence of
        ``sum(len_i)`` tokens (no padding): every GEMM is over the real tokens only,
        and each row attends its own cache slot (``BatchMeta.segments``). What a
        batch of prompt chunks of different lengths (arrivals together) needs."""
        dev = self.device
        flags = last_only if isinstance(last_only, list) else [bool(last_only)] * len(rows)
        ids, pos, segs, masks, sel = [], [], [], [], []
        off = 0
        for r, lo in zip(rows, flags):
            n = len(r.token_ids)
            ids.extend(r.token_ids)
            pos.extend(range(r.start, r.start + n))
            segs.append((r.slot, r.start, off, n))
            if r.start == 0 or n == 1:
                masks.append(None)
            else:
                kpos = torch.arange(r.start + n, device=dev)
                qpos = torch.arange(r.start, r.start + n, device=dev)
                masks.append((kpos[None, :] <= qpos[:, None])[None, None])
            sel.extend([off + n - 1] if lo else range(off, off + n))
            off += n
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        slots_t = torch.tensor([r.slot for r in rows], dtype=torch.long, device=dev)
        meta = BatchMeta(slots=slots_t, starts=torch.tensor([r.start for r in rows],
                                                            dtype=torch.long, device=dev),
                         kv_len=max(r.start + len(r.token_ids) for r in rows),
                         segments=segs, positions=pos_t[None], seg_masks=masks)
        meta.write_pos = pos_t
        meta.write_rows = torch.repeat_interleave(
            slots_t, torch.tensor([len(r.token_ids) for r in rows], device=dev))
        meta.group = self.packed_group(rows, segs)
        # the LM head only where logits are wanted (each prompt chunk's last token)
        idx = None if not any(flags) else torch.tensor([sel], dtype=torch.long, device=dev)
        out: ForwardOutput = self.model(torch.tensor([ids], dtype=torch.long).to(dev),
                                        cache=self.cache, meta=meta, logits_index=idx,
                                        aux_layers=aux_layers)
        logits = out.logits[0].float()                     # [len(sel), V]
        per_row, at = [], 0
        for (_, _, _, n), lo in zip(segs, flags):
            k = 1 if lo else n
            per_row.append(logits[at:at + k])
            at += k
        aux = None
        if out.aux_hidden is not None:
            aux = [out.aux_hidden[0, o:o + n] for _, _, o, n in segs]
        return per_row, aux

    # a packed batch's rows of at most this many new tokens attend as one padded batch
    GROUP_MAX_Q = 16

    def packed_group(self, rows: list[RowInput], segs: list[tuple[int, int, int, int]]
                     ) -> PackedGroup | None:
        """The short rows (<= ``GROUP_MAX_Q`` new tokens: decodes, verifies, short chunks)
        of a packed batch, to attend as one padded batch on the cache instead of one
        attention call per row (at 16 users a packed step is about every second step: each
        arriving prompt rides with the running decodes). Rows with a context far longer
        than the rest stay alone (``split_long``); None when fewer than two rows qualify."""
        short = [i for i, (_, _, _, n) in enumerate(segs) if n <= self.GROUP_MAX_Q]
        if len(short) < 2:
            return None
        ctx = {i: segs[i][1] + segs[i][3] for i in short}
        long_rows, _ = self.split_long([rows[i] for i in short], max(ctx.values()))
        if long_rows:
            alone = {short[j] for j, _, _ in long_rows}
            short = [i for i in short if i not in alone]
            if len(short) < 2:
                return None
        short.sort(key=lambda i: segs[i][0])
        dev = self.device
        q_len = max(segs[i][3] for i in short)
        kv_len = max(ctx[i] for i in short)
        q_index, valid, out_index, qpos = [], [], [], []
        for b, i in enumerate(short):
            _, start, off, n = segs[i]
            q_index.extend(off + min(j, n - 1) for j in range(q_len))
            valid.extend(range(b * q_len, b * q_len + n))
            out_index.extend(range(off, off + n))
            qpos.append(range(start, start + q_len))
        slots = [segs[i][0] for i in short]
        consecutive = all(s == slots[0] + j for j, s in enumerate(slots))
        mask = None
        if q_len > 1 or any(ctx[i] != kv_len for i in short):
            qp = torch.tensor([list(r) for r in qpos], dtype=torch.long, device=dev)
            mask = (torch.arange(kv_len, device=dev)[None, None, :] <= qp[:, :, None])[:, None]
        as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        return PackedGroup(seg_ids=short, q_index=as_t(q_index), valid=as_t(valid),
                           out_index=as_t(out_index), slots=as_t(slots),
                           slot_range=(slots[0], slots[-1] + 1) if consecutive else None,
                           kv_len=kv_len, q_len=q_len, mask=mask)

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
        if B > 1:
            meta.long_rows, meta.kv_short = self.split_long(rows, meta.kv_len)
        idx = None
        if last_only:
            idx = torch.tensor([[n - 1] for n in lens], dtype=torch.long, device=self.device)
        out: ForwardOutput = self.model(ids.to(self.device), cache=self.cache, meta=meta,
                                        logits_index=idx, aux_layers=aux_layers)
        aux = None
        if out.aux_hidden is not None:
            aux = [out.aux_hidden[i, :lens[i]] for i in range(B)]
        return out.logits.float(), aux
