"""Train a parallel block drafter (DFlash / DFlash 2 / DSpark) against the frozen target.

Recorded commands (each drafter's card repeats its own, with seed and wall time):

    python -m train.drafters --method dflash  --seed 0
    python -m train.drafters --method dflash2 --seed 0
    python -m train.drafters --method dspark  --seed 0
    python -m train.drafters --method dflash  --seed 0 --layers 3 --no-selector \
        --out models/dflash_deep
    python -m train.drafters --method dspark  --seed 0 --vllm-heads --init models/dspark \
        --minutes 6 --lr 1e-3 --out models/dspark_vllm

``--vllm-heads`` (dspark) trains the head forms vLLM 0.32's ``qwen3_dspark.py`` runs (a
token-only Markov bias, a confidence head on [h, markov_embed]), so
``train.export_vllm`` exports the drafter exactly; ``--init`` starts from a trained
drafter's weights (those whose names and shapes still fit).

Data: the target's greedy continuations of real-text windows with its hidden
states at the drafter's target layers (``train.drafter_data``). Loss: DFlash's
position-decayed cross-entropy (arXiv 2602.06036, Sec. 4.2, w_i = exp(-(i-1)/g)),
on the Markov-corrected logits for DSpark (plus a small weight on the parallel
logits), teacher-forced selector CE for DFlash 2, and BCE for DSpark's
confidence head, then Platt-calibrated on a calibration split. ``dflash``
also trains a path selector on detached features (its backbone is unchanged
by it): that is the ``dflash2_selector_only`` ablation.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from actors.drafters.config import DrafterConfig
from actors.drafters.decode import selector_loss
from actors.drafters.model import BlockDrafter
from actors.engine.model import CausalLM
from train.common import cosine_lr
from train.drafter_card import evaluate_split, fit_platt, write_card
from train.drafter_data import load_or_build, random_windows, spaced_windows

SWITCHES = {
    "dflash": dict(use_selector=True),
    "dflash2": dict(use_conv=True, use_selector=True),
    "dspark": dict(use_markov=True, use_confidence=True),
}


def block_batch(data: dict, idx: np.ndarray, nb: int, bs: int, rng: np.random.Generator):
    """Anchors (nb per row, in the generated region) and their labels.

    Returns aux [b, C, A*H] float, anchors [b, nb], anchor_ids [b, nb],
    labels [b*nb, bs-1] (-1 past the sequence end)."""
    toks = data["tokens"][idx].long()
    S, P = toks.shape[1], data["prompt_len"]
    cand = np.arange(P - 1, S - 1)
    anchors = np.sort(np.stack([rng.choice(cand, size=nb, replace=False) for _ in idx]), 1)
    a = torch.from_numpy(anchors)
    lab_pos = a[..., None] + torch.arange(1, bs)
    labels = toks.gather(1, lab_pos.clamp(max=S - 1).view(len(idx), -1)).view(len(idx), nb, bs - 1)
    labels = labels.masked_fill(lab_pos >= S, -1)
    return (data["feats"][idx].float(), a, toks.gather(1, a), labels.view(-1, bs - 1))


def train_step(model: BlockDrafter, batch, gamma: float, top_k: int,
               joint_selector: bool = False):
    aux, a, anchor_ids, labels = batch
    b, nb = a.shape
    bs = model.config.block_size
    C = aux.shape[1]
    kv = model.context_kv(aux, torch.arange(C).expand(b, C))
    ctx_mask = torch.arange(C)[None, None, :] < a[..., None]
    h = model.block_hidden(anchor_ids, a, kv, ctx_mask).view(b * nb, bs, -1)
    hd = h[:, 1:]
    valid = labels >= 0
    safe = labels.clamp(min=0)
    w = torch.exp(-torch.arange(bs - 1, dtype=torch.float32) / gamma).expand_as(labels) * valid
    base = model.lm_logits(hd)

    def wce(logits):
        ce = F.cross_entropy(logits.flatten(0, 1), safe.flatten(), reduction="none")
        return (ce * w.flatten()).sum() / w.sum()

    prev = torch.cat([anchor_ids.view(-1, 1), safe[:, :-1]], dim=1)
    stats = {}
    if model.markov is not None:
        hc, z = model.markov(hd, model.embed(prev))
        logits = model.lm_logits(hc)
        loss = wce(logits) + 0.2 * wce(base)
        if model.confidence is not None:
            cl = model.confidence(hd.detach(), z.detach(), logits.detach())
            tgt = (logits.detach().argmax(-1) == labels).float()
            bce = F.binary_cross_entropy_with_logits(cl, tgt, weight=valid.float())
            loss = loss + 0.5 * bce
            stats["bce"] = bce.item()
    else:
        logits = base
        loss = wce(base)
    if model.selector is not None:
        # dflash: detached, so its backbone stays pure DFlash; dflash2: trained jointly.
        joint = model.config.method == "dflash2" and joint_selector
        sl = selector_loss(model, hd if joint else hd.detach(), base if joint else base.detach(),
                           safe, prev, valid, top_k)
        loss = loss + sl
        stats["sel"] = sl.item()
    with torch.no_grad():
        stats["acc1"] = ((logits.argmax(-1) == labels) & valid)[:, 0].float().mean().item()
    return loss, stats


def _parse() -> argparse.Namespace:
    """The command's flags (from ``sys.argv``; a bad one exits 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--target", type=Path, default=Path("models/target"))
    ap.add_argument("--out", type=Path, default=None, help="default models/<method>")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--no-selector", action="store_true", help="dflash: skip the ablation selector")
    ap.add_argument("--vllm-heads", action="store_true",
                    help="dspark: vLLM 0.32's head forms (token-only Markov bias, confidence "
                         "on [h, markov_embed]): exported exactly by train.export_vllm")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this drafter's weights (names and shapes that fit)")
    ap.add_argument("--joint-selector", action="store_true",
                    help="dflash2: let the selector loss train the backbone too")
    ap.add_argument("--minutes", type=float, default=12.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gamma", type=float, default=4.0, help="loss decay over block positions")
    ap.add_argument("--train-seqs", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/specload_drafter_feats"))
    ap.add_argument("--prepare-only", action="store_true", help="build the feature cache, exit")
    a = ap.parse_args()
    if a.vllm_heads and a.method != "dspark":
        ap.error("--vllm-heads: only --method dspark has vLLM head forms")
    if a.init is not None and not (a.init / "model.safetensors").is_file():
        ap.error(f"--init {a.init}: no model.safetensors there")
    return a


def init_from(model: BlockDrafter, path: Path) -> list[str]:
    """Copy the weights of the drafter at ``path`` whose names and shapes fit ``model``;
    returns the names of ``model``'s weights left at their initial values."""
    from safetensors.torch import load_file

    mine = model.state_dict()
    src = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
           if k in mine and v.shape == mine[k].shape}
    model.load_state_dict({**mine, **{k: v.to(mine[k].dtype) for k, v in src.items()}})
    return sorted(set(mine) - set(src))


def _features(a: argparse.Namespace, target: CausalLM,
              cfg: DrafterConfig) -> tuple[dict, dict, dict[str, dict], float]:
    """The target's features (cached under ``--cache``) for the train, calibration and
    held-out code/prose windows, and the seconds they took."""
    arrays = {f"{d}.{s}": np.load(f"data/tokens/{d}.{s}.tokens.npy")
              for d in ("code", "prose") for s in ("train", "heldout")}
    L = a.prompt_len
    drng = np.random.default_rng(1234)  # data windows fixed across methods and seeds
    t0 = time.time()

    def split(name, fn, n):
        return load_or_build(target, a.target, cfg.target_layer_ids, name, fn, n, L,
                             a.gen_len, a.cache)

    train = split("train", lambda: random_windows(
        [arrays["code.train"], arrays["prose.train"]], [0.6, 0.4], a.train_seqs, L, drng),
        a.train_seqs)
    calib = split("calib", lambda: random_windows(
        [arrays["code.train"][-400_000:], arrays["prose.train"][-400_000:]], [0.5, 0.5], 256, L,
        np.random.default_rng(99)), 256)
    held = {d: split(f"heldout_{d}", lambda d=d: spaced_windows(arrays[f"{d}.heldout"], 192, L),
                     192) for d in ("code", "prose")}
    return train, calib, held, time.time() - t0


def _train(a: argparse.Namespace, model: BlockDrafter, train: dict, cfg: DrafterConfig,
           rng: np.random.Generator) -> tuple[int, list[dict], float]:
    """Train within ``--minutes`` / ``--max-steps`` (cosine LR, printing a JSON row every 100
    steps); return (steps, logged rows, train seconds)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr,
                            betas=(0.9, 0.95), weight_decay=0.01)
    budget = a.minutes * 60
    t_train = time.time()
    step, log = 0, []
    est_steps = a.max_steps
    while step < a.max_steps and time.time() - t_train < budget:
        if step == 20:  # estimate the step count that fits the budget for the LR schedule
            per = (time.time() - t_train) / 20
            est_steps = min(a.max_steps, int(budget / per))
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, est_steps, a.lr, 50)
        idx = rng.integers(0, len(train["tokens"]), a.batch)
        loss, st = train_step(model, block_batch(train, idx, a.anchors, cfg.block_size, rng),
                              a.gamma, cfg.top_k, a.joint_selector)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            row = {"step": step, "loss": round(loss.item(), 4), "t": round(time.time() - t_train)}
            row.update({k: round(v, 4) for k, v in st.items()})
            print(json.dumps(row), flush=True)
            log.append(row)
        step += 1
    return step, log, time.time() - t_train


def _card(a: argparse.Namespace, model: BlockDrafter, target: CausalLM, out: Path, step: int,
          log: list[dict], train_s: float, prep_s: float, calibration: dict,
          metrics: dict) -> dict:
    """The drafter card of a saved model (sizes, wall seconds, args, held-out metrics, log)."""
    return {"method": a.method, "config": json.loads(model.config.to_json()),
            "params": model.num_params(),
            "params_by_component": {c: model.num_params(c)
                                    for c in ("conv", "selector", "markov", "confidence")},
            "target_params": target.num_params(), "steps": step,
            "blocks_seen": step * a.batch * a.anchors, "train_wall_s": round(train_s, 1),
            "feature_wall_s": round(prep_s, 1), "seed": a.seed, "threads": a.threads,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "calibration": calibration, "heldout": metrics, "log": log,
            "weights_bytes": (out / "model.safetensors").stat().st_size}


def main() -> None:
    a = _parse()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    out = a.out or Path("models") / a.method
    target = CausalLM.from_pretrained(a.target).requires_grad_(False)
    sw = dict(SWITCHES[a.method])
    if a.no_selector:
        sw.pop("use_selector", None)
    if a.vllm_heads:
        sw.update(markov_hidden_term=False, confidence_logit_features=False)
    cfg = DrafterConfig.for_target(target.config, a.method, num_layers=a.layers,
                                   block_size=a.block_size, **sw)
    train, calib, held, prep_s = _features(a, target, cfg)
    print(f"features ready in {prep_s:.0f}s: train {tuple(train['feats'].shape)}", flush=True)
    if a.prepare_only:
        return
    model = BlockDrafter(cfg).bind_target(target)
    if a.init is not None:
        print(f"from {a.init}; fresh: {init_from(model, a.init)}", flush=True)
    step, log, train_s = _train(a, model, train, cfg, rng)
    model.eval()
    calibration = {}
    if model.confidence is not None:
        calibration = fit_platt(model, calib)
        model.config = replace(model.config, calib_a=calibration["a"], calib_b=calibration["b"])
    metrics = {d: evaluate_split(model, held[d]) for d in held}
    model.save(out)
    card = _card(a, model, target, out, step, log, train_s, prep_s, calibration, metrics)
    write_card(out, card)
    print(json.dumps({k: v for k, v in card.items() if k not in ("log", "config")}, indent=1))

if __name__ == "__main__":
    main()
