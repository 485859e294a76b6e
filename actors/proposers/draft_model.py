"""``draft_model``: a small LM drafts k tokens autoregressively, the target
verifies them (speculative sampling: Leviathan et al. 2023, arXiv 2211.17192;
Chen et al. 2023, arXiv 2302.01318).

The draft model has its own KV cache (one slot per request, from the shared
``KVSlotPool``). It remembers which token ids its cache holds; at each step
the cache is rolled back (``pool.rollback``) to the longest prefix still in
the request's sequence (rejected drafts drop out) and the missing tokens are
fed in one catch-up forward before drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.engine import memory as mem
from actors.engine.model import CausalLM
from actors.engine.runner import ModelRunner, RowInput
from actors.engine.sampling import mask_min_tokens, process_logits, sample
from actors.engine.types import DraftProposal, ProposeInput
from actors.proposers.base import Proposer, ProposerOptions

_CATCHUP_SPLIT = 8  # rows with more pending tokens (prefill) get their own forward


class DraftModelOptions(ProposerOptions):
    pass


@dataclass
class _DraftState:
    slot: int
    cached: list[int] = field(default_factory=list)  # token ids whose K/V is in the draft cache
                                                     # (len == the pool's length for the request)


class DraftModelProposer(Proposer):
    """Draft-model proposer; needs ``draft_model`` (a local HF dir, same tokenizer)."""

    name = "draft_model"
    Options = DraftModelOptions

    def __init__(self, target, num_speculative_tokens, max_num_seqs, max_model_len,
                 draft_model, options):
        super().__init__(target, num_speculative_tokens, max_num_seqs, max_model_len,
                         draft_model, options)
        if not draft_model:
            raise ValueError("strategy draft_model needs draft_model: a local HF model directory")
        dtype = target.lm_head.weight.dtype
        self.draft = CausalLM.from_pretrained(draft_model, device=target.device, dtype=dtype)
        if self.draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft vocab {self.draft.config.vocab_size} != target vocab "
                             f"{target.config.vocab_size}: the draft must share the tokenizer")
        self.runner = ModelRunner(self.draft, max_num_seqs, max_model_len, name="draft KV cache")
        self.pool = self.runner.pool
        self.state: dict[str, _DraftState] = {}

    def compile(self) -> bool:
        """The draft model's one-token steps (``propose``'s second phase) compiled."""
        return self.runner.compile()

    def draft_params(self) -> int:
        return self.draft.num_params()

    def memory(self) -> dict:
        shared = {mem.storage_key(t) for t in mem.module_tensors(self.target)}
        cfg, cache = self.draft.config, self.runner.cache
        return {"draft_weight_bytes": mem.unique_bytes(mem.module_tensors(self.draft), shared),
                "draft_fused_weight_bytes": mem.unique_bytes(mem.fused_tensors(self.draft)),
                "draft_kv_allocated_bytes": mem.cache_bytes(cache.k, cache.v),
                "draft_kv_bytes_per_token": mem.kv_bytes_per_token(
                    cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cache.k[0].dtype)}

    def kv_pool(self):
        return self.pool

    def add_request(self, request_id, prompt_ids):
        self.state[request_id] = _DraftState(slot=self.pool.allocate(request_id))

    def remove_request(self, request_id):
        self.state.pop(request_id, None)
        moved = self.runner.cache.release(request_id)   # slots stay compact (one view per forward)
        if moved is not None and moved[0] in self.state:
            self.state[moved[0]].slot = moved[1]

    def _pick(self, logits: torch.Tensor, r: ProposeInput, drafted: int):
        """logits [V] of the ``drafted``-th draft position -> (token, q [V] or None).
        EOS is masked before min_tokens, as in the target's processing (fewer wasted
        drafts; the verifier would reject a masked EOS anyway)."""
        if r.params.min_tokens > r.num_output + drafted:
            logits = logits.clone()[None]
            mask_min_tokens(logits, r.num_output + drafted, r.params, r.eos_token_id)
            logits = logits[0]
        if r.params.greedy:
            return int(logits.argmax()), None
        q = process_logits(logits, r.params)
        return int(sample(q, r.generator)), q

    def _greedy_steps(self, batch: list[ProposeInput], active: list[int],
                      drafts: dict[int, list[int]]) -> None:
        """The remaining draft steps of the greedy rows (argmax drafts, no min_tokens mask
        on any of them) in one C call per group of rows wanting the same number of steps
        (``layer_kernel.greedy_steps``: the draft model's stack, final norm, LM head and
        argmax in a loop, no Python per token); ``drafts`` and the draft cache's state
        are extended in place. Rows it does not take (sampling, a mask, no stack call,
        a position past the rotary table) are left to the per-token loop."""
        stack = self.runner.stack()
        if stack is None:
            return
        from actors.engine import layer_kernel

        groups: dict[int, list[int]] = {}
        for i in active:
            r = batch[i]
            left = r.max_draft - len(drafts[i])
            if left > 0 and drafts[i] and r.params.greedy \
                    and r.params.min_tokens <= r.num_output + len(drafts[i]):
                groups.setdefault(left, []).append(i)
        for n, rows in groups.items():
            starts = [self.pool.append(batch[i].request_id, n) for i in rows]
            got = layer_kernel.greedy_steps(
                stack, self.draft, [drafts[i][-1] for i in rows],
                [self.state[batch[i].request_id].slot for i in rows], starts, n)
            if got is None:           # not served: give the positions back, step in torch
                for i, st in zip(rows, starts):
                    self.pool.rollback(batch[i].request_id, st)
                continue
            for i, toks in zip(rows, got):
                self.state[batch[i].request_id].cached.extend([drafts[i][-1]] + toks[:-1])
                drafts[i].extend(toks)

    def _greedy_draft(self, batch: list[ProposeInput], active: list[int],
                      rows: dict[int, RowInput], drafts: dict[int, list[int]]) -> set[int]:
        """The whole proposal of the greedy rows that need no min_tokens mask, catch-up
        and every draft step, in one C call per group of rows wanting the same number of
        drafts (``layer_kernel.greedy_draft``: the catch-up forward, then the stack, final
        norm, LM head and argmax in a loop, no Python per token). ``drafts`` and the draft
        cache's state are extended in place; returns the rows it drafted (the others, and
        all where the call does not apply, go through the catch-up forward and
        ``_greedy_steps``)."""
        stack = self.runner.stack()
        if stack is None:
            return set()
        from actors.engine import layer_kernel

        groups: dict[int, list[int]] = {}
        for i in active:
            r = batch[i]
            if r.params.greedy and r.params.min_tokens <= r.num_output:
                groups.setdefault(r.max_draft, []).append(i)
        done: set[int] = set()
        for n, idx in groups.items():
            # the n - 1 drafts fed back after the first one take the next positions
            for i in idx:
                self.pool.append(batch[i].request_id, n - 1)
            got = layer_kernel.greedy_draft(stack, self.draft,
                                            [rows[i].token_ids for i in idx],
                                            [rows[i].slot for i in idx],
                                            [rows[i].start for i in idx], n)
            if got is None:          # not served: give those positions back
                for i in idx:
                    self.pool.rollback(batch[i].request_id,
                                       rows[i].start + len(rows[i].token_ids))
                continue
            for i, toks in zip(idx, got):
                self.state[batch[i].request_id].cached = list(batch[i].token_ids) + toks[:-1]
                drafts[i].extend(toks)
                done.add(i)
        return done

    def _catch_up_row(self, r: ProposeInput) -> RowInput:
        """The draft cache of ``r`` rolled back to the longest prefix it shares with the
        request's sequence, and the row of the tokens to feed next (positions reserved)."""
        st = self.state[r.request_id]
        n = 0
        lim = min(len(st.cached), len(r.token_ids))
        while n < lim and st.cached[n] == r.token_ids[n]:
            n += 1
        # always re-feed the last token: its logits give the first draft, and a propose
        # retried after a failed batch (the engine's fault isolation) finds its sequence
        # already cached
        n = min(n, len(r.token_ids) - 1)
        self.pool.rollback(r.request_id, n)
        pending = r.token_ids[n:]
        return RowInput(st.slot, self.pool.append(r.request_id, len(pending)), pending)

    @torch.inference_mode()
    def propose(self, batch: list[ProposeInput]) -> list[DraftProposal]:
        drafts: dict[int, list[int]] = {i: [] for i in range(len(batch))}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(batch))}
        active = [i for i, r in enumerate(batch) if r.max_draft > 0]
        # 1) roll back to the common prefix and feed the missing tokens.
        rows = {i: self._catch_up_row(batch[i]) for i in active}
        # ``cached`` only grows after a forward returned, so a propose that raised
        # part-way (the engine then retries request by request) leaves it true
        # (the pool is rolled back to it first).
        done = self._greedy_draft(batch, active, rows, drafts)
        for group in ([i for i in active if i not in done
                       and len(rows[i].token_ids) <= _CATCHUP_SPLIT],
                      [i for i in active if i not in done
                       and len(rows[i].token_ids) > _CATCHUP_SPLIT]):
            if not group:
                continue
            logits, _ = self.runner.run([rows[i] for i in group], last_only=True)
            for i in group:
                self.state[batch[i].request_id].cached = list(batch[i].token_ids)
            for i, lg in zip(group, logits):
                tok, q = self._pick(lg[-1], batch[i], len(drafts[i]))
                drafts[i].append(tok)
                if q is not None:
                    qs[i].append(q)
        # 2) draft one token at a time for requests that want more: greedy rows without a
        # min_tokens mask left, all their steps in one C call (``_greedy_steps``), the
        # others (and all rows where the call does not apply) one forward per token.
        self._greedy_steps(batch, active, drafts)
        while True:
            step = [i for i in active if len(drafts[i]) < batch[i].max_draft]
            if not step:
                break
            rws = []
            for i in step:
                st = self.state[batch[i].request_id]
                rws.append(RowInput(st.slot, self.pool.append(batch[i].request_id, 1),
                                    [drafts[i][-1]]))
            logits, _ = self.runner.run(rws, last_only=True)
            for i in step:
                self.state[batch[i].request_id].cached.append(drafts[i][-1])
            for i, lg in zip(step, logits):
                tok, q = self._pick(lg[-1], batch[i], len(drafts[i]))
                drafts[i].append(tok)
                if q is not None:
                    qs[i].append(q)
        return [DraftProposal(token_ids=drafts[i],
                              probs=torch.stack(qs[i]) if qs[i] else None)
                for i in range(len(batch))]
