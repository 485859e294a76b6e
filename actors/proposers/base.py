"""The ``Proposer`` interface: every speculative strategy is one of these.

The engine drives one batched loop (``actors.engine.llm_engine``): each step it asks the
proposer for drafts for every running request at once, verifies them all in
one target forward, then tells the proposer what entered the target's KV
cache. Autoregressive decoding is the proposer that proposes nothing, so all
strategies share the same loop and their speedups are like-for-like
(z-lab/dflash's ``block_size=1`` idea).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict

from actors.engine.types import DraftProposal, ProposeInput

if TYPE_CHECKING:
    from actors.engine.model import CausalLM


class ProposerOptions(BaseModel):
    """Base of each proposer's ``strategy_options`` model (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Proposer(ABC):
    """A draft-token proposer.

    Lifecycle per request: ``add_request`` when it is admitted, ``propose``
    (batched) every decode step, ``observe_target`` whenever tokens are
    committed to the target's KV cache (prefill chunks, and after each
    verification the last token + accepted drafts), ``remove_request`` when
    it finishes or is aborted.

    Attributes:
        aux_layers: target layer indices whose hidden states this proposer
            needs (DFlash family); the engine then passes them to
            ``observe_target``. Empty for the others.
        max_draft_tokens: k, the most tokens ``propose`` returns per request.
    """

    name: str = "base"
    default_num_speculative_tokens: int = 4
    aux_layers: tuple[int, ...] = ()
    Options = ProposerOptions

    def __init__(self, target: "CausalLM", num_speculative_tokens: int, max_num_seqs: int,
                 max_model_len: int, draft_model: str | None, options: ProposerOptions):
        self.target = target
        self.max_draft_tokens = num_speculative_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.options = options

    @classmethod
    def draft_tokens_limit(cls, draft_model: str | None, options: ProposerOptions
                           ) -> tuple[int, str] | None:
        """The most draft tokens this proposer can give a request in one step whatever
        ``num_speculative_tokens`` says, and why (e.g. a drafter's fixed block size),
        read without building the proposer; None when only k limits it."""
        return None

    def compile(self) -> bool:
        """Compile the proposer's own model forwards (``ModelRunner.compile``) when the
        engine's ``enforce_eager`` is off; True when it did. Default: nothing to compile."""
        return False

    def add_request(self, request_id: str, prompt_ids: list[int]) -> None:
        """A request was admitted (its prompt is about to be prefilled)."""

    @abstractmethod
    def propose(self, batch: list[ProposeInput]) -> list[DraftProposal]:
        """Drafts for every request in ``batch`` (same order), each <= its ``max_draft``."""

    def observe_target(self, request_id: str, start: int, token_ids: list[int],
                       aux_hidden: torch.Tensor | None) -> None:
        """Tokens ``token_ids`` now sit in the target's KV cache at positions
        ``start .. start+len-1``; anything the proposer cached at or beyond
        ``start`` from an earlier guess is stale. aux_hidden: [len, A*H] target
        hidden states of those tokens (``aux_layers`` concatenated) or None."""

    def remove_request(self, request_id: str) -> None:
        """The request left the engine; free what the proposer holds for it."""

    def draft_params(self) -> int:
        """Parameters the proposer adds on top of the target (0 when none)."""
        return 0

    def memory(self) -> dict:
        """Static memory the proposer adds on top of the target, bytes:
        ``draft_weight_bytes`` (parameters and buffers not shared with the target),
        ``draft_fused_weight_bytes`` (inference copies such as fused qkv),
        ``draft_kv_allocated_bytes`` (its own KV / context cache) and
        ``draft_kv_bytes_per_token``. All 0 for proposers without a model."""
        return {"draft_weight_bytes": 0, "draft_fused_weight_bytes": 0,
                "draft_kv_allocated_bytes": 0, "draft_kv_bytes_per_token": 0}

    def kv_pool(self):
        """The ``KVSlotPool`` of the proposer's own cache (tokens held now / at peak),
        or None when it has no cache."""
        return None
