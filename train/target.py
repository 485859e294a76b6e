"""Train the embedded Qwen3-architecture target LM on the CPU.

Recorded command (see models/target/README.md for the figures it produced):

    python -m corpus.sources --out data/corpus
    python -m train.tokenizer --corpus data/corpus --out models/target --vocab 4096
    python -m train.target --steps 800 --seed 0

Weights are written as bf16 safetensors in HF layout, so
``transformers.AutoModelForCausalLM.from_pretrained("models/target")`` loads them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from actors.engine.model import CausalLM, ModelConfig
from configs.jsonio import write_json
from train.common import DOMAINS, Timer, cosine_lr, heldout_metrics, sample_batch, setup_run, write_card

TARGET_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def make_config(vocab_size: int, eos: int, shape: dict, max_pos: int = 1024) -> ModelConfig:
    return ModelConfig(model_type="qwen3", vocab_size=vocab_size, max_position_embeddings=max_pos,
                       rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=eos,
                       bos_token_id=eos, rms_norm_eps=1e-6, **shape)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The training flags (defaults: the shipped target's run)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--out", type=Path, default=Path("models/target"))
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--code-weight", type=float, default=0.6)
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from this checkpoint instead of a random init")
    return ap.parse_args(argv)


def main() -> None:
    a = parse_args()
    rng, tok, train, held = setup_run(a, a.out, 48)
    cfg = make_config(len(tok), tok.eos_token_id, TARGET_SHAPE)
    if a.init is not None:
        model = CausalLM.from_pretrained(a.init).train()
        model.fuse(False)
    else:
        model = CausalLM(cfg)
        for n, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    timer = Timer()
    log = []
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, a.steps, a.lr, 50)
        batch = sample_batch(train, [a.code_weight, 1 - a.code_weight], a.batch, a.seq, rng)
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == a.steps - 1:
            m = heldout_metrics(model, held["code"][:16])
            print(f"step {step} loss {loss.item():.3f} heldout-code top1 {m['top1']:.3f} "
                  f"t={timer.elapsed():.0f}s", flush=True)
            log.append({"step": step, "train_loss": loss.item(), "code_top1": m["top1"]})
        if step % 200 == 0 and step:
            model.save_pretrained(a.out)
    wall = timer.elapsed()
    model.save_pretrained(a.out)
    final = {d: heldout_metrics(model, held[d]) for d in DOMAINS}
    card = {"params": model.num_params(), "tokens_seen": a.steps * a.batch * a.seq,
            "wall_time_s": round(wall, 1), "seed": a.seed, "args": vars(a) | {
                "corpus": str(a.corpus), "out": str(a.out)},
            "heldout": final, "log": log}
    write_json(a.out / "training.json", card)
    write_card(a.out, "specload embedded target (Qwen3 architecture)",
               "python -m corpus.sources --out data/corpus\n"
               "python -m train.tokenizer --corpus data/corpus --out models/target --vocab 4096\n"
               f"python -m train.target --steps {a.steps} --seed {a.seed}",
               card, "Causal LM trained from scratch on CPython's stdlib source and the Python "
               "docs (held-out: 5% of files by path hash). Held-out loss is next-token "
               "cross-entropy in nats; top1 is next-token top-1 accuracy. bf16 safetensors, "
               "loads with transformers.AutoModelForCausalLM.")
    print(json.dumps({k: v for k, v in card.items() if k != "log"}, indent=2))


if __name__ == "__main__":
    main()
