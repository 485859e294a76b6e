"""Shared pieces of the training scripts: token arrays, batches, held-out metrics."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DOMAINS = ("code", "prose")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def token_array(corpus_dir: Path, domain: str, split: str, tok, cache_dir: Path) -> np.ndarray:
    """Token ids of ``{domain}.{split}.txt`` as uint16, cached as ``.npy``."""
    cache = cache_dir / f"{domain}.{split}.tokens.npy"
    if cache.exists():
        return np.load(cache)
    text = (corpus_dir / f"{domain}.{split}.txt").read_text(encoding="utf-8")
    chunks = [text[i:i + 1_000_000] for i in range(0, len(text), 1_000_000)]
    ids = []
    for ch in chunks:  # chunk boundaries split at most one token per MB
        ids.extend(tok(ch)["input_ids"])
    arr = np.asarray(ids, dtype=np.uint16)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    return arr


def sample_batch(arrays: list[np.ndarray], weights: list[float], batch: int, seq: int,
                 rng: np.random.Generator) -> torch.Tensor:
    """[batch, seq + 1] int64 random windows, each from an array chosen by weight."""
    which = rng.choice(len(arrays), size=batch, p=np.asarray(weights) / sum(weights))
    rows = []
    for w in which:
        a = arrays[w]
        s = rng.integers(0, len(a) - seq - 1)
        rows.append(a[s:s + seq + 1].astype(np.int64))
    return torch.from_numpy(np.stack(rows))


def eval_windows(arr: np.ndarray, seq: int, n: int) -> torch.Tensor:
    """[n', seq + 1] evenly spaced, non-overlapping held-out windows (deterministic)."""
    stride = max((len(arr) - seq - 1) // n, seq + 1)
    starts = range(0, len(arr) - seq - 1, stride)
    return torch.from_numpy(np.stack([arr[s:s + seq + 1].astype(np.int64) for s in starts][:n]))


@torch.no_grad()
def heldout_metrics(model, windows: torch.Tensor, batch: int = 16) -> dict[str, float]:
    """Mean next-token cross-entropy (nats) and top-1 accuracy over windows."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        logits = model(w[:, :-1]).logits
        tgt = w[:, 1:]
        loss_sum += F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == tgt).sum().item()
        count += tgt.numel()
    model.train()
    return {"loss": loss_sum / count, "top1": correct / count, "tokens": count}


class Timer:
    def __init__(self):
        self.t0 = time.time()

    def elapsed(self) -> float:
        return time.time() - self.t0


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, frac))))


def write_card(out_dir: Path, title: str, command: str, card: dict, notes: str = "") -> None:
    """Write ``README.md`` (model card) from the training summary ``card``."""
    held = card.get("heldout", {})
    lines = [f"# {title}", "", notes, "", "## Reproduce", "", "```bash", command, "```", "",
             "## Figures (measured by the training command)", "",
             f"- parameters: {card['params']:,}",
             f"- tokens seen: {card['tokens_seen']:,}",
             f"- wall time: {card['wall_time_s'] / 60:.1f} min on this 2-core CPU (shared machine)",
             f"- seed: {card['seed']}", ""]
    if held:
        keys = sorted({k for v in held.values() for k in v if k != "tokens"})
        lines += ["| held-out split | " + " | ".join(keys) + " | tokens |",
                  "|---" * (len(keys) + 2) + "|"]
        for d, v in held.items():
            lines.append(f"| {d} | " + " | ".join(f"{v[k]:.4f}" for k in keys) +
                         f" | {v.get('tokens', '')} |")
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def setup_run(args, tokenizer_dir: Path, heldout_windows: int):
    """Seed torch/numpy, set threads, load the tokenizer and the token arrays.

    Returns (rng, tokenizer, train arrays [code, prose], held-out windows by domain).
    """
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    tok = load_tokenizer(tokenizer_dir)
    cache = Path("data/tokens")
    train = [token_array(args.corpus, d, "train", tok, cache) for d in DOMAINS]
    held = {d: eval_windows(token_array(args.corpus, d, "heldout", tok, cache), args.seq,
                            heldout_windows) for d in DOMAINS}
    return rng, tok, train, held
