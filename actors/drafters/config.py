"""Configuration of the parallel (block) drafters: DFlash, DFlash 2, DSpark.

One dataclass covers the family because the three share a backbone (DeepSpec's
observation that DFlash is DSpark with two knobs at zero). Sizes and target
layer ids are derived from the target's config (``for_target``), so the same
code builds a drafter for the embedded 6-layer target or for Qwen3-4B.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from configs.metric_names import BLOCK_DRAFTER_STRATEGIES

METHODS = BLOCK_DRAFTER_STRATEGIES   # a drafter's ``method`` is its strategy id


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> tuple[int, ...]:
    """``num_ids`` target layers spread evenly from layer 1 to the last layer.

    DFlash (arXiv 2602.06036, Sec. 3.2) fuses hidden states from several
    layers spread over the target's depth; we include the last layer because
    on a small target it carries most of the next-token information.
    """
    n = max(1, min(num_ids, num_target_layers))
    if n == 1:
        return (num_target_layers - 1,)
    lo, hi = min(1, num_target_layers - 1), num_target_layers - 1
    ids = sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)})
    return tuple(int(i) for i in ids)


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and switches of one block drafter.

    hidden_size / vocab_size must equal the target's (the embedding and LM head
    are the target's, shared and frozen). block_size: tokens per draft block
    including the anchor, so a block drafts ``block_size - 1`` tokens.
    Switches: use_conv (DFlash 2 dynamic depthwise conv), use_selector (DFlash 2
    top-k path selector), use_markov (DSpark sequential head), use_confidence
    (DSpark confidence head). calib_a / calib_b: Platt scaling of the confidence
    logit (sigmoid(a * z + b)), fitted on a calibration split after training.
    markov_hidden_term / confidence_logit_features (default True, specload's
    DSpark): False gives the head forms vLLM 0.32's ``qwen3_dspark.py`` runs, a
    Markov feature of the previous token only (z = silu(P e_prev + b), so the
    logit update is the token-only bias ``markov_w2 @ markov_w1[prev]``) and a
    confidence read from [h, z] only; ``train.export_vllm`` then exports the
    drafter exactly.
    """

    method: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    target_num_layers: int
    block_size: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    use_conv: bool = False
    conv_rank: int = 8
    use_selector: bool = False
    top_k: int = 16
    selector_rank: int = 64
    use_markov: bool = False
    markov_rank: int = 64
    use_confidence: bool = False
    markov_hidden_term: bool = True
    confidence_logit_features: bool = True
    calib_a: float = 1.0
    calib_b: float = 0.0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + >= 1 draft), got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.target_num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's "
                             f"{self.target_num_layers} layers")

    @classmethod
    def for_target(cls, target_cfg, method: str, num_layers: int = 1, block_size: int = 8,
                   num_target_layer_ids: int = 3, **switches) -> "DrafterConfig":
        """A drafter sized from a target ``actors.engine.model.ModelConfig``."""
        return cls(method=method, hidden_size=target_cfg.hidden_size,
                   intermediate_size=target_cfg.intermediate_size, num_layers=num_layers,
                   num_heads=target_cfg.num_attention_heads,
                   num_kv_heads=target_cfg.num_key_value_heads, head_dim=target_cfg.head_dim,
                   vocab_size=target_cfg.vocab_size,
                   target_layer_ids=default_target_layer_ids(target_cfg.num_hidden_layers,
                                                             num_target_layer_ids),
                   target_num_layers=target_cfg.num_hidden_layers, block_size=block_size,
                   rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
                   **switches)

    def check_target(self, target_cfg) -> None:
        """Raise ValueError if this drafter cannot run against ``target_cfg``."""
        want = dict(hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                    num_hidden_layers=self.target_num_layers)
        got = {k: getattr(target_cfg, k) for k in want}
        if want != got:
            raise ValueError(f"drafter was trained for a target with {want}, but the target has "
                             f"{got}; retrain it with `python -m train.drafters --target DIR`")

    def to_json(self) -> str:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return json.dumps(d, indent=2)

    @classmethod
    def from_file(cls, path: Path) -> "DrafterConfig":
        d = json.loads(Path(path).read_text())
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{path}: unknown drafter config keys {sorted(unknown)}")
        return cls(**d)
