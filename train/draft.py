"""Distil the ``draft_model`` drafter from the embedded target on the CPU.

Recorded command (figures in models/draft/README.md):

    python -m train.draft --steps 600 --seed 0

Loss: KL(p_target || q_draft) over every position of random training windows
(Hinton et al. 2015 distillation; the objective DistillSpec, Zhou et al. 2024,
recommends for speculative decoding acceptance). The draft starts from the
target's embedding (tied LM head) and shares its tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from actors.engine.model import CausalLM
from configs.jsonio import write_json
from train.common import DOMAINS, Timer, cosine_lr, sample_batch, setup_run, write_card
from train.target import make_config

DRAFT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@torch.no_grad()
def agreement(target: CausalLM, draft: CausalLM, windows: torch.Tensor) -> dict[str, float]:
    """Held-out share of positions where argmax(draft) == argmax(target), and the
    draft's own next-token top-1 accuracy."""
    agree = correct = n = 0
    for i in range(0, len(windows), 16):
        w = windows[i:i + 16, :-1]
        t = target(w).logits.argmax(-1)
        d = draft(w).logits.argmax(-1)
        agree += (t == d).sum().item()
        correct += (d == windows[i:i + 16, 1:]).sum().item()
        n += t.numel()
    return {"argmax_agreement": agree / n, "top1": correct / n, "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--target", type=Path, default=Path("models/target"))
    ap.add_argument("--out", type=Path, default=Path("models/draft"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rng, tok, train, held = setup_run(a, a.target, 32)
    target = CausalLM.from_pretrained(a.target)
    for p in target.parameters():
        p.requires_grad_(False)
    draft = CausalLM(make_config(target.config.vocab_size, target.config.eos_token_id,
                                 DRAFT_SHAPE, target.config.max_position_embeddings))
    for n, p in draft.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    draft.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    opt = torch.optim.AdamW(draft.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.05)
    timer = Timer()
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, a.steps, a.lr, 30)
        batch = sample_batch(train, [0.6, 0.4], a.batch, a.seq, rng)[:, :-1]
        with torch.no_grad():
            p_t = F.log_softmax(target(batch).logits, -1)
        q = F.log_softmax(draft(batch).logits, -1)
        loss = F.kl_div(q.flatten(0, 1), p_t.flatten(0, 1), log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == a.steps - 1:
            print(f"step {step} kl {loss.item():.3f} t={timer.elapsed():.0f}s", flush=True)
    wall = timer.elapsed()
    draft.save_pretrained(a.out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(a.target / f, a.out / f)
    card = {"params": draft.num_params(), "tokens_seen": a.steps * a.batch * a.seq,
            "wall_time_s": round(wall, 1), "seed": a.seed,
            "command": f"python -m train.draft --steps {a.steps} --seed {a.seed} --threads {a.threads}",
            "heldout": {d: agreement(target, draft, held[d]) for d in DOMAINS}}
    write_json(a.out / "training.json", card)
    write_card(a.out, "specload draft model (for the draft_model strategy)", card["command"], card,
               "1-layer Qwen3-architecture LM distilled from models/target (KL to the target's "
               "next-token distribution), same tokenizer. argmax_agreement = share of held-out "
               "positions where the draft's argmax equals the target's; top1 = the draft's own "
               "next-token accuracy.")
    print(json.dumps(card, indent=2))


if __name__ == "__main__":
    main()
